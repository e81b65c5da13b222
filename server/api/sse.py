"""Server-sent events: chat and completions streams framed (`data: {...}` ... `data: [DONE]`),
and a stream's events gathered into writes.

Each write costs a pass through the ASGI middleware, uvicorn's h11 framing, a socket write and
the client's read. While the engine is ahead of the event loop (a stream's next delta is
already queued on its handle: it comes without waiting), the events go out together in one
write; else each as it comes. The bytes and their order are the same either way.
"""
from __future__ import annotations

from typing import AsyncIterator, Callable

from lockstep.server.api import choices
from lockstep.server.api.errors import generation_error
from lockstep.server.api.response_bodies import ErrorResponse, ResponseBody
from lockstep.server.engine import GenerationError

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


def event(payload: ResponseBody | str) -> str:
    """One event: a chunk, or its JSON already rendered (server/api/chunk_json.py)."""
    return f"data: {payload if isinstance(payload, str) else payload.model_dump_json()}\n\n"


async def stream(handles, chunks: AsyncIterator[ResponseBody | str], gather: bool = False) -> AsyncIterator[str]:
    """SSE framing for `chunks` (made from `handles`' deltas), ending in [DONE]. `gather`:
    every delta makes a chunk, so the events of deltas already queued go out in one write;
    where a delta may make none (text held back), each goes alone."""
    writes = Writes(lambda: any(queued(h) for h in handles)) if gather else Writes()
    try:
        async for chunk in chunks:
            write = writes.add(event(chunk))
            if write is not None:
                yield write
    except GenerationError as exc:  # headers are sent: report it as an event
        yield writes.take() + event(ErrorResponse(error=generation_error(exc).body))
    finally:
        choices.cancel_all(handles)  # the client went away (or we are done): free the slots
    yield writes.take() + DONE
