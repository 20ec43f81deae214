"""llama.cpp's log callback, routed into the daemon's logging (one line per record,
error lines captured for one message of our own while a model or grammar loads)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator
from typing import Any

_GGML_LEVELS = {
    1: logging.DEBUG,
    2: logging.DEBUG,  # INFO: the model loader prints ~150 lines at this level
    3: logging.WARNING,
    4: logging.ERROR,
}
_llama_log = logging.getLogger("sfcore_daemon.llama_cpp")


class _LlamaLogRouter:
    """Collect llama.cpp's log fragments into lines and hand them to logging.

    logging here ends in a QueueHandler, so even a rare message emitted from the
    decode thread costs only a record and a queue put there.
    """

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._level = logging.DEBUG
        self._captured: list[str] | None = None
        # Made by route_llama_logs: creating it loads libllama, which start-up defers
        # until the socket is bound and the model file found.
        self.callback: Any = None

    @contextlib.contextmanager
    def capturing_errors(self) -> Iterator[list[str]]:
        """Collect llama.cpp's error lines (logged at DEBUG meanwhile) for one message
        of our own: a user sees the reason once, not four lines of loader internals."""
        captured: list[str] = []
        self._captured = captured
        try:
            yield captured
        finally:
            self._captured = None

    def _on_log(self, level: int, text: bytes, _user_data: Any) -> None:
        if level != 5:  # GGML_LOG_LEVEL_CONT continues the previous line's level
            self._level = _GGML_LEVELS.get(level, logging.DEBUG)
        level = self._level
        capture = self._captured is not None and level >= logging.ERROR
        if capture:
            level = logging.DEBUG
        elif not _llama_log.isEnabledFor(level):
            return
        chunk = text.decode("utf-8", errors="replace")
        self._parts.append(chunk)
        if chunk.endswith("\n"):
            line = "".join(self._parts).rstrip()
            self._parts.clear()
            if not line:
                return
            if capture and self._captured is not None:
                # "func: message" -> "message"
                self._captured.append(line.split(": ", 1)[-1])
            _llama_log.log(level, "%s", line)


llama_log_router = _LlamaLogRouter()


def route_llama_logs() -> None:
    from sfcore_daemon.llama.capi import C

    router = llama_log_router
    if router.callback is None:
        router.callback = C.llama_log_callback(router._on_log)
    C.llama_log_set(router.callback, ctypes.c_void_p(0))
