"""`APIError` and the FastAPI handlers that give every error the OpenAI shape.

Every failure, including malformed JSON, unknown routes and unexpected exceptions,
answers `{"error": {"message", "type", "param", "code"}}` so clients parse one shape.
Every 429 and 503 also says when to come back (`RetryAfter`).
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lockstep.server.api.response_bodies import ErrorBody, ErrorResponse

log = logging.getLogger(__name__)

# The Retry-After of a 429 or 503 that names no wait of its own: without one, clients (the
# openai SDK among them) retry on a backoff of their own choosing.
RETRY_AFTER_S = 1
RETRY_STATUSES = (429, 503)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.body = ErrorBody(message=_encodable(message), type=type, param=param and _encodable(param),
                              code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.body).model_dump(), status_code=self.status,
                            headers=self.headers)


def generation_error(exc: Exception) -> APIError:
    """The error a request that failed on the engine gets (503 when the server cut it off, 400
    when the request's own asking stopped it, e.g. its output grammar past an engine limit)."""
    from lockstep.server.api.request_record import current
    from lockstep.server.engine import ShuttingDown
    from lockstep.server.engine.scheduling.errors import RequestInvalid

    if isinstance(exc, RequestInvalid):  # the request's own doing (e.g. its grammar past an engine limit)
        return APIError(400, str(exc), param=exc.param, code=exc.code)
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


def _encodable(text: str) -> str:
    """A lone surrogate echoed from a request would make the JSON answer unencodable (a 500)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _param_of(loc: tuple) -> str | None:
    """The request field an error is about: ("body", "messages", 0, "role") -> "messages"."""
    fields = [part for part in loc if part != "body"]
    return str(fields[0]) if fields and isinstance(fields[0], str) else None


# pydantic's wrong-type errors, in a client's words (its own say "instance of ChatMessage").
# A union reports one per branch the input is not.
_TYPES = {"string_type": "a string", "list_type": "a list", "dict_type": "an object", "model_type": "an object",
          "model_attributes_type": "an object", "int_type": "an integer", "float_type": "a number",
          "bool_type": "a boolean", "none_required": "null"}


def _expected(error: dict) -> str | None:
    """What a wrong-type (or not-one-of) error expected, or None for any other error."""
    if error["type"] == "literal_error":
        return error.get("ctx", {}).get("expected")
    return _TYPES.get(error["type"])


def _fields(error: dict, body) -> list:
    """Where in the body an error is, without pydantic's union branch names ("str", "list[...]")."""
    loc = list(error["loc"])
    loc = loc[1:] if loc[:1] == ["body"] else loc
    if body is None:  # nothing to walk: every part of loc, branch names included
        return loc
    path, value = [], body
    for part in loc:
        if (isinstance(value, dict) and part in value
                or isinstance(value, list) and isinstance(part, int) and part < len(value)):
            path.append(part)
            value = value[part]
    if error["type"] == "missing" and loc:
        path.append(loc[-1])  # a missing field is not in the body
    return path


def _chosen(errors: list, body) -> tuple[dict, list, list[str]]:
    """The error to report, its path in the body, and what was expected there.

    The first error's field is reported. Where a union reported one error per branch, the
    branch that got furthest into the body says what is wrong; if every branch failed on
    the type alone, every type it could have had is named.
    """
    param = _param_of(tuple(errors[0]["loc"]))
    located = [(e, _fields(e, body)) for e in errors if _param_of(tuple(e["loc"])) == param]
    path = max((path for _, path in located), key=len)
    there = [e for e, p in located if p == path]
    for error in there:
        if _expected(error) is None:
            return error, path, []
    return there[0], path, list(dict.fromkeys(_expected(e) for e in there))


def validation_text(error: dict, expected: list[str] = ()) -> str:
    """One pydantic error in a client's words: no "Value error, " prefix, no class names."""
    expected = list(expected) or ([_expected(error)] if _expected(error) else [])
    if expected:  # "'none', 'auto' or 'required', or an object"
        return "Input should be " + (", or " if any(" or " in e for e in expected) else " or ").join(expected)
    if error["type"] == "string_unicode":
        return "text must be valid Unicode (it contains a lone surrogate)"
    return error["msg"].removeprefix("Value error, ")


def _validation_message(error: dict, path: list, expected: list[str]) -> str:
    where = ".".join(str(part) for part in path)
    if error["type"] == "json_invalid":
        return f"Malformed JSON body: {error.get('ctx', {}).get('error', error['msg'])}"
    if error["type"] == "extra_forbidden":
        return f"Unrecognized request argument supplied: {where}"
    if not where and error["type"] in ("missing", "model_attributes_type", "dict_type"):
        return "The request body must be a JSON object (Content-Type: application/json)"
    if not where and error["type"] == "string_unicode":  # a field name pydantic could not read
        return "field names must be valid Unicode (one contains a lone surrogate)"
    text = validation_text(error, expected)
    return f"Invalid value for '{where}': {text}" if where else text


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    error, path, expected = _chosen(exc.errors(), exc.body)
    param = None if error["type"] == "json_invalid" else _param_of(tuple(error["loc"]))
    return APIError(400, _validation_message(error, path, expected), param=param).response()


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


class RetryAfter:
    """ASGI middleware: every 429 and 503 response carries Retry-After (RETRY_AFTER_S unless
    the response set its own), whichever part of the app answered it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_retry_after(message):
            if message["type"] == "http.response.start" and message["status"] in RETRY_STATUSES:
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"retry-after" for name, _ in headers):
                    message = {**message, "headers": headers + [(b"retry-after", str(RETRY_AFTER_S).encode())]}
            await send(message)

        await self.app(scope, receive, send_with_retry_after)
