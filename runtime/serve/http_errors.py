"""HTTPError: the server's errors as OpenAI's error objects, for the HTTP routes and the WebSocket alike."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from nanoinfer.errors import RequestError
from runtime.serve import protocol as api
from runtime.async_engine import EngineError

_encode = msgspec.json.Encoder().encode


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        self.status, self.body, self.headers = status, api.ErrorBody(message, type_, param, code), headers
        super().__init__(message)

    @classmethod
    def of(cls, exc: BaseException, healthy: bool) -> "HTTPError":
        """The response for an exception from the engine or our own code."""
        if isinstance(exc, HTTPError):
            return exc
        cause = exc.__cause__ if isinstance(exc, EngineError) else exc
        if isinstance(cause, HTTPError):  # (the server ended the request: a shutdown)
            return cause
        if isinstance(cause, RequestError):  # the request cannot be served as asked
            return cls(400, str(cause), param=cause.param)
        if not healthy:
            return cls(503, f"the engine is unhealthy and must be restarted: {exc}", type_="server_error")
        return cls(500, str(exc), type_="server_error")


def error_response(err: HTTPError) -> Response:
    """The JSON response of `err`."""
    return Response(_encode(api.ErrorResponse(err.body)), err.status, headers=err.headers,
                    media_type="application/json")
