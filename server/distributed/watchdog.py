"""Bounded failure for a distributed deployment: never a hang.

A collective waits for every rank, so a rank that died or hangs stalls the others inside
MLX. The engine `beat()`s after each collective it completes (every iteration, and while
idle an empty one every `idle_tick`); a thread checks that the last beat
is younger than the timeout. `fail()` — from the checker, or from the engine when a
collective raises (the ring backend reports a lost peer) — marks the process failed (the
HTTP app then answers 503, /health included), runs the failure hooks (ending the client
streams with an error), waits a short grace for those to leave, and exits 1.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

log = logging.getLogger("lockstep.distributed")


class Watchdog:
    def __init__(self, rank: int, timeout: float, grace: float = 0.0, poll: float = 0.25):
        self.rank = rank
        self.timeout = timeout
        self.grace = grace  # seconds between failing and exiting (rank 0: for /health and streams)
        self.phase = "startup"
        self.failed: str | None = None
        self.on_fail: list = []
        self._poll = poll
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="lockstep-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def beat(self) -> None:
        self._last = time.monotonic()

    def enter(self, phase: str, timeout: float) -> None:
        """A new phase with its own timeout (startup proofs take longer than an iteration)."""
        self.phase, self.timeout = phase, timeout
        self.beat()

    def _watch(self) -> None:
        while self.failed is None:
            time.sleep(self._poll)
            quiet = time.monotonic() - self._last
            if quiet > self.timeout:
                self.fail(f"no collective completed for {quiet:.0f} s during {self.phase} "
                          f"(limit {self.timeout:.0f} s): another rank died or hangs")

    def fail(self, reason: str) -> None:
        """Mark this rank failed and exit 1 after the grace (idempotent; never returns)."""
        with self._lock:
            first = self.failed is None
            if first:
                self.failed = reason
        if first:
            log.error("rank %d: deployment failed: %s; exiting", self.rank, reason)
            for hook in self.on_fail:
                try:
                    hook(reason)
                except Exception:  # the exit must happen whatever a hook does
                    log.exception("failure hook")
            time.sleep(self.grace)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        while True:  # another thread is exiting the process
            time.sleep(1)
