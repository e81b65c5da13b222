"""Where the deployment's guarantee stands, for requests that need it.

A server proves its guarantee after it starts serving (server/startup_work.py `GuaranteeWork`, run
on the engine thread between plain passes). Until then the state is "proving": plain requests
are served, deterministic ones wait for the state to settle ("in_force" or "refused"), at most
`--guarantee-timeout`, and are never planned before it settles. "off": the deployment has no
batch-invariant limit (L = 0), so there is nothing to prove.
"""
from __future__ import annotations

import asyncio
import threading

PROVING, IN_FORCE, REFUSED, OFF = "proving", "in_force", "refused", "off"
STATES = (PROVING, IN_FORCE, REFUSED, OFF)


def settled_state(deployment) -> str:
    """The state a proven `deployment` (server/engine/guarantee/deployment.py) settles in."""
    guarantee = deployment.guarantee
    return IN_FORCE if guarantee.guaranteed else REFUSED if guarantee.call_rows else OFF


class GuaranteeState:
    """The state, settled once from any thread; awaited from event loops."""

    def __init__(self, state: str = OFF, reason: str = ""):
        if state not in STATES:
            raise ValueError(f"guarantee state must be one of {STATES}")
        self.state = state
        self.reason = reason
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    @property
    def settled(self) -> bool:
        return self.state != PROVING

    def settle(self, state: str, reason: str = "") -> None:
        """The proof ended (`state` is in_force, refused or off): wake every waiting request."""
        if state not in STATES or state == PROVING:
            raise ValueError(f"a guarantee settles as one of {STATES[1:]}")
        with self._lock:
            self.state, self.reason = state, reason
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)

    async def wait(self, timeout: float) -> bool:
        """Until the state settles or `timeout` seconds pass; True when settled."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self.settled:
                return True
            self._waiters.append((loop, future))
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters = [w for w in self._waiters if w[1] is not future]
        return self.settled

    def describe(self) -> dict:
        return {"state": self.state, **({"reason": self.reason} if self.reason else {})}


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
