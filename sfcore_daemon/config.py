"""Daemon configuration: frozen msgspec Structs decoded once from TOML.

Every option and its default lives here and nowhere else; `server_config.toml`
documents the same values for people. CLI flags are applied by `apply_overrides`,
the only place a decoded config is changed.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

DEFAULT_SOCKET_NAME = "sfcore-ai.sock"
DEFAULT_SOCKET_PATH = "/tmp/" + DEFAULT_SOCKET_NAME
CONFIG_FILE_NAME = "server_config.toml"

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
# C int fields: larger values would wrap silently when handed to llama.cpp.
CInt = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class ServerConfig(_Section, frozen=True):
    # Empty: $RUNTIME_DIRECTORY/sfcore-ai.sock under systemd, else /tmp/sfcore-ai.sock.
    socket_path: str = ""
    socket_mode: Annotated[str, msgspec.Meta(pattern=r"^0?[0-7]{3}$")] = "0600"
    # Both empty: anyone who can open the socket file may talk to the daemon.
    # Otherwise a peer needs its uid in allowed_uids or one of its groups in allowed_gids.
    allowed_uids: tuple[NonNegInt, ...] = ()
    allowed_gids: tuple[NonNegInt, ...] = ()
    # Requests decoded together, each its own sequence in one KV pool of model.n_ctx
    # cells; see docs/performance/slots.md.
    slots: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    # Prompt tokens per decode step while others stream (alone: whole n_batch chunks); 0: as
    # many as cost what the streams' rows do, by measured step costs (engine/prefillshare.py).
    prefill_per_step: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] = 0
    max_queue: NonNegInt = 64
    max_connections: PositiveInt = 64
    max_line_bytes: Annotated[int, msgspec.Meta(ge=256)] = 1 << 20
    max_output_buffer_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 1 << 20
    # Unanswered requests one connection may have; past this the daemon stops
    # reading from it until one is answered (flow control, not an error).
    max_pending_requests: PositiveInt = 32
    # A connection with no request in flight that sends nothing for this long is
    # closed; 0 never closes idle connections.
    idle_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 300.0
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    # CPU time one request may spend on its grammar (step checks and wide candidate
    # passes) before it ends with grammar_dead_end; 0: no limit (docs/configuration.md).
    grammar_budget_s: Annotated[float, msgspec.Meta(ge=0)] = 3.0

    @property
    def socket_mode_bits(self) -> int:
        return int(self.socket_mode, 8)

    def resolved_socket_path(self) -> str:
        if self.socket_path:
            return self.socket_path
        runtime_dir = os.environ.get("RUNTIME_DIRECTORY")
        if runtime_dir:
            # systemd may list several directories separated by ':'; the first is ours.
            return os.path.join(runtime_dir.split(":")[0], DEFAULT_SOCKET_NAME)
        return DEFAULT_SOCKET_PATH


class ModelConfig(_Section, frozen=True):
    # Empty: the embedded default model (Gemma 3 270M Q4_K_M).
    path: str = ""
    # Tokens the context holds, every slot's prompts and replies together; 0: what the
    # model was trained for, cut to kv_budget_mb (llama/ctxsize.py).
    n_ctx: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] = 0
    # The KV cache's budget for n_ctx = 0, in MiB; 0: a quarter of the machine's memory.
    kv_budget_mb: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 0
    n_batch: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)] = 512
    n_ubatch: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)] = 512
    # False: weights read into the daemon's memory, where huge_pages can back them in
    # 2 MiB pages; True: the file is mapped, shared through the page cache in 4 KiB pages.
    use_mmap: bool = False
    use_mlock: bool = False
    # Ask for 2 MiB pages under the memory the load makes: weights, KV cache, buffers.
    huge_pages: bool = True
    # -1 offloads every layer; 0 keeps the model on the CPU. "auto": -1 where the
    # llama.cpp build has a GPU backend that finds a device, else 0 (gpu.py).
    n_gpu_layers: Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)] | Literal["auto"] = "auto"
    flash_attn: bool | Literal["auto"] = "auto"
    # A long prompt's full steps with attention as matrix products (llama/attnprobe.py):
    # "auto" where measured faster on this machine, "on" at every depth, "off" never.
    matmul_attention: Literal["auto", "on", "off"] = "auto"
    # Q5_0 tensors loaded from a copy of the file that holds them as Q8_0, the same
    # numbers (llama/repack.py): "auto" where they are a mix's fallbacks, "on", "off".
    rewrite_q5_0: Literal["auto", "on", "off"] = "auto"
    # Row-invariant kernels (llama/invariant.py): a reply's bytes do not depend on what
    # else the batch holds, on speculation, on the thread count or on the cache's history.
    reproducible: bool = False
    # For `chat` when the model file has no template: a llama.cpp built-in name ("gemma")
    # or Jinja text; empty: the built-in matching the model's architecture, if any.
    chat_template: str = ""

    def __post_init__(self) -> None:
        if 0 < self.n_ctx < 64:
            raise ValueError(f"n_ctx ({self.n_ctx}) must be 0 (the model's own) or at least 64")
        if self.n_ubatch > self.n_batch:
            raise ValueError(
                f"n_ubatch ({self.n_ubatch}) must not exceed n_batch ({self.n_batch})"
            )
        if self.reproducible and self.flash_attn is False:
            # Without flash attention a row's attention sums run over the cells by their
            # place in the pool, which other traffic decides.
            raise ValueError("reproducible = true needs flash attention: set flash_attn "
                             "to \"auto\" or true")


class RuntimeConfig(_Section, frozen=True):
    # Empty: every CPU the process may run on.
    cpu_affinity: tuple[NonNegInt, ...] = ()
    # 0: derived from the pinned set (physical cores for decode, logical CPUs for batches).
    n_threads: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    n_threads_batch: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    # Decode with fewer threads while other processes hold the cores, back up once
    # they are gone (engine/threadpolicy.py). False: always n_threads.
    adaptive_threads: bool = True


class GenerationConfig(_Section, frozen=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)] = 512
    temperature: Annotated[float, msgspec.Meta(ge=0, le=1e6)] = 0.8
    top_k: CInt = 40
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.95
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.05
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0, le=1e6)] = 1.0


class SpeculativeConfig(_Section, frozen=True):
    # "ngram": drafts from the request's own text, verified in one decode step
    # (docs/performance/speculative.md); "off": one token a step.
    mode: Literal["ngram", "off"] = "ngram"
    # Tokens one draft may propose; a match drafts twice as far as it runs back, at
    # least draft_start tokens (speculative.py).
    draft_max: Annotated[int, msgspec.Meta(ge=2, le=256)] = 64
    draft_start: Annotated[int, msgspec.Meta(ge=2, le=256)] = 4
    # N-gram lengths matched, the longest first.
    ngram_max: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    ngram_min: Annotated[int, msgspec.Meta(ge=1, le=16)] = 2
    # "measured": draft only as far as it pays, by this machine's step costs and past
    # acceptance (engine/draftgate.py); "always": every draft the matching proposes.
    policy: Literal["measured", "always"] = "measured"
    # Output tokens of finished requests kept to draft later ones from; 0: none. A seeded
    # request never drafts from it: a regenerate verifies in other shapes, other bytes.
    store_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] = 262144
    # Drafts are cut or grown to make a step's logit rows a multiple of this (1: as drafted);
    # see docs/performance/speculative.md, "Rows come in fours".
    row_multiple: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    # A json_schema request also drafts the text its grammar forces (keys, punctuation),
    # verified like n-gram drafts (structured/forced.py).
    forced_drafts: bool = True

    def __post_init__(self) -> None:
        if self.draft_start > self.draft_max:
            raise ValueError(f"draft_start ({self.draft_start}) must not exceed "
                             f"draft_max ({self.draft_max})")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed "
                             f"ngram_max ({self.ngram_max})")


class CacheConfig(_Section, frozen=True):
    # Long prefixes' KV cells kept in RAM and on disk and restored instead of evaluated
    # again (store/promptstore.py).
    enabled: bool = True
    # Empty: $CACHE_DIRECTORY (systemd's CacheDirectory=) or $XDG_CACHE_HOME/sfcore-ai
    # (~/.cache/sfcore-ai), plus "/prompts".
    dir: str = ""
    # RAM tier budget; 0: sized to the machine (1/16 of its memory, at most 2048 MB).
    ram_mb: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    # Disk tier budget, least recently used files removed first; 0: no disk tier.
    disk_mb: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] = 2048
    # A request that evaluated at least this many prompt tokens has its state saved.
    min_tokens: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)] = 256
    # A state read from disk that takes longer is given up and its prompt evaluated;
    # while that read is stuck (a hung disk), restores skip the disk tier.
    disk_read_timeout_ms: Annotated[int, msgspec.Meta(ge=1, le=3_600_000)] = 5000


class ListenAddress(NamedTuple):
    """Where the OpenAI-compatible listener binds: a TCP host and port, or a Unix path."""

    host: str
    port: int
    unix_path: str

    @property
    def is_loopback(self) -> bool:
        if self.unix_path:
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name: what it resolves to is not known here
            return False

    def __str__(self) -> str:
        if self.unix_path:
            return f"unix:{self.unix_path}"
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


_HOST_PORT = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9.-]+)):(?P<port>\d{1,5})$")


def parse_listen(text: str) -> ListenAddress:
    """`127.0.0.1:8080`, `[::1]:8080`, `localhost:8080` or `unix:/path/to.sock`;
    ValueError for anything else."""
    if text.startswith("unix:"):
        path = text.removeprefix("unix:")
        if not path.startswith("/"):
            raise ValueError(f"{text!r}: a Unix socket path must be absolute (unix:/path)")
        return ListenAddress("", 0, path)
    match = _HOST_PORT.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not HOST:PORT, [IPv6]:PORT or unix:/path")
    port = int(match["port"])
    if port > 65535:
        raise ValueError(f"{text!r}: port {port} is not in 0-65535")
    host = match["v6"] or match["host"]
    if match["v6"]:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{text!r}: {host} is not an IPv6 address") from None
    return ListenAddress(host, port, "")


# An origin as browsers send it (scheme://host[:port]), or "*"; a Host header's value
# (name or name:port), or "*".
Origin = Annotated[str, msgspec.Meta(pattern=r"^(\*|[A-Za-z][A-Za-z0-9+.-]*://[^/\s]+)$")]
HostName = Annotated[str, msgspec.Meta(pattern=r"^(\*|[^\s/*]+)$")]


class OpenAIConfig(_Section, frozen=True):
    # Empty: no HTTP listener; else "127.0.0.1:8080", "[::1]:8080" or "unix:/path".
    # Anything not loopback needs allow_remote; port 0 takes a free port, logged.
    listen: str = ""
    # true: `listen` may be an address other hosts reach (0.0.0.0, a LAN address, a
    # host name). The endpoint then serves whoever reaches it: set api_key.
    allow_remote: bool = False
    # Non-empty: every request but GET /health must send `Authorization: Bearer <key>`.
    api_key: str = ""
    # The model's id in /v1/models and in replies. Empty: the model file's name
    # without .gguf.
    model_id: str = ""
    # A remote listener (allow_remote) with no api_key serves anyone who reaches it:
    # refused at start-up unless this is true too (and then a warning is logged).
    allow_remote_without_key: bool = False
    # Per-phase limits, so no connection holds a descriptor long: no byte of a first
    # request, headers, body (408), an unread reply. Between: [server] idle_timeout_s.
    first_request_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 60.0
    header_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 10.0
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 30.0
    write_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 30.0
    # Origins besides the listener's own (others get 403), and Host names a loopback listener
    # takes besides localhost, against DNS rebinding; "*": any (docs/openai.md#web-pages).
    allowed_origins: tuple[Origin, ...] = ()
    allowed_hosts: tuple[HostName, ...] = ()
    # Responses kept for previous_response_id and GET, least recently used out first;
    # on disk in [cache] dir + /responses when the prompt store has a folder (restarts).
    stored_responses: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 1000
    stored_responses_mb: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 256
    # A streamed reply waiting for its first output (queued, or its prompt being read)
    # gets an SSE comment this often, so proxies and SDKs keep waiting; 0: never.
    keepalive_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 5.0

    @property
    def address(self) -> ListenAddress | None:
        return parse_listen(self.listen) if self.listen else None

    def __post_init__(self) -> None:
        address = self.address
        if address is None or address.is_loopback:
            return
        if not self.allow_remote:
            raise ValueError(
                f"listen = {self.listen!r} is not a loopback address: other hosts could "
                "reach it. Set allow_remote = true (and an api_key) to serve them")
        if not self.api_key and not self.allow_remote_without_key:
            raise ValueError(
                f"listen = {self.listen!r} with allow_remote and no api_key would serve "
                "anyone who reaches it: set api_key (or allow_remote_without_key = true)")


class LogConfig(_Section, frozen=True):
    level: Literal["debug", "info", "warning", "error"] = "info"


class Config(_Section, frozen=True):
    server: ServerConfig = ServerConfig()
    model: ModelConfig = ModelConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    generation: GenerationConfig = GenerationConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    cache: CacheConfig = CacheConfig()
    openai: OpenAIConfig = OpenAIConfig()
    log: LogConfig = LogConfig()

    def __post_init__(self) -> None:
        if self.server.slots > self.model.n_batch:
            raise ValueError(
                f"server.slots ({self.server.slots}) must not exceed model.n_batch "
                f"({self.model.n_batch}): every slot adds a token to each batch")


class ConfigError(Exception):
    """A config problem, worded for the person who wrote the file."""


_UNKNOWN_FIELD = re.compile(
    r"^Object contains unknown field `(?P<key>[^`]+)`(?: - at `\$(?P<at>[^`]*)`)?$")
_AT_PATH = re.compile(r"^(?P<what>.*) - at `\$(?P<at>[^`]*)`$")


def _dotted(path: str) -> str:
    # msgspec paths look like `.server.max_queue` or `.runtime.cpu_affinity[2]`.
    return path.lstrip(".")


def describe_validation_error(error: msgspec.ValidationError) -> str:
    """Turn msgspec's `... - at `$.a.b`` into a message that names the TOML key first."""
    text = str(error)
    if match := _UNKNOWN_FIELD.match(text):
        key = ".".join(filter(None, (_dotted(match["at"] or ""), match["key"])))
        return f"unknown key `{key}`"
    if match := _AT_PATH.match(text):
        return f"`{_dotted(match['at'])}`: {match['what']}"
    return text


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Decode `path`, or `./server_config.toml` when present, or the built-in defaults."""
    if path is None:
        default = Path(CONFIG_FILE_NAME)
        if not default.is_file():
            return Config()
        path = default
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        return msgspec.toml.decode(data, type=Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config {path}: {describe_validation_error(exc)}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"invalid config {path}: not valid TOML ({exc})") from None


def apply_overrides(config: Config, **overrides: Any) -> Config:
    """Apply the CLI flags the user actually gave (None means 'not given').

    Keys are `section.field`-like names spelled with a double underscore,
    e.g. `server__socket_path`. Values are validated by re-decoding the section.
    """
    sections: dict[str, dict[str, Any]] = {}
    for name, value in overrides.items():
        if value is None:
            continue
        section, field = name.split("__", 1)
        sections.setdefault(section, {})[field] = value
    for section, fields in sections.items():
        current = getattr(config, section)
        try:
            updated = msgspec.convert(
                {**msgspec.structs.asdict(current), **fields}, type=type(current)
            )
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid option: {describe_validation_error(exc)}") from None
        config = msgspec.structs.replace(config, **{section: updated})
    return config


def to_toml_dict(config: Config) -> dict[str, Any]:
    """The config as plain data, ready for tomli-w."""
    return msgspec.to_builtins(config)  # type: ignore[no-any-return]
