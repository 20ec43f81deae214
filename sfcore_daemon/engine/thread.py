"""The model's lifetime on its own thread: load, warm up, serve, close.

`Engine` owns the decode thread. That thread loads the model, runs the warm-up
decode and then runs the `StepLoop` until `close`; everything that touches the
llama.cpp context happens on it.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
from pathlib import Path

import msgspec

from sfcore_daemon.config import ModelConfig
from sfcore_daemon.engine import costsfile, faults
from sfcore_daemon.engine.attnchoice import AttentionChoice
from sfcore_daemon.engine.costdrift import CostDrift
from sfcore_daemon.engine.crossing import Channel, JobSpec, Placement
from sfcore_daemon.engine.draftgate import StepCosts
from sfcore_daemon.engine.identity import ModelIdentity
from sfcore_daemon.engine.prefillshare import PrefillShare, prefill_share
from sfcore_daemon.engine.speculative import DraftSettings
from sfcore_daemon.engine.steploop import StepLoop, Submitted
from sfcore_daemon.engine.storepolicy import PromptStore
from sfcore_daemon.engine.threadpolicy import ThreadLimits, ThreadPolicy
from sfcore_daemon.llama.model import (
    EngineClosed,
    LoadAborted,
    Model,
    ModelLoadError,
)
from sfcore_daemon.llama.modelfile import known_sha256
from sfcore_daemon.llama.sampling import import_numpy_beside
from sfcore_daemon.llama.selfcheck import check_batched_decode
from sfcore_daemon.llama.stepcost import BUSY_SHARE, BusyMeter, measure_step_costs, step_costs_key

# How long the start-up waits for the store to index its folder (headers only: a few
# milliseconds for hundreds of files); only a hung disk takes longer.
_STORE_OPEN_TIMEOUT_S = 30.0


class Engine:
    """One model, one context, `slots` sequences, one decode thread.

    The decode thread does everything that touches the context: it loads the
    model, runs the warm-up decode and then serves jobs. Loading on it lets the
    caller go on with its own start-up (imports, the socket) while llama.cpp reads
    the model, and keeps every llama_decode on one thread: libgomp keeps a worker
    team per calling thread, and a second team (say, from a warm-up elsewhere)
    slows decode (docs/performance/design.md).
    """

    def __init__(
        self,
        model_path: str,
        model_config: ModelConfig,
        n_threads: int,
        n_threads_batch: int,
        *,
        slots: int = 1,
        prefill_per_step: int = 512,
        drafts: DraftSettings | None = None,
        store: PromptStore | None = None,
        cpus: int = 0,
        adaptive_threads: bool = False,
        step_costs_dir: Path | None = None,
    ) -> None:
        if not os.path.isfile(model_path):
            raise ModelLoadError(f"model file not found: {model_path}")
        self.model_path = model_path
        self.config = model_config
        self.n_threads = n_threads
        self.n_threads_batch = n_threads_batch
        self.slots = slots
        # Fewer threads while others hold the cores (threadpolicy.py). Without row-invariant
        # kernels (llama/invariant.py) the thread count partitions some sums.
        self.threads = ThreadPolicy(
            # (More threads than CPUs, as configured, is not the others' doing.)
            ThreadLimits(n_threads, n_threads_batch,
                         max(n_threads, cpus or os.cpu_count() or 1)),
            adaptive_threads)
        self._prefill_per_step = prefill_per_step
        self.drafts = drafts
        # Prompt states kept across evictions and restarts; None when turned off.
        self.store = store
        # Resolved once the model is loaded and warmed up, or fails with ModelLoadError.
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        # Resolved as the decode thread ends after serving: None after `close`, else the
        # exception that ended it (the server then fails everything: Server._decode_stopped).
        self.stopped: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.model: Model | None = None
        self._loop: StepLoop | None = None
        self._inbox: queue.SimpleQueue[Submitted | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._load_ticks = 0
        self.warm_up_ms = 0.0
        # The draft gate's step costs (draftgate.py): read from `step_costs_dir` at the
        # start, else measured after the warm-up (and then `save_step_costs` keeps them).
        self._costs_dir = step_costs_dir
        self._costs_path: Path | None = None
        self.step_costs: dict[int, float] | None = None
        self.step_costs_measured = False
        self.step_costs_ms = 0.0
        self.step_costs_busy = 0.0  # other processes' share of the CPUs meanwhile
        # Prompt rows a step by the step costs (short rests; beside streams with
        # prefill_per_step 0), once measured.
        self.prefill_share: PrefillShare | None = None
        self.attention = AttentionChoice(model_config, model_path, n_threads_batch)
        self._abort_load = False
        self.identity = ModelIdentity(model_path, model_config)

    @property
    def progress(self) -> int:
        """Bumped by the decode thread on every step, abort-callback tick and
        load-progress callback (plain int stores): the systemd watchdog reads it to
        tell a stuck decode thread from a busy one."""
        loop = self._loop
        return self._load_ticks + (loop.progress if loop is not None else 0)

    @property
    def step_counts(self) -> tuple[int, int]:
        """Decode steps so far and the tokens they held (the decode thread's plain
        ints; a read may see one a step newer than the other)."""
        loop = self._loop
        return (loop.decode_steps, loop.step_tokens) if loop is not None else (0, 0)

    @property
    def preempted_steps(self) -> int:
        """Prompt-only steps stopped for a newer interactive job with a prompt of at most
        n_ubatch tokens (steploop.py)."""
        return self._loop.preempted_steps if self._loop is not None else 0

    def start(self) -> concurrent.futures.Future[None]:
        """Start loading on the decode thread; the returned future says when it is ready."""
        if self._measures_costs() and self._costs_dir is not None:
            context = tuple(sorted(msgspec.structs.asdict(self.config).items()))
            key = step_costs_key(self.model_path, self.n_threads,
                                 (*context, self.slots, self._draft_rows()))
            self._costs_path = self._costs_dir / f"{key}.json"
            self.step_costs = costsfile.load(self._costs_path)
        self.attention.read(self._costs_dir)
        self.identity.start_hashing()
        self._thread = threading.Thread(target=self._main, name="sfcore-decode", daemon=True)
        self._thread.start()
        if self.store is not None:
            # Beside the model load: the store reads its folder meanwhile.
            self.store.open(self.identity.store_fingerprint)
        return self.ready

    @property
    def reply_fingerprint(self) -> str:
        return self.identity.reply_fingerprint

    def _main(self) -> None:
        try:
            importing = import_numpy_beside()
            self._load()
            self.identity.loaded(self.loaded_model().weights.rewritten, self.system_info)
            if self._abort_load:
                raise LoadAborted("the model load was stopped")
            importing.join()  # before the first request: no import then competes for the GIL
            self.warm_up()
            if self.store is not None and known_sha256(self.model_path) is not None:
                # The first request after a restart finds the states on disk (unless the
                # model must be hashed first: then the disk tier joins when that is done).
                self.store.wait_open(_STORE_OPEN_TIMEOUT_S)
        except BaseException as exc:
            self.identity.load_failed()
            self.ready.set_exception(exc)
            return
        self.ready.set_result(None)
        assert self._loop is not None
        try:
            self._loop.run(self._inbox)
        except BaseException as exc:  # the event loop logs it
            self.stopped.set_exception(exc)
        else:
            self.stopped.set_result(None)

    def _load(self) -> None:
        try:
            model = self.model = Model.load(
                self.model_path, self.config, self.n_threads, self.n_threads_batch,
                # The prompt store's sequence ids: a scratch one, one per slot and a pad
                # (kvcache.KVCache.state, .protect and .restore).
                slots=self.slots, draft_rows=self._draft_rows(),
                spare_seqs=self.slots + 2 if self.store is not None else 0,
                progress=self._on_load_progress, before_context=self.attention.choose)
        except ModelLoadError:
            if self._abort_load:
                raise LoadAborted("the model load was stopped") from None
            raise
        self.load_seconds = model.load_seconds
        self.huge_pages = model.huge_pages
        self.n_ctx = model.n_ctx
        self.context_size = model.context_size
        self.n_ubatch = model.n_ubatch
        self.info = model.info
        self.system_info = model.system_info
        self.bos_text, self.eos_text = model.bos_text, model.eos_text
        self._loop = StepLoop(model, self.slots, self._prefill_per_step, self.drafts,
                              self.store, self.threads)

    def _draft_rows(self) -> int:
        if self.drafts is None:
            return 0
        return min(self.drafts.step_rows, self.config.n_batch - self.slots)

    # --- used from the event loop -----------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        """See Model.tokenize: thread-safe, refused once the model is closed."""
        return self.loaded_model().tokenize(text, add_special, parse_special)

    def tokenize_segments(self, segments: list[tuple[str, bool]]) -> list[int]:
        return self.loaded_model().tokenize_segments(segments)

    def detokenize(self, tokens: list[int]) -> str:
        return self.loaded_model().detokenize(tokens)

    def loaded_model(self) -> Model:
        if (model := self.model) is None:
            raise EngineClosed("the model is not loaded")
        return model

    def abort_load(self) -> None:
        """Make a model load in progress fail soon (at llama.cpp's next progress call)."""
        self._abort_load = True

    def _on_load_progress(self, _fraction: float) -> bool:
        self._load_ticks += 1
        return not self._abort_load

    def submit(self, spec: JobSpec, placement: Placement, out: Channel) -> None:
        """Run `spec` where `placement` says; what it makes comes back through `out`
        (crossing.py). The loop's one way to hand the decode thread a job."""
        self._inbox.put((spec, placement, out))
        if self._loop is not None:
            self._loop.submitted(spec)

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the decode thread and free the model; False if something would not stop
        (then nothing is freed, and the OS reclaims it at exit).

        Called while the model is still loading, this aborts the load.
        """
        self._abort_load = True
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        model = self.model
        if model is None:
            return True
        if self.store is not None:
            # The decode thread saved the slots' states as it stopped: write them out.
            started = time.monotonic()
            self.store.close(timeout)
            timeout = max(1.0, timeout - (time.monotonic() - started))
        if not model.close(timeout):
            return False
        if self._loop is not None:
            self._loop.free()
        return True

    def warm_up(self) -> None:
        """One batched decode before serving: the first request does not pay for
        first-touch costs, and a build that cannot run on this CPU dies now (selfcheck).
        Then the step costs the drafts and the prompt rows beside streams are judged by,
        unless they were read."""
        model = self.loaded_model()
        self.warm_up_ms = check_batched_decode(model)
        if not self._measures_costs():
            return
        if self.step_costs is None:
            started = time.perf_counter()
            busy = BusyMeter()
            self.step_costs = measure_step_costs(
                model, most_rows=self.slots + self._draft_rows()) or None
            self.step_costs_ms = (time.perf_counter() - started) * 1000
            self.step_costs_busy = busy.share()
            self.step_costs_measured = self.step_costs is not None
        if self.step_costs is not None:
            self.step_costs = faults.step_costs(self.step_costs)
            assert self._loop is not None
            if self._judges_drafts():
                self._loop.use_step_costs(self.step_costs)
            self.prefill_share = prefill_share(self.step_costs, self.slots)
            if self.prefill_share is not None:
                self._loop.use_prefill_share(self.prefill_share)

    def save_step_costs(self) -> None:
        """Keep step costs measured at this start for the next (event loop, after
        `ready`: file I/O stays off the decode thread)."""
        if (self.step_costs_measured and self.step_costs and self._costs_path is not None
                and self.step_costs_busy <= BUSY_SHARE):
            costsfile.save(self._costs_path, self.step_costs)

    @property
    def cost_drift(self) -> CostDrift | None:
        """Live steps against the step costs the drafts are judged by (costdrift.py);
        None before the model is loaded or where drafts are not judged by them."""
        loop = self._loop
        return loop.cost_drift if loop is not None and loop.step_costs is not None else None

    def discard_step_costs(self) -> bool:
        """Remove the kept step costs, so that the next start measures them again (the
        event loop, once they drifted); False if no file was removed."""
        return self._costs_path is not None and costsfile.discard(self._costs_path)

    def step_cost_ratios(self) -> dict[int, float] | None:
        """Each size's cost in one-row steps, as the drafts are judged by; None when
        they are not."""
        loop = self._loop
        costs: StepCosts | None = loop.step_costs if loop is not None else None
        return costs.ratios() if costs is not None else None

    def _judges_drafts(self) -> bool:
        drafts = self.drafts
        return drafts is not None and drafts.measured

    def _measures_costs(self) -> bool:
        # One slot never reads a prompt beside a stream. Once measured, the costs also size
        # short rests' steps (prefillshare.py); they alone do not pay seconds at each start.
        return self._judges_drafts() or (self._prefill_per_step == 0 and self.slots > 1)
