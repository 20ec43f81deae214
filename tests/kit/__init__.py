"""The test kit: what the tests, the benches and the scripts share.

    from tests.kit import Client, Daemon, done_of, running_daemon

    async with running_daemon({"server": {"slots": 2}}) as daemon:
        async with daemon.client() as client:
            done = done_of(await client.request({"prompt": "Hello", "max_tokens": 4}))

- daemon.py: the one launcher. `running_daemon` (a real daemon on a short temp socket
  path, ready by its READY=1, stopped and checked afterwards), `start_daemon` (the same
  start, stopped by the caller: the benches; a log file of the caller's, another
  checkout, the spawn-to-ready time), `run_cli` and `run_to_exit` (a daemon run to its
  own exit), `BackgroundDaemon` (one on a private loop thread).
- ndjson.py: the one NDJSON client. `Client` (asyncio, line by line, raw bytes too,
  `timed` replies for the benches) and the blocking raw side (`raw_exchange`,
  `read_to_end`, `exchange`).
- http.py: the HTTP listener's helpers (`Endpoint`/`endpoint` through the SDKs,
  `Listener`/`request`/`read_reply` on raw sockets, `guarded_tcp`, `url_of`, `port_of`,
  `request_bytes`, `wait_for_outcome`, `sse_chunks`).
- faults.py: /proc figures of a daemon, `poll_until`, `health`, `assert_serves`.
- models.py: where the test models' files are (`smollm2_path`).
- Shared data and helpers: prompts.py (a long prefix and its questions, prompts that
  copy), prompt_store.py (the prompt store tests' prompts, config and checks), tools.py
  (tool definitions, a question for them, the round trip's checks), person_document.py,
  structured.py (schemas and budget cases), schemas.py (hypothesis strategies of
  schemas), mapping.py (the HTTP mappings' unit checks), client_logprobs.py (what the
  Go, Node and Rust clients' logprobs are checked against), chaos.py (the prompt
  store's chaos scenarios), gbnf.py (a GBNF recogniser), grammar_probe.py (llama.cpp's
  grammar parser in a child process).

Test files import from the kit only, never from each other (tests/repo/test_kit.py).
Scripts outside tests/ put the repository root on sys.path and import `tests.kit...`
(the benches' daemons are the launcher's, scripts/benchkit/daemon.py); ndjson.py and
daemon.py need the standard library only (daemon.py writes its config with tomli_w).
"""

from tests.kit.daemon import (
    BASE_CONFIG,
    READY_TIMEOUT_S,
    REPO,
    STOP_TIMEOUT_S,
    BackgroundDaemon,
    Daemon,
    Exited,
    NoNotification,
    NotifyListener,
    assert_one_clear_line,
    collect_exit,
    merge,
    reap,
    run_cli,
    run_to_exit,
    running_daemon,
    short_dir,
    spawn_daemon,
    start_daemon,
)
from tests.kit.ndjson import (
    ERROR_CODES,
    FINAL_TYPES,
    REPLY_TIMEOUT_S,
    Client,
    RawResult,
    Timed,
    connect_raw,
    done_of,
    exchange,
    parse_reply_lines,
    raw_exchange,
    read_to_end,
    tokens_text,
)

__all__ = [
    "BASE_CONFIG", "ERROR_CODES", "FINAL_TYPES", "READY_TIMEOUT_S", "REPLY_TIMEOUT_S", "REPO",
    "STOP_TIMEOUT_S", "BackgroundDaemon", "Client", "Daemon", "Exited", "NoNotification",
    "NotifyListener", "RawResult", "Timed", "assert_one_clear_line", "collect_exit",
    "connect_raw", "done_of", "exchange", "merge", "parse_reply_lines", "raw_exchange",
    "read_to_end", "reap", "run_cli", "run_to_exit", "running_daemon", "short_dir",
    "spawn_daemon", "start_daemon", "tokens_text",
]
