"""The asyncio side of a request (`RequestHandle`): the engine's worker thread posts events,
the event loop iterates them."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import AsyncIterator

from lockstep.server.engine.decoding.request_state import Delta, GenerationRequest


class RequestHandle:
    """The asyncio side of one request: iterate it for `Delta`s; `cancel()` to give up."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, plan=None):
        self.request = request
        self.plan = plan  # server.engine.guarantee.decode_plan.DecodePlan, or None for plain decoding
        self.submitted_at = time.monotonic()
        self._loop = loop
        self._events: asyncio.Queue[Delta | Exception] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.cut = False  # ended by the server (cut_off), not by its client
        # n > 1: the first choice's handle; this one copies its prompt KV (Engine.submit_group).
        self.leader: RequestHandle | None = None
        self.state = None  # the engine's RequestState once admitted (read by followers)

    def cancel(self) -> None:
        """Stop generating (e.g. the client went away); the engine frees the slot."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def queued(self) -> bool:
        """Events posted and not yet read (the stream's next write may wait for them)."""
        return not self._events.empty()

    @property
    def client_cancelled(self) -> bool:
        return self._cancelled.is_set() and not self.cut

    def post(self, event: Delta | Exception) -> None:
        """Called on the worker thread."""
        post_all([(self, [event])])

    def deliver_via(self, events: list) -> "RequestHandle | None":
        """The handle whose queue takes `events` posted here (None: no listener here); a
        handle that observes what is posted overrides this."""
        return self

    def _put(self, events: list) -> None:
        for event in events:
            self._events.put_nowait(event)

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while True:
            event = await self._events.get()
            if isinstance(event, Exception):
                raise event
            yield event
            if event.finish_reason is not None:
                return


def post_all(posts: list[tuple[RequestHandle, list]]) -> None:
    """Called on the worker thread: each handle's events, with one wake-up of each event loop
    for all of them (a pass's rows reach their clients together; one wake-up per token
    costs a syscall and a loop iteration each)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, list]]] = {}
    for handle, events in posts:
        target = handle.deliver_via(events) if events else None
        if target is not None:
            by_loop.setdefault(target._loop, []).append((target, events))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            for handle, _ in items:
                handle.cancel()


def _deliver(items: list[tuple[RequestHandle, list]]) -> None:
    for handle, events in items:
        handle._put(events)
