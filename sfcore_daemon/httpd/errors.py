"""Errors over HTTP: `ApiError` (a status and a message), OpenAI's error shape as the
listener's default body, and the core's error codes mapped to statuses.

An API with its own error shape (Anthropic's, Ollama's) renders the same `ApiError`
in it for the paths it owns (`api.HttpApi.error_response`).
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgspec
from aiohttp import web
from msgspec import Struct

from sfcore_daemon.core import errors

JSON_TYPE: Final = "application/json"
encoder: Final = msgspec.json.Encoder()

# error code -> (HTTP status, OpenAI error type)
_STATUS: Final[dict[str, tuple[int, str]]] = {
    errors.BAD_JSON: (400, "invalid_request_error"),
    errors.INVALID_REQUEST: (400, "invalid_request_error"),
    errors.CONTEXT_OVERFLOW: (400, "invalid_request_error"),
    errors.GRAMMAR_DEAD_END: (400, "invalid_request_error"),
    errors.FORBIDDEN: (401, "authentication_error"),
    errors.LINE_TOO_LONG: (413, "invalid_request_error"),
    errors.QUEUE_FULL: (429, "rate_limit_error"),
    errors.TOO_MANY_CONNECTIONS: (429, "rate_limit_error"),
    errors.INTERNAL: (500, "server_error"),
    errors.SHUTTING_DOWN: (503, "server_error"),
}
# OpenAI's own codes where it has one for the same thing.
_OPENAI_CODE: Final = {errors.CONTEXT_OVERFLOW: "context_length_exceeded"}
# The daemon's fields named in its messages, as the OpenAI field they came from.
_FIELD_PARAM: Final = {"json_schema": "response_format", "format": "response_format"}
_AT_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`")


class ApiError(Exception):
    """A request answered with OpenAI's error shape and an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    @classmethod
    def from_code(cls, code: str, message: str, param: str | None = None) -> ApiError:
        """The daemon's error `code` (PROTOCOL.md) as an HTTP error."""
        status, kind = _STATUS.get(code, (500, "server_error"))
        if param is None and (match := _AT_PATH.search(message)):
            path = match["path"]
            head = re.split(r"[.\[]", path, maxsplit=1)[0]
            param = _FIELD_PARAM.get(head, path) if head in _FIELD_PARAM else path or None
        return cls(status, message, param, _OPENAI_CODE.get(code, code), kind)

    @classmethod
    def invalid(cls, message: str) -> ApiError:
        """A body that failed decoding: msgspec's message names the field."""
        match = _AT_PATH.search(message)
        return cls(400, message, match["path"] if match and match["path"] else None,
                   "invalid_request")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.kind,
                                             param=self.param, code=self.code))


class ErrorBody(Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct, kw_only=True):
    error: ErrorBody


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=encoder.encode(body), status=status, content_type=JSON_TYPE)
