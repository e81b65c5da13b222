"""Graceful shutdown for `lockstep serve`: SIGTERM/SIGINT drain, then exit 0.

uvicorn on its own stops listening at once and, after shutting down, re-raises the signal,
so the process dies with 143 (SIGTERM). Under launchd's KeepAlive {SuccessfulExit: false}
that reads as a crash and restarts a deliberate stop. `DrainingServer` instead keeps
listening while in-flight requests finish (new ones get 503 from `server/drain.py`), stops
when idle or after `drain_timeout` seconds, and does not re-raise: `serve()` returns
normally and the command exits 0. A second signal stops at once.
"""
from __future__ import annotations

import logging
import time

import uvicorn

from server.drain import Drain

log = logging.getLogger("lockstep.shutdown")

DEFAULT_DRAIN_TIMEOUT = 30.0
# After draining (or its timeout), uvicorn's own wait for open connections is this short.
AFTER_DRAIN_GRACE_S = 2.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout: float):
        super().__init__(config)
        self.drain = drain
        self.drain_timeout = drain_timeout
        self._drain_deadline: float | None = None

    def handle_exit(self, sig, frame) -> None:
        # Not recorded in uvicorn's captured signals: nothing is re-raised after shutdown.
        if self._drain_deadline is not None:
            log.warning("second signal: stopping now")
            self.should_exit = self.force_exit = True
            return
        log.info("shutting down: draining %d request(s) for up to %.0f s", self.drain.in_flight,
                 self.drain_timeout)
        self.drain.start()
        self._drain_deadline = time.monotonic() + self.drain_timeout

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None and not self.should_exit:
            if self.drain.idle():
                self.should_exit = True
            elif time.monotonic() >= self._drain_deadline:
                log.warning("drain timeout: %d request(s) still running are cut off", self.drain.in_flight)
                self.should_exit = True
        return await super().on_tick(counter)


def serve(app, host: str, port: int, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT, **config) -> None:
    """Run `app` (built by `create_app`, which owns its `Drain`) until a signal drains it."""
    config.setdefault("timeout_graceful_shutdown", AFTER_DRAIN_GRACE_S)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, **config), app.state.drain, drain_timeout)
    server.run()


def exit_without_finalizing(code: int = 0) -> None:
    """End the process now, skipping interpreter finalization.

    After MLX has run on a thread other than the main one (the engine's worker), CPython's
    finalization intermittently aborts in MLX's native teardown ("terminate called without
    an active exception", exit 134), turning a clean stop into a crash for launchd/systemd.
    Everything worth keeping is done by now (engine stopped); flush the logs and leave.
    """
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
