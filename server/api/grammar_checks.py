"""Grammar checks on threads of their own: at most `workers` at once and `queue` more waiting.

Checking and compiling a request's output grammar (server/api/constraints.py, then
server/engine/structured/grammar.py) takes milliseconds to seconds, and the checker process takes one
grammar at a time. On the event loop's default thread pool, which also tokenizes every request,
a burst of large schemas held every thread and plain requests waited behind them. Here grammar
checks wait only for each other, and one that finds `workers + queue` already admitted is a 429
at once (with Retry-After), not an unbounded wait.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

from lockstep.server.api.limits import grammar_checks_full

T = TypeVar("T")


class GrammarChecks:
    def __init__(self, workers: int, queue: int):
        if workers < 1:
            raise ValueError(f"grammar check workers must be at least 1, got {workers}")
        if queue < 0:
            raise ValueError(f"the grammar check queue must be at least 0, got {queue}")
        self.workers, self.queue = workers, queue
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-check")
        self._lock = threading.Lock()  # admitted on the event loop, released on a worker thread
        self._admitted = 0

    @property
    def admitted(self) -> int:
        """Checks running or waiting. A check whose request went away still counts until its
        thread has finished it (a running compile cannot be stopped)."""
        return self._admitted

    async def run(self, check: Callable[..., T], *args) -> T:
        """`check(*args)` on a grammar check thread; a 429 APIError when the queue is full."""
        with self._lock:
            if self._admitted >= self.workers + self.queue:
                raise grammar_checks_full(self.workers, self.queue)
            self._admitted += 1
        try:
            future = self._executor.submit(check, *args)
        except BaseException:
            self._release(None)
            raise
        future.add_done_callback(self._release)  # also when a waiting check is cancelled
        return await asyncio.wrap_future(future)  # cancelling this cancels a check not yet started

    def _release(self, _: Future | None) -> None:
        with self._lock:
            self._admitted -= 1
