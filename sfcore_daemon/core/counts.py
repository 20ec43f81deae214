"""What the daemon reports of itself: its model and settings, counters, the store."""

from __future__ import annotations

from typing import Literal

from msgspec import Struct


class ModelDescription(Struct, kw_only=True):
    path: str
    name: str
    architecture: str
    n_params: int
    n_ctx_train: int
    n_vocab: int
    size_bytes: int
    has_chat_template: bool


class EffectiveConfig(Struct, kw_only=True):
    n_ctx: int
    # The KV cache's bytes at n_ctx (all slots' pool, F16; llama/ctxsize.py).
    kv_bytes: int
    threads: int
    threads_batch: int
    batch: int
    ubatch: int
    cpu_affinity: list[int]
    mmap: bool
    mlock: bool
    # Bytes of the load's memory (weights unless mmap, KV cache, buffers) collapsed into
    # 2 MiB pages at start-up; 0 where huge_pages is off or the kernel refused.
    huge_page_bytes: int
    gpu_layers: int
    flash_attn: bool | str
    reproducible: bool
    slots: int
    prefill_per_step: int
    speculative: SpeculativeSettings
    cache: CacheSettings
    # Which template `chat` renders: "model" (the GGUF's own), a llama.cpp built-in
    # name, "jinja" (a configured template text), or None (chat is unavailable).
    chat_template: str | None


class SpeculativeSettings(Struct, kw_only=True):
    mode: Literal["ngram", "off"]
    draft_max: int
    draft_start: int
    ngram_max: int
    ngram_min: int
    store_tokens: int
    row_multiple: int
    policy: Literal["measured", "always"]
    # With "measured": each step size's cost in one-row steps, as drafts are judged.
    step_costs: dict[int, float] | None


class CacheSettings(Struct, kw_only=True):
    enabled: bool
    dir: str | None  # the disk tier's folder; None without one
    ram_mb: int
    disk_mb: int
    min_tokens: int


class Versions(Struct, kw_only=True):
    sfcore: str
    llama_cpp_python: str
    llama_cpp: str


class RequestCounts(Struct, kw_only=True):
    total: int
    by_op: dict[str, int]
    by_outcome: dict[str, int]


class TokenCounts(Struct, kw_only=True):
    prompt: int
    cached: int
    generated: int


class ConnectionCounts(Struct, kw_only=True):
    current: int
    total: int
    rejected: int


class HttpCounts(Struct, kw_only=True):
    """The OpenAI listener's connections and replies."""

    current: int  # open now
    total: int  # accepted since start
    closed: dict[str, int]  # closed by the daemon, by why (stats.HTTP_CLOSED)
    responses: dict[str, int]  # replies by HTTP status, "200" ... "503"


class SlotUse(Struct, kw_only=True):
    slot: int
    busy: bool
    requests: int  # requests started on this slot since start
    cached_tokens: int  # tokens an idle slot holds for prefix reuse


class GrammarCounts(Struct, kw_only=True):
    requests: int
    tokens: int
    resampled: int
    closed_early: int  # JSON documents closed early to fit max_tokens


class SpeculativeCounts(Struct, kw_only=True):
    requests: int  # generations that drafted at least one token
    drafted: int
    accepted: int
    steps: int  # a generation's steps with a draft, summed over generations
    aligned_steps: int  # of those, the steps with a multiple of row_multiple logit rows
    logit_rows: int  # the logit rows of those steps, as submitted
    # Of drafted and accepted: the tokens a json_schema's grammar forced.
    forced_drafted: int = 0
    forced_accepted: int = 0
    # Steps of several rows against one-row steps, live time over what the step costs
    # say (engine/costdrift.py); None until enough of both were seen or without costs.
    step_costs_drift: float | None = None
    # That ratio left the band: the kept costs are measured again at the next start.
    step_costs_drifted: bool = False


class ThreadCounts(Struct, kw_only=True):
    decode: int  # decode threads in force now
    batch: int  # batch threads in force now
    configured: int  # decode threads on an idle machine ([runtime] n_threads)
    adaptive: bool  # [runtime] adaptive_threads
    changes: int  # times the counts changed since start


class CacheCounts(Struct, kw_only=True):
    enabled: bool
    # Generations whose prompt prefix came from each source, and the rows restored
    # from stored states (RAM and disk).
    hits: dict[str, int]
    restored_tokens: int
    saved: int  # states taken from slots into the store
    written: int  # state files written
    ram_bytes: int
    ram_states: int
    disk_bytes: int
    disk_files: int
    ram_evicted: int
    disk_evicted: int
    errors: int  # damaged, foreign or unreadable files, failed writes and restores


class StoredState(Struct, kw_only=True):
    tokens: int  # the prefix's length; a prompt that starts with it restores it
    bytes: int  # the state's size (in RAM; its file adds a header)
    ram: bool
    disk: bool
    preview: str  # the start of its text
    pinned_s: int = 0  # seconds its cache mark keeps it pinned (0: not pinned)


class CacheListing(Struct, kw_only=True):
    """What the prompt store holds, and what a clear removed."""

    enabled: bool
    dir: str | None  # the disk tier's folder (this model and build's); None without one
    states: list[StoredState]  # most recently used first; [] after a clear
    removed_states: int  # by a clear: states forgotten (RAM and disk)
    removed_files: int  # by a clear: files removed from `dir`
    removed_bytes: int


class StatsSnapshot(Struct, kw_only=True):
    """The daemon's counters at one moment (the `stats` op, `/metrics`)."""

    uptime_s: float
    requests: RequestCounts
    tokens: TokenCounts
    errors: dict[str, int]
    connections: ConnectionCounts
    http: HttpCounts
    decode_tok_s: float
    slots: list[SlotUse]
    grammar: GrammarCounts
    speculative: SpeculativeCounts
    cache: CacheCounts
    threads: ThreadCounts
