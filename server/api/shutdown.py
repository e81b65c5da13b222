"""Graceful shutdown for `lockstep serve`: SIGTERM/SIGINT/SIGHUP drain, then exit 0.

uvicorn on its own stops listening at once and, after shutting down, re-raises the signal,
so the process dies with 143 (SIGTERM). Under launchd's KeepAlive {SuccessfulExit: false}
that reads as a crash and restarts a deliberate stop. `DrainingServer` instead keeps
listening while in-flight requests finish (new ones get 503 from `server/api/drain.py`), stops
when idle or after `drain_timeout` seconds, and does not re-raise: `serve()` returns
normally and the command exits 0. A second signal stops at once. Either way, requests
still running are first cut off by the app (`Drain.cut`): each stream gets a final error
event and [DONE], and the log one line per cut request, instead of a severed body and a
traceback from uvicorn cancelling the handler.

An engine that stopped after an error (`Engine.failure`: its requests have failed with it) stops
the server the same way, and the command then exits 1, which launchd restarts.

SIGHUP drains like SIGTERM (its default action would kill the server at once). Before serving
starts, `stop_during_startup`'s handlers end start-up (the model load) at once, also exit 0.
The server's connections are `GuardedProtocol`s (server/api/connections.py): capped, with
header and body deadlines.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import threading
import time
from typing import Callable

import uvicorn

from lockstep.server.api.connections import (ConnectionGuard, ConnectionLimits, GuardedProtocol,
                                             accept_error_handler)
from lockstep.server.api.drain import Drain

log = logging.getLogger("lockstep.shutdown")

DEFAULT_DRAIN_TIMEOUT = 30.0
# After draining (or its timeout), uvicorn's own wait for open connections is this short.
AFTER_DRAIN_GRACE_S = 2.0
# After cutting requests off, how long their final events get to reach the clients.
AFTER_CUT_GRACE_S = 1.0
# Signals that stop the server: drained once serving, at once before.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_IGNORED: set[int] = set()  # stop signals the process started out ignoring (`nohup`: SIGHUP) stay ignored


def _handled_signals() -> list[int]:
    _IGNORED.update(sig for sig in STOP_SIGNALS if signal.getsignal(sig) is signal.SIG_IGN)
    return [sig for sig in STOP_SIGNALS if sig not in _IGNORED]


class StopRequested(BaseException):
    """A stop signal arrived during start-up (raised in the main thread by the handler that
    `stop_during_startup` installs; a BaseException, so no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_now(signum, frame) -> None:
    raise StopRequested(signum)


def stop_during_startup() -> None:
    """Until `serve` installs the drain's handlers: SIGTERM, SIGINT and SIGHUP raise `StopRequested`
    in the main thread, abandoning whatever start-up is doing, for the caller to exit 0 (a signal's
    default action would read as a crash to launchd, which restarts it)."""
    for sig in _handled_signals():
        signal.signal(sig, _stop_now)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout: float,
                 guard: ConnectionGuard | None = None, failure: Callable[[], str | None] | None = None):
        super().__init__(config)
        self.drain = drain
        self.guard = guard
        self.drain_timeout = drain_timeout
        # why the engine stopped serving (None while it serves): then the server stops as on a
        # signal, for the caller to exit 1 (launchd restarts a process whose device failed)
        self.failure = failure
        self.failed: str | None = None
        self._drain_deadline: float | None = None
        self._cut_deadline: float | None = None
        self._cut_reason = "drain timeout"

    def _cut(self, why: str) -> None:
        if self._cut_deadline is None:
            log.warning("%s: %d request(s) still running are cut off", why, self.drain.in_flight)
            self.drain.cut()
            self._cut_deadline = time.monotonic() + AFTER_CUT_GRACE_S

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, with SIGHUP too, and nothing re-raised after: the handlers stay installed (a
        late signal while the engine stops finds the drain over and does nothing)."""
        if threading.current_thread() is threading.main_thread():
            for sig in _handled_signals():
                signal.signal(sig, self.handle_exit)
        yield

    async def startup(self, sockets=None) -> None:
        if self.guard is not None:
            asyncio.get_running_loop().set_exception_handler(accept_error_handler(self.guard.events))
        await super().startup(sockets=sockets)  # listens with the config's backlog, ACCEPT_BATCH
        for server in self.servers:  # the kernel's queue back to BACKLOG; asyncio's batch stays
            for listener in server.sockets:
                with socket.fromfd(listener.fileno(), listener.family, listener.type) as same:
                    same.listen(BACKLOG)

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets=sockets)
        if self.guard is not None:
            self.guard.events.flush()

    def handle_exit(self, sig, frame) -> None:
        # Not recorded in uvicorn's captured signals: nothing is re-raised after shutdown.
        if self._drain_deadline is not None:
            # The cut itself happens in on_tick, on the event loop: a signal handler must not
            # take the engine's lock (the interrupted code may hold it).
            self._cut_reason = "second signal"
            self._drain_deadline = time.monotonic()
            return
        log.info("shutting down: draining %d request(s) for up to %.0f s", self.drain.in_flight,
                 self.drain_timeout)
        self.drain.start()
        self._drain_deadline = time.monotonic() + self.drain_timeout

    async def on_tick(self, counter: int) -> bool:
        if self.failed is None and self.failure is not None and self._drain_deadline is None:
            self.failed = self.failure()
            if self.failed is not None:
                log.error("the engine stopped after an error (%s): the server stops", self.failed)
                self.drain.start()  # its requests have their error already: the drain is short
                self._drain_deadline = time.monotonic() + self.drain_timeout
        if self._drain_deadline is not None and not self.should_exit:
            now = time.monotonic()
            if self.drain.idle():
                self.should_exit = True
            elif now >= self._drain_deadline:
                self._cut(self._cut_reason)
                if now >= self._cut_deadline:
                    self.should_exit = True
        return await super().on_tick(counter)


BACKLOG = 2048  # uvicorn's own default
# asyncio accepts up to its `backlog` connections in one loop pass, before any of them is handled
# (and a connection closed under the cap frees its descriptor a pass or two later), so that
# number is kept small, for the descriptors in flight to stay within file_limit's reserve.
ACCEPT_BATCH = 16


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a busy port fails in a second.

    Raises OSError naming the address. Options match uvicorn's own bind (SO_REUSEADDR).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def serve(app, host: str, port: int, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
          sock: socket.socket | None = None, connections: ConnectionLimits = ConnectionLimits(),
          failure: Callable[[], str | None] | None = None, **config) -> None:
    """Run `app` (built by `create_app`, which owns its `Drain`) until a signal drains it, or
    until `failure()` says why the engine stopped serving.

    `sock`: an already bound socket (from `bind`) to serve on instead of binding here;
    `connections`: the cap and deadlines its connections are held to.
    """
    server = draining_server(app, host, port, drain_timeout, connections, failure=failure, **config)
    server.run(sockets=[sock] if sock is not None else None)


def draining_server(app, host: str, port: int, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
                    connections: ConnectionLimits = ConnectionLimits(), failure=None, **config) -> DrainingServer:
    """The server `serve` runs (tests run it on a thread)."""
    config.setdefault("timeout_graceful_shutdown", AFTER_DRAIN_GRACE_S)
    config.setdefault("backlog", ACCEPT_BATCH)  # `startup` sets the kernel's queue back to BACKLOG
    guard = ConnectionGuard(connections)
    config = uvicorn.Config(app, host=host, port=port, http=functools.partial(GuardedProtocol, guard=guard),
                            timeout_keep_alive=connections.keep_alive_timeout, **config)
    return DrainingServer(config, app.state.drain, drain_timeout, guard, failure)


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
