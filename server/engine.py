"""The engine: owns the model on one worker thread and shares it fairly between requests.

All MLX work happens on the worker thread, never on the asyncio loop. Requests are
admitted in FIFO order, up to `max_active` at a time, each with its own KV cache; the
active ones advance round-robin one unit of work (a prefill chunk or a token) each, so a
long answer does not starve a short one. Each request's output comes back to asyncio
through its `RequestHandle` (events posted with `loop.call_soon_threadsafe`).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
from typing import AsyncIterator, Callable, Iterator

from server.decoding import DecodePlan, Deployment
from server.generate import Delta, GenerationRequest, generate
from server.prefix_cache import PrefixCache

log = logging.getLogger(__name__)


class GenerationError(Exception):
    """Generation failed on the worker; the message is safe to show to the client."""


class QueueFull(GenerationError):
    """`submit()` refused: `max_waiting` requests are already waiting (the API answers 429)."""


class ShuttingDown(GenerationError):
    """The server stopped this request (drain timeout or a second signal); the API answers 503."""


class RequestHandle:
    """The asyncio side of one request: iterate it for `Delta`s; `cancel()` to give up."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, plan=None):
        self.request = request
        self.plan = plan  # server.decoding.DecodePlan, or None for plain decoding
        self._loop = loop
        self._events: asyncio.Queue[Delta | Exception] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.cut = False  # ended by the server (cut_off), not by its client

    def cancel(self) -> None:
        """Stop generating (e.g. the client went away); the engine frees the slot."""
        self._cancelled.set()

    @property
    def client_cancelled(self) -> bool:
        return self._cancelled.is_set() and not self.cut

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def post(self, event: Delta | Exception) -> None:
        """Called on the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while True:
            event = await self._events.get()
            if isinstance(event, Exception):
                raise event
            yield event
            if event.finish_reason is not None:
                return


class Engine:
    max_waiting: int | None = None  # waiting requests before submit() refuses; None = unbounded

    def __init__(self, loaded, max_active: int = 4, generate_fn: Callable[..., Iterator] = generate,
                 deployment: Deployment | None = None, prefix_cache: PrefixCache | None = None):
        self.loaded = loaded
        self.max_active = max_active
        self.deployment = deployment or Deployment()
        self.prefix_cache = prefix_cache
        self._generate = generate_fn
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._active: collections.deque[tuple[RequestHandle, Iterator]] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._cancelled = 0  # requests dropped because their client went away
        self._thread: threading.Thread | None = None

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._run, name="lockstep-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    def submit(self, request: GenerationRequest, plan: DecodePlan | None = None) -> RequestHandle:
        """Queue a request; call from the event loop. Output arrives on the handle."""
        handle = RequestHandle(request, asyncio.get_running_loop(), plan)
        with self._wake:
            if self._stopping:
                raise GenerationError("the server is shutting down")
            # Requests about to take a free slot are not "waiting" for the cap's purposes.
            queued = len(self._waiting) - max(0, self.max_active - len(self._active))
            if self.max_waiting is not None and queued >= self.max_waiting:
                raise QueueFull(f"{queued} requests are already waiting")
            self._waiting.append(handle)
            self._wake.notify()
        return handle

    def counts(self) -> dict[str, int]:
        """Active and waiting requests now, and requests dropped so far because their client left
        (the one count behind both /health and the `lockstep_cancelled_requests` metric)."""
        with self._wake:
            return {"active": len(self._active), "waiting": len(self._waiting), "cancelled": self._cancelled}

    def cut_off(self, message: str) -> int:
        """End every running and waiting request now with `ShuttingDown(message)`. Returns how many.

        For the drain timeout: each stream then ends with an error event and [DONE] instead of
        being severed mid-body. Call from the event loop.
        """
        with self._wake:
            handles = [h for h, _ in self._active] + list(self._waiting)
        for handle in handles:
            handle.cut = True
            handle.post(ShuttingDown(message))
            handle.cancel()
        return len(handles)

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        while self._admit():
            for _ in range(len(self._active)):
                handle, steps = self._active[0]  # stays listed while it runs (see counts())
                keep = self._step(handle, steps)
                with self._wake:
                    if keep:
                        self._active.rotate(-1)
                    else:
                        self._active.popleft()
                if not keep:
                    steps.close()
        for handle, _ in self._active:
            handle.post(GenerationError("the server is shutting down"))
        for handle in self._waiting:
            handle.post(GenerationError("the server is shutting down"))

    def _admit(self) -> bool:
        """Move waiting requests into free slots (FIFO); block while idle. False = stop."""
        with self._wake:
            while not self._stopping and not self._waiting and not self._active:
                self._wake.wait()
            if self._stopping:
                return False
            while self._waiting and len(self._active) < self.max_active:
                if self._exclusive_blocks(self._waiting[0]):
                    break  # FIFO: later requests wait too, so nobody overtakes it
                handle = self._waiting.popleft()
                if not handle.cancelled:
                    self._active.append((handle, self._start(handle)))
                elif handle.client_cancelled:
                    self._cancelled += 1
            return True

    def _exclusive_blocks(self, handle: RequestHandle) -> bool:
        """An exclusive request runs alone: it waits for an empty engine, and blocks others."""
        if handle.plan is not None and handle.plan.exclusive:
            return bool(self._active)
        return any(h.plan is not None and h.plan.exclusive for h, _ in self._active)

    def _start(self, handle: RequestHandle) -> Iterator:
        return self._generate(self.loaded, handle.request, plan=handle.plan, deployment=self.deployment,
                              prefix_cache=self.prefix_cache, cancelled=lambda: handle.cancelled)

    def _step(self, handle: RequestHandle, steps: Iterator) -> bool:
        """Advance one request by one unit of work; False when it is finished."""
        if handle.cancelled:
            self._cancelled += handle.client_cancelled
            return False
        try:
            event = next(steps)
        except StopIteration:  # finished, or gave up inside the step because it was cancelled
            self._cancelled += handle.client_cancelled
            return False
        except Exception as exc:  # reaches the client as an error, never a hang
            log.exception("generation failed")
            handle.post(GenerationError(f"generation failed: {type(exc).__name__}: {exc}"))
            return False
        if event is None:
            return True
        handle.post(event)
        return event.finish_reason is None
