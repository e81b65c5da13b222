"""One record per HTTP request, filled in as it runs and handed to sinks when it ends.

`RecordRequests` (ASGI middleware, outermost) opens the record, notes the response status
and calls each sink (access log, metrics) once the response is finished. Route code adds
generation facts through `current()`; `TrackedHandle` does so for an engine handle
(first-token time, token counts, the final `RequestReport`, cancellation).
"""
from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the answer"
_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


@dataclass
class RequestRecord:
    request_id: str
    method: str
    path: str
    started: float = field(default_factory=time.monotonic)
    status: int | None = None
    finished: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_at: float | None = None
    token_gaps: list = field(default_factory=list)  # seconds per token between deltas (inter-token latency)
    finish_reason: str | None = None
    cancelled: bool = False
    deterministic: bool = False
    report: object | None = None  # the final Delta's RequestReport
    prompt: object | None = None  # only kept when prompt logging is on

    @property
    def duration(self) -> float:
        return (self.finished or time.monotonic()) - self.started


_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("lockstep_request", default=None)


def current() -> RequestRecord | None:
    """The record of the request being handled (None outside a request)."""
    return _current.get()


def _request_id(scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if _SAFE_REQUEST_ID.match(text):  # never echo arbitrary bytes into logs
                return text
    return uuid.uuid4().hex


class RecordRequests:
    """ASGI middleware: a `RequestRecord` per HTTP request, given to `sinks` at the end."""

    def __init__(self, app, sinks: Sequence[Callable[[RequestRecord], None]]):
        self.app = app
        self.sinks = list(sinks)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = RequestRecord(_request_id(scope), scope["method"], scope["path"])
        token = _current.set(record)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", record.request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            if record.status is None:
                record.status = 500
            raise
        finally:
            _current.reset(token)
            record.finished = time.monotonic()
            if record.status is None:  # the handler ended without answering: the client left
                record.status = CLIENT_CLOSED_REQUEST
            for sink in self.sinks:
                try:
                    sink(record)
                except Exception:  # observability must never break serving
                    log.exception("request sink %r failed", sink)


class TrackedHandle:
    """An engine `RequestHandle` that notes its progress in the current request's record."""

    def __init__(self, handle, record: RequestRecord | None):
        self._handle = handle
        self._record = record
        self._last_at = 0.0
        self.request = handle.request
        if record is not None:
            record.prompt_tokens = len(handle.request.prompt_tokens)
            record.deterministic = bool(handle.plan is not None and handle.plan.deterministic)

    def cancel(self) -> None:
        if self._record is not None and self._record.finish_reason is None:
            self._record.cancelled = True
        self._handle.cancel()

    @property
    def cancelled(self) -> bool:
        return self._handle.cancelled

    @property
    def queued(self) -> bool:
        return self._handle.queued

    async def __aiter__(self):
        record = self._record
        try:
            async for delta in self._handle:
                if record is not None:
                    self._note(record, delta)
                yield delta
        except Exception:
            # a failed generation is logged as such, not as a cancel by its client (the
            # route cancels the handle after the error)
            if record is not None and record.finish_reason is None:
                record.finish_reason = "error"
            raise

    def _note(self, record: RequestRecord, delta) -> None:
        now = time.monotonic()
        new_tokens = delta.completion_tokens - (record.completion_tokens or 0)
        if record.first_token_at is None and delta.completion_tokens > 0:
            record.first_token_at = now
        elif new_tokens > 0:
            record.token_gaps.append((now - self._last_at) / new_tokens)
        if new_tokens > 0:
            self._last_at = now
        record.completion_tokens = delta.completion_tokens
        record.prompt_tokens = delta.prompt_tokens
        if delta.finish_reason is not None:
            record.finish_reason = delta.finish_reason
            record.report = getattr(delta, "report", None)


def track(handle) -> TrackedHandle:
    return TrackedHandle(handle, current())
