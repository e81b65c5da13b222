"""Server-sent events: a stream's events gathered into writes.

Each write costs a pass through the ASGI middleware, uvicorn's h11 framing, a socket write and
the client's read. While the engine is ahead of the event loop (a stream's next delta is
already queued on its handle: it comes without waiting), the events go out together in one
write; else each as it comes. The bytes and their order are the same either way.
"""
from __future__ import annotations

from typing import Callable

DONE = "data: [DONE]\n\n"


def queued(handle) -> bool:
    """Whether `handle` (an engine handle, or a wrapper of one) holds a delta not yet read."""
    return bool(getattr(handle, "queued", False))


class Writes:
    """`add(event)` -> the write to send now, or None while `more_queued()` says the next event
    is already on its way (then it joins the next write); `take()` -> what is held."""

    def __init__(self, more_queued: Callable[[], bool] = lambda: False):
        self._more_queued = more_queued
        self._held: list[str] = []

    def add(self, event: str) -> str | None:
        self._held.append(event)
        return None if self._more_queued() else self.take()

    def take(self) -> str:
        write = "".join(self._held)
        self._held.clear()
        return write
