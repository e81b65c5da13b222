"""Request limits: body size (middleware), generation, prompt and prediction caps, queue depth,
grammar checks.

The body limit is enforced before the app sees the request: a declared Content-Length
over the limit is refused unread, and a chunked body is counted while it streams in, so
at most `max_body_bytes` are ever held in memory. Every refusal has the OpenAI error shape.
"""
from __future__ import annotations

from dataclasses import dataclass

from lockstep.server.api.errors import APIError

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full 8k-token prompt as JSON is well under this
DEFAULT_MAX_TOKENS = 4096
DEFAULT_MAX_QUEUE = 64
# Grammar checks (server/api/grammar_checks.py): the checker process takes one grammar at a
# time, so a second worker only overlaps one request's in-server compile with the next's check.
DEFAULT_GRAMMAR_WORKERS = 2
DEFAULT_GRAMMAR_QUEUE = 16
# A prediction's tokens are indexed per request (server/engine/decoding/drafters.py PredictionIndex):
# twice the default max_tokens leaves room for an answer that deletes much of its prediction.
DEFAULT_MAX_PREDICTION_TOKENS = 8192
@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens: int = DEFAULT_MAX_TOKENS  # per-request generation cap (max_tokens above it: 400)
    # None: the model's context length, as far as the KV budget holds the prompt (agents send
    # long histories; a long prompt's chunks yield to decoding requests, so it holds none up)
    max_prompt_tokens: int | None = None
    max_queue: int | None = DEFAULT_MAX_QUEUE  # waiting requests before new ones get 429
    grammar_workers: int = DEFAULT_GRAMMAR_WORKERS  # grammar checks running at once
    grammar_queue: int = DEFAULT_GRAMMAR_QUEUE  # grammar checks waiting before new ones get 429
    max_prediction_tokens: int = DEFAULT_MAX_PREDICTION_TOKENS  # a longer `prediction`: 400


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body too large: the limit is {limit} bytes", code="request_too_large")


def max_tokens_too_large(requested: int, limit: int, param: str) -> APIError:
    return APIError(400, f"{param} is {requested}, but this server allows at most {limit}", param=param)


def prompt_too_long(prompt_tokens: int, limit: int, param: str) -> APIError:
    return APIError(400, f"The prompt has {prompt_tokens} tokens, but this server accepts at most {limit}",
                    param=param, code="prompt_too_long")


def prediction_too_long(prediction_tokens: int, limit: int) -> APIError:
    return APIError(400, f"The prediction has {prediction_tokens} tokens, but this server accepts at most {limit}",
                    param="prediction", code="prediction_too_long")


def queue_full(limit: int) -> APIError:
    # OpenAI's own 429s use type "requests" / code "rate_limit_exceeded"; clients retry a 429
    # after its Retry-After (errors.RetryAfter).
    return APIError(429, f"The server is busy: {limit} requests are already waiting; retry shortly",
                    type="requests", code="rate_limit_exceeded")


def grammar_checks_full(workers: int, queue: int) -> APIError:
    return APIError(429, f"The server is busy checking other requests' output grammars ({workers} running, "
                         f"{queue} waiting); retry shortly", type="requests", code="rate_limit_exceeded")


class _BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """ASGI middleware: refuse request bodies over `limit` bytes with 413."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared == -1:
            return await APIError(400, "Invalid Content-Length header").response()(scope, receive, send)
        if declared is not None and declared > self.limit:
            return await body_too_large(self.limit).response()(scope, receive, send)
        try:
            body = await self._read_body(receive)
        except _BodyTooLarge:
            return await body_too_large(self.limit).response()(scope, receive, send)
        if body is None:
            return  # the client went away mid-body: nobody to answer
        replayed = False

        async def replay():
            # The app gets the (bounded) body once, then the live channel (disconnects).
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive) -> bytes | None:
        """The whole body, or None if the client disconnected before sending it all."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _content_length(scope) -> int | None:
    """The declared body size; None if absent, -1 if malformed."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                return -1
            return length if length >= 0 else -1
    return None
