"""`APIError` and the FastAPI handlers that give every error the OpenAI shape.

Every failure, including malformed JSON, unknown routes and unexpected exceptions,
answers `{"error": {"message", "type", "param", "code"}}` so clients parse one shape.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lockstep.server.api.protocol import ErrorBody, ErrorResponse

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.body).model_dump(), status_code=self.status)


def generation_error(exc: Exception) -> APIError:
    """The error a request that failed on the engine gets (503 when the server cut it off)."""
    from lockstep.server.api.request_record import current
    from lockstep.server.engine import ShuttingDown

    if isinstance(exc, ShuttingDown):
        record = current()
        log.warning("request %s cut off: %s", record.request_id if record else "?", exc)
        return APIError(503, str(exc), type="server_error", code="server_shutting_down")
    return APIError(500, str(exc), type="server_error")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")


def context_length_exceeded(prompt_tokens: int, context_length: int, param: str) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {context_length} tokens, "
        f"but the prompt has {prompt_tokens} tokens",
        param=param,
        code="context_length_exceeded",
    )


def _param_of(loc: tuple) -> str | None:
    """The request field an error is about: ("body", "messages", 0, "role") -> "messages"."""
    fields = [part for part in loc if part != "body"]
    return str(fields[0]) if fields and isinstance(fields[0], str) else None


def _validation_message(error: dict) -> str:
    fields = [str(part) for part in error["loc"] if part != "body"]
    where = ".".join(fields)
    if error["type"] == "json_invalid":
        return f"Malformed JSON body: {error.get('ctx', {}).get('error', error['msg'])}"
    if error["type"] == "extra_forbidden":
        return f"Unrecognized request argument supplied: {where}"
    if not fields and error["type"] in ("missing", "model_attributes_type", "dict_type"):
        return "The request body must be a JSON object (Content-Type: application/json)"
    return f"Invalid value for '{where}': {error['msg']}" if where else error["msg"]


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    error = exc.errors()[0]
    param = None if error["type"] == "json_invalid" else _param_of(tuple(error["loc"]))
    return APIError(400, _validation_message(error), param=param).response()


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"Method {request.method} not allowed for {request.url.path}"
    else:
        message = str(exc.detail)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return APIError(exc.status_code, message, type=kind).response()


async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return APIError(500, f"Internal server error: {type(exc).__name__}", type="server_error").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)
