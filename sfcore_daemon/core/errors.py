"""The error codes every front end answers with (docs/protocol.md, Errors).

The core refuses and fails requests by these codes; the NDJSON protocol sends them as
they are, and each HTTP API maps them to its status codes and error shape.
"""

from __future__ import annotations

from typing import Final

BAD_JSON: Final = "bad_json"
INVALID_REQUEST: Final = "invalid_request"
CONTEXT_OVERFLOW: Final = "context_overflow"
QUEUE_FULL: Final = "queue_full"
LINE_TOO_LONG: Final = "line_too_long"
TOO_MANY_CONNECTIONS: Final = "too_many_connections"
FORBIDDEN: Final = "forbidden"
SHUTTING_DOWN: Final = "shutting_down"
INTERNAL: Final = "internal"
# A request's grammar allows no token to continue its document: that request ends alone.
GRAMMAR_DEAD_END: Final = "grammar_dead_end"

ERROR_CODES: Final = (BAD_JSON, INVALID_REQUEST, CONTEXT_OVERFLOW, QUEUE_FULL, LINE_TOO_LONG,
                      TOO_MANY_CONNECTIONS, FORBIDDEN, SHUTTING_DOWN, INTERNAL, GRAMMAR_DEAD_END)

