"""Logging through a queue: callers only enqueue a record; a listener thread formats
and writes (llama.cpp's own log lines join it through llama/logrouter.py)."""

from __future__ import annotations

import logging
import logging.handlers
import queue
import sys
import threading


class _DeferredQueueHandler(logging.handlers.QueueHandler):
    # The stock QueueHandler formats the message on the calling thread; ours leaves
    # all formatting to the listener, so logging from any thread is just a queue put.
    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


class _Written(logging.LogRecord):
    """Not a line: the listener reaching it means every record before it is written."""

    def __init__(self) -> None:
        super().__init__("sfcore_daemon.logs", logging.DEBUG, __file__, 0, "", None, None)
        self.reached = threading.Event()


class _Listener(logging.handlers.QueueListener):
    def handle(self, record: logging.LogRecord) -> None:
        if isinstance(record, _Written):
            record.reached.set()
        else:
            super().handle(record)


def wait_written(timeout_s: float = 1.0) -> None:
    """Blocks until the lines logged so far are written (at most `timeout_s`): the
    ready line must be readable when systemd, or a script, is told the daemon is."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, _DeferredQueueHandler):
            marker = _Written()
            handler.queue.put_nowait(marker)
            marker.reached.wait(timeout_s)


def setup_logging(level: str) -> logging.handlers.QueueListener:
    log_queue: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    output = logging.StreamHandler(sys.stderr)
    output.setFormatter(
        logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
                          "%H:%M:%S")
    )
    listener = _Listener(log_queue, output, respect_handler_level=False)
    root = logging.getLogger()
    root.handlers[:] = [_DeferredQueueHandler(log_queue)]
    root.setLevel(level.upper())
    listener.start()
    return listener


# --- llama.cpp's own log lines ------------------------------------------------------------

# enum ggml_log_level of the bundled ggml: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4,
# CONT=5 (llama-cpp-python's _logger.py still documents an older numbering).
