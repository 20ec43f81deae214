"""The test kit: what the tests, the benches and the scripts share.

    from tests.kit import Client, Daemon, done_of, running_daemon

    async with running_daemon({"server": {"slots": 2}}) as daemon:
        async with daemon.client() as client:
            done = done_of(await client.request({"prompt": "Hello", "max_tokens": 4}))

- daemon.py: the launcher. `running_daemon` (a real daemon on a short temp socket path,
  ready by its READY=1, stopped and checked afterwards), `run_cli` and `run_to_exit` (a
  daemon run to its own exit), `BackgroundDaemon` (one on a private loop thread).
- ndjson.py: the one NDJSON client. `Client` (asyncio, line by line, raw bytes too,
  `timed` replies for the benches) and the blocking raw side (`raw_exchange`,
  `read_to_end`, `exchange`).
- faults.py: /proc figures of a daemon, `poll_until`, `health`, `assert_serves`.
- models.py: where the test models' files are (`smollm2_path`).
- Shared data: tools.py (tool definitions and the round trip's checks),
  person_document.py, structured.py (schemas and budget cases), chaos.py (the prompt
  store's chaos scenarios), gbnf.py (a GBNF recogniser), grammar_probe.py (llama.cpp's
  grammar parser in a child process).

Scripts outside tests/ put the repository root on sys.path and import `tests.kit...`;
ndjson.py needs the standard library only.
"""

from tests.kit.daemon import (
    BASE_CONFIG,
    READY_TIMEOUT_S,
    REPO,
    STOP_TIMEOUT_S,
    BackgroundDaemon,
    Daemon,
    Exited,
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
    "STOP_TIMEOUT_S", "BackgroundDaemon", "Client", "Daemon", "Exited", "NotifyListener",
    "RawResult", "Timed", "assert_one_clear_line", "collect_exit", "connect_raw", "done_of",
    "exchange", "merge", "parse_reply_lines", "raw_exchange", "read_to_end", "reap", "run_cli",
    "run_to_exit", "running_daemon", "short_dir", "spawn_daemon", "tokens_text",
]
