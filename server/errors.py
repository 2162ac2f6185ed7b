"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

`APIError` is what handlers raise; `api_error(exc)` maps the engine's exceptions to
the status a client should see. Bad input is always a 4xx, never a 500.
"""

from __future__ import annotations

import logging

import pydantic
from starlette.responses import JSONResponse

from engine.async_engine import EngineDeadError, EngineOverloaded, UnknownModel
from engine.sampling_params import SamplingParamsError
from engine.scheduler import RequestRejected

logger = logging.getLogger(__name__)

_TYPES = {401: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message,
                          "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# What a request can raise that is the client's to hear (the app registers one handler for
# all of them); anything else is a bug and a 500.
CLIENT_ERRORS = (APIError, pydantic.ValidationError, SamplingParamsError, RequestRejected,
                 UnknownModel, EngineOverloaded, EngineDeadError)


def api_error(exc: BaseException) -> APIError:
    """The client-facing error for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, pydantic.ValidationError):
        # A value that fails a union (str or list, ...) fails each member; the member whose
        # type it has says what is wrong with it (a list too long, not "should be a string").
        errors = exc.errors(include_url=False)
        first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
        loc = first["loc"]
        where = ".".join(str(p) for p in loc) or "body"
        return APIError(400, f"{where}: {first['msg']}", param=str(loc[0]) if loc else None)
    if isinstance(exc, SamplingParamsError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, RequestRejected):
        code = "context_length_exceeded" if "context length" in str(exc) else None
        return APIError(400, str(exc), code=code)
    if isinstance(exc, UnknownModel):
        return APIError(404, exc.args[0], param="model", code="model_not_found")
    if isinstance(exc, EngineOverloaded):
        return APIError(429, f"{exc}; try again later", code="rate_limit_exceeded")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    logger.exception("internal error while serving a request", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")
