"""Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, for
every refusal on a Messages path: the routes' own and the listener's (API key, gate,
limits, a body too large, a draining daemon), so Anthropic's SDKs raise the error
class they would raise against Anthropic for the same status.
"""

from __future__ import annotations

from typing import Final

from sfcore_daemon.anthropic.schema import ErrorObject, MessagesError
from sfcore_daemon.httpd.errors import ApiError

PREFIX: Final = "/v1/messages"

# HTTP status -> Anthropic's error type (its ErrorType); others by class below.
_TYPES: Final = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    429: "rate_limit_error",
    # A daemon that is loading, draining or past its limits: retry later, as Anthropic's
    # SDKs do with its overloaded_error (their retry covers every 5xx).
    503: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(error: ApiError) -> MessagesError:
    message = error.message
    if error.param is not None and error.param not in message:
        message = f"{error.param}: {message}"
    return MessagesError(error=ErrorObject(type=error_type(error.status), message=message))
