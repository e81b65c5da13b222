"""Draining: once shutdown starts, finish what is in flight and refuse new work.

`Drain` counts HTTP requests in flight. After `start()`, new /v1 requests get 503 in the
OpenAI error shape and /health answers 503 "draining" (so a load balancer stops sending),
while requests already running complete normally. `server/api/shutdown.py` waits for
`idle()` (or a timeout) before stopping the server; at the timeout it calls `cut()`, whose
callbacks (the engine's `cut_off`) end every open stream with an error event and [DONE].
A request waiting for something that may outlast the drain (the guarantee's proof) waits
through `unless_draining`, which answers it 503 the moment draining starts.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

from fastapi.responses import JSONResponse

from lockstep.server.api.errors import APIError

REFUSED_PREFIX = "/v1"
T = TypeVar("T")


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down; retry on another instance",
                    type="server_error", code="server_shutting_down")


class Drain:
    def __init__(self):
        self.in_flight = 0
        self.draining = False
        self.on_cut: list[Callable[[], object]] = []
        # (loop, future) of each `unless_draining` wait. No lock: `start` runs in a signal handler
        # on the loop's own thread, which may have been interrupted while holding one.
        self._waits: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def start(self) -> None:
        """Refuse new work and end the waits in `unless_draining` (from any thread or a signal handler)."""
        self.draining = True
        for loop, future in list(self._waits):
            loop.call_soon_threadsafe(_resolve, future)

    async def unless_draining(self, awaitable: Awaitable[T]) -> T:
        """`awaitable`'s result, or `shutting_down()` raised as soon as draining starts."""
        task = asyncio.ensure_future(awaitable)
        loop = asyncio.get_running_loop()
        started = loop.create_future()
        entry = (loop, started)
        self._waits.append(entry)
        try:
            if not self.draining:
                await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waits.remove(entry)
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        raise shutting_down()

    def cut(self) -> None:
        """Stop waiting: end what is still running, cleanly (see `on_cut`)."""
        self.draining = True
        for callback in self.on_cut:
            callback()

    def idle(self) -> bool:
        return self.in_flight == 0


class DrainMiddleware:
    """ASGI middleware: count requests in flight; refuse new ones while draining."""

    def __init__(self, app, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.draining:
            if scope["path"] == "/health":
                return await JSONResponse({"status": "draining"}, status_code=503)(scope, receive, send)
            if scope["path"].startswith(REFUSED_PREFIX):
                return await shutting_down().response()(scope, receive, send)
        self.drain.in_flight += 1  # only touched on the event loop: no lock needed
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
