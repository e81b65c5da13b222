"""Draining: once shutdown starts, finish what is in flight and refuse new work.

`Drain` counts HTTP requests in flight. After `start()`, new /v1 requests get 503 in the
OpenAI error shape and /health answers 503 "draining" (so a load balancer stops sending),
while requests already running complete normally. `server/api/shutdown.py` waits for
`idle()` (or a timeout) before stopping the server; at the timeout it calls `cut()`, whose
callbacks (the engine's `cut_off`) end every open stream with an error event and [DONE].
"""
from __future__ import annotations

from typing import Callable

from fastapi.responses import JSONResponse

from lockstep.server.api.errors import APIError

REFUSED_PREFIX = "/v1"


class Drain:
    def __init__(self):
        self.in_flight = 0
        self.draining = False
        self.on_cut: list[Callable[[], object]] = []

    def start(self) -> None:
        self.draining = True

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
                refusal = APIError(503, "The server is shutting down; retry on another instance",
                                   type="server_error", code="server_shutting_down").response()
                return await refusal(scope, receive, send)
        self.drain.in_flight += 1  # only touched on the event loop: no lock needed
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
