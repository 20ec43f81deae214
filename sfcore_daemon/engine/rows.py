"""A step's results, on the decode thread: how each logit row becomes its sequence's next
token, and what the token does.

The one place that decides how a row's token is chosen: numpy's argmax for a plain
greedy request, the request's own sampler chain (sampling.py), or, with a grammar, the
grammar sampler around that chain (grammar.py; near the end of a JSON request's
budget, its closer, closer.py). A grammar draw that needs a wide pass parks the sequence
until a thread beside the steps has made it. A drafted run of rows is verified token by
token; each token taken is handed to the event loop through its job's channel
(crossing.py), the loop woken at most once per step for all jobs. A request that asks
for logprobs gets each token's numbers from the row it was chosen from (a draft token:
the row that verified it; logprobs.py).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from sfcore_daemon.engine import crossing, faults
from sfcore_daemon.engine.crossing import Channel, EndReason
from sfcore_daemon.engine.drafting import verified
from sfcore_daemon.engine.job import Job
from sfcore_daemon.engine.sequence import Seq
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.logprobs import RowLogprobs, RowNumbers, TokenLogprobs
from sfcore_daemon.llama.model import Model
from sfcore_daemon.llama.sampling import PENALTY_LAST_N, argmax, is_plain_greedy, make_chain

if TYPE_CHECKING:
    from sfcore_daemon.structured.grammar import GrammarSampler


class Rows:
    """Each job's way of choosing its tokens, and the draw from each row of a step."""

    def __init__(self, model: Model, end: Callable[[Seq, EndReason], None]) -> None:
        self.model = model
        self._ctx = model.ctx
        self._vocab = model.vocab
        self._n_vocab = model.info.n_vocab
        self._memory = model.memory
        self._end = end  # steploop.Ending.end
        # Wide grammar passes (grammar.py) may take over a second: they run here, beside
        # the steps, not inside the step every sequence shares (docs/configuration.md).
        self._wide_passes = ThreadPoolExecutor(1, thread_name_prefix="sfcore-grammar")
        # Scratch for the logprobs of requests that ask (logprobs.py): one for the
        # steps, one for the wide passes' thread; made when first needed.
        self._logprobs: RowLogprobs | None = None
        self._wide_logprobs: RowLogprobs | None = None

    def shutdown(self) -> None:
        self._wide_passes.shutdown(wait=True)

    def prepare(self, seq: Seq, job: Job) -> None:
        """How `job` on `seq` (its limit set) chooses its tokens: its sampler chain,
        numpy's argmax in place of a chain that is one, its grammar around the chain."""
        spec = job.spec
        seq.sampler, penalties = make_chain(self._vocab, spec.sampling, spec.prompt)
        seq.argmax = is_plain_greedy(spec.sampling)
        seq.penalties = penalties
        if job.grammar_live:  # it counts its tokens against the same limit
            assert job.grammar is not None
            job.grammar.begin(seq.limit, penalties, PENALTY_LAST_N)

    def read(self, outputs: list[tuple[Seq, int]], woken: list[Channel]) -> None:
        """The tokens of a decoded step's logit rows (StepBatch.outputs)."""
        for seq, row in outputs:
            try:
                if seq.draft:
                    self._verify(seq, row, woken)
                    continue
                drawn = self._sample(seq, row)
                if drawn is not None:
                    self.take(seq, drawn, woken)
            except Exception as exc:  # one request's failure ends that request alone
                self.fail(seq, exc)

    def _sample(self, seq: Seq, row: int) -> int | None:
        """The sequence's next token from the logits of `row`; None when a wide grammar
        pass will draw it (the sequence is parked) or the job ended with an error."""
        job = seq.job
        assert job is not None
        grammar = job.grammar
        try:
            token: int
            first = argmax(self._ctx, row, self._n_vocab) if seq.argmax else -1
            if grammar is None or not job.grammar_live:
                token = first if seq.argmax else C.llama_sampler_sample(
                    seq.sampler, self._ctx, row)
            else:
                if grammar.closer is not None:
                    # As if the closer (closer.py) failed, for the tests.
                    faults.hit("closer", job)
                # Checks the chain's choice (`first`, when the chain is an argmax)
                # against the grammar (see grammar.py).
                drawn = grammar.sample(seq.sampler, self._ctx, row, first)
                if drawn is None:
                    self._park(seq, job, grammar, row)
                    return None
                token = drawn
            asked = job.spec.logprobs
            if asked is not None:  # all a job that asks for none pays
                job.out.put_numbers(self._numbers(
                    token, self._row_logprobs().of_row(self._ctx, row, token, asked)))
            return token
        except Exception as exc:  # one request's failure ends that request alone
            self.fail(seq, exc)
            return None

    def _park(self, seq: Seq, job: Job, grammar: GrammarSampler, row: int) -> None:
        """Leave the draw to a wide grammar pass beside the steps (the sequence sits out
        until it is made). Its logprobs come from a copy of the row: by the time the
        pass has chosen, later steps have overwritten the logits."""
        if job.spec.logprobs is None:
            seq.parked = self._wide_passes.submit(grammar.sample_wide, seq.sampler)
            return
        logits = self._row_logprobs().copy_row(self._ctx, row)
        seq.parked = self._wide_passes.submit(self._sample_wide, grammar, seq.sampler, job,
                                              logits)

    def _sample_wide(self, grammar: GrammarSampler, chain: Any, job: Job, logits: Any) -> int:
        """A wide pass's draw, with its logprobs (on the wide passes' thread)."""
        token = grammar.sample_wide(chain)
        if self._wide_logprobs is None:
            self._wide_logprobs = RowLogprobs(self._n_vocab)
        asked = job.spec.logprobs
        assert asked is not None
        chosen, ids, logprobs = self._wide_logprobs.of(logits, token, asked)
        # The model's piece cache is the decode thread's to fill: read it, else a
        # buffer of this pass's own.
        model, buf = self.model, ctypes.create_string_buffer(256)
        pieces = [model.pieces.get(alt) or model.piece_into(alt, buf) for alt in ids]
        job.out.put_numbers(TokenLogprobs(token, chosen, ids, logprobs, pieces))
        return token

    def _numbers(self, token: int, numbers: RowNumbers) -> TokenLogprobs:
        """A row's numbers with the alternatives' bytes (decode thread)."""
        chosen, ids, logprobs = numbers
        model = self.model
        cached = model.pieces
        pieces = [cached.get(alt) or model.piece(alt) for alt in ids]
        return TokenLogprobs(token, chosen, ids, logprobs, pieces)

    def _row_logprobs(self) -> RowLogprobs:
        if self._logprobs is None:  # the first request that asks
            self._logprobs = RowLogprobs(self._n_vocab)
        return self._logprobs

    def _verify(self, seq: Seq, row: int, woken: list[Channel]) -> None:
        """Sample the rows of the pending token and its draft in order, exactly as one
        token a step would: each draft token is kept while it equals what the chain
        drew from the row before it; the first that differs ends the run, and the
        drawn token is the next one. The rejected tokens' cells are removed."""
        draft, seq.draft = seq.draft, []
        taken: list[int] = []
        accepted = 0
        vocab = self._vocab
        for index in range(len(draft) + 1):
            token = self._sample(seq, row + index)
            if token is None:  # parked after `accepted` tokens, or ended
                break
            taken.append(token)
            if (index == len(draft) or token != draft[index]
                    or C.llama_vocab_is_eog(vocab, token)):
                break
            accepted += 1
        job = seq.job
        if job is None:  # ended with an error: its cells are gone
            return
        seq.cached.extend(draft[:accepted])
        if accepted < len(draft):
            C.llama_memory_seq_rm(self._memory, seq.id, len(seq.cached), -1)
        verified(seq, len(draft), accepted)
        for token in taken:
            self.take(seq, token, woken)
            if seq.job is None:
                break

    def take(self, seq: Seq, token: int, woken: list[Channel]) -> None:
        """A sampled token: the end of the job, or a piece of its output and the
        sequence's next input. A failure here ends that request alone."""
        try:
            self._take_token(seq, token, woken)
        except Exception as exc:
            self.fail(seq, exc)

    def _take_token(self, seq: Seq, token: int, woken: list[Channel]) -> None:
        job = seq.job
        assert job is not None
        now = time.perf_counter_ns()
        if seq.n_out == 0:
            job.t_first = now
        if C.llama_vocab_is_eog(self._vocab, token):
            self._end(seq, "stop")
            return
        model = self.model
        piece = model.pieces.get(token)
        if piece is None:
            piece = model.piece(token)
        job.out.put(piece, now, woken)
        seq.n_out += 1
        if seq.drafter is not None:
            seq.drafter.append(token)
        if not job.grammar_live and job.spec.grammar_trigger is not None:
            self._watch_trigger(seq, job, piece)
        if seq.n_out >= seq.limit:
            # A document its grammar would end here is whole: "stop", not "length".
            grammar = job.grammar
            self._end(seq, "stop" if grammar is not None and job.grammar_live
                      and grammar.complete() else "length")
            return
        seq.last_token = token
        seq.generating = True

    @staticmethod
    def _watch_trigger(seq: Seq, job: Job, piece: bytes) -> None:
        """Start the job's grammar once its output ends with the trigger (or the trigger
        and whitespace, already written, which JSON allows before the call); it then
        holds the rest, within what is left of the limit."""
        trigger, grammar = job.spec.grammar_trigger, job.grammar
        assert trigger is not None and grammar is not None
        tail = job.trigger_tail + piece
        if tail.rstrip().endswith(trigger):
            job.grammar_live = True
            job.trigger_tail = b""
            grammar.begin(max(seq.limit - seq.n_out, 0), seq.penalties, PENALTY_LAST_N)
            return
        job.trigger_tail = tail[-(len(trigger) + 8):]

    # One wake-up of the event loop per step, whatever the number of streams.
    wake = staticmethod(crossing.wake)

    @staticmethod
    def unpark(seq: Seq) -> None:
        """Wait for the sequence's wide grammar pass (it uses the samplers ending frees)."""
        if seq.parked is not None:
            wait([seq.parked])
            seq.parked = None

    def fail(self, seq: Seq, exc: BaseException) -> None:
        """End `seq`'s job with the error `exc`, unless it has ended already."""
        job = seq.job
        if job is not None:
            job.error = exc
            self.unpark(seq)
            self._end(seq, "error")
