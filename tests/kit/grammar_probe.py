"""llama.cpp's grammar parser in a child process whose memory and time are bounded.

The property tests hand it the GBNF that the checks let through (a client's grammar, or
one made from a schema). A parser that hangs or runs out of memory on it ends the child,
and the test fails with the grammar in its message, instead of taking the test run (or
the machine) with it. Run as `python -m tests.kit.grammar_probe`: it reads grammars
(a 4-byte length, then UTF-8) on stdin and answers "ok" or "refused" per line.
"""

from __future__ import annotations

import os
import resource
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[2]
# One parse may take this long (CPU seconds, on a loaded machine): the checks exist so
# that none comes near it.
LIMIT_S = 20
MEMORY_BYTES = 4 << 30


class GrammarProbe:
    """The child process; one per test module."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.kit.grammar_probe"], cwd=REPO, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def parses(self, text: str) -> bool:
        """Whether llama.cpp (without a vocabulary) builds a grammar from `text`;
        AssertionError if its parser did not finish within the limits."""
        stdin, stdout = self._pipes()
        data = text.encode("utf-8")
        stdin.write(struct.pack("<I", len(data)) + data)
        stdin.flush()
        answer = stdout.readline()
        assert answer, (f"llama.cpp's grammar parser did not finish within {LIMIT_S} s and "
                        f"{MEMORY_BYTES >> 30} GiB on {text[:300]!r}")
        return answer == b"ok\n"

    def _pipes(self) -> tuple[IO[bytes], IO[bytes]]:
        process = self._process
        assert process.stdin is not None and process.stdout is not None
        assert process.poll() is None, "the grammar probe has died"
        return process.stdin, process.stdout

    def close(self) -> None:
        process = self._process
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    from sfcore_daemon.llama.capi import C

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while header := stdin.read(4):
        (size,) = struct.unpack("<I", header)
        text = stdin.read(size)
        # No handler: SIGALRM ends the process even inside the C call.
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        spent = int(usage.ru_utime + usage.ru_stime) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (spent + LIMIT_S, resource.RLIM_INFINITY))
        signal.alarm(LIMIT_S * 3)
        grammar = C.llama_sampler_init_grammar(None, text, b"root")
        signal.alarm(0)
        if grammar:
            C.llama_sampler_free(grammar)
        stdout.write(b"ok\n" if grammar else b"refused\n")
        stdout.flush()


if __name__ == "__main__":
    main()
