"""Logging through a queue: callers only enqueue a record; a listener thread formats
and writes (llama.cpp's own log lines join it through llama/logrouter.py)."""

from __future__ import annotations

import logging
import logging.handlers
import queue
import sys


class _DeferredQueueHandler(logging.handlers.QueueHandler):
    # The stock QueueHandler formats the message on the calling thread; ours leaves
    # all formatting to the listener, so logging from any thread is just a queue put.
    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


def setup_logging(level: str) -> logging.handlers.QueueListener:
    log_queue: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    output = logging.StreamHandler(sys.stderr)
    output.setFormatter(
        logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
                          "%H:%M:%S")
    )
    listener = logging.handlers.QueueListener(log_queue, output, respect_handler_level=False)
    root = logging.getLogger()
    root.handlers[:] = [_DeferredQueueHandler(log_queue)]
    root.setLevel(level.upper())
    listener.start()
    return listener


# --- llama.cpp's own log lines ------------------------------------------------------------

# enum ggml_log_level of the bundled ggml: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4,
# CONT=5 (llama-cpp-python's _logger.py still documents an older numbering).
