"""Connections: how many the server holds, and how long one may take to send its request.

uvicorn's h11 protocol on its own accepts every socket and waits for ever for a request's
headers and body, so clients that connect and send nothing (or send slowly) each hold a file
descriptor; at the open-file limit asyncio's accept fails in a loop, logging a traceback each
time, and every client stalls. `GuardedProtocol` (h11's protocol with a `ConnectionGuard`) adds:

- a cap, `max_connections`, kept below the open-file limit (server/api/file_limit.py). A
  connection over it closes the least recently active one that is not being answered (waiting
  for its headers, idle between keep-alive requests, or still sending its body); when every
  connection is being answered, the new one gets a 503 and is closed;
- `header_timeout`: a request's headers must arrive whole within this many seconds of the
  connection opening, or of the first byte of a keep-alive connection's next request;
  otherwise the connection is closed;
- `body_timeout`: its body within this many seconds of its headers; otherwise a 408;
- `keep_alive_timeout` (uvicorn's own): an idle keep-alive connection is closed after it.

What the guard closes, and accept failures (`accept_error_handler`), are logged as one
summary line per `LOG_INTERVAL_S` at most, never a line per event.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from lockstep.server.api.errors import APIError

log = logging.getLogger("lockstep.connections")

DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0
LOG_INTERVAL_S = 60.0
# asyncio's message when accept() fails for lack of descriptors or memory (it retries a second later).
ACCEPT_FAILED = "socket.accept() out of system resource"


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S


class RateLimitedLog:
    """Counts events by kind; logs one warning summing them up per `interval_s` at most (the
    first event logs at once, later ones join the next line)."""

    def __init__(self, logger: logging.Logger = log, interval_s: float = LOG_INTERVAL_S):
        self.logger = logger
        self.interval_s = interval_s
        self.pending: Counter[str] = Counter()
        self._last: float | None = None

    def note(self, kind: str) -> None:
        self.pending[kind] += 1
        now = time.monotonic()
        if self._last is not None and now - self._last < self.interval_s:
            return
        self._last = now
        self.flush()

    def flush(self) -> None:
        """Log what is pending now (at shutdown: the counts since the last line)."""
        if self.pending:
            summary = "; ".join(f"{kind} ({count}x)" for kind, count in self.pending.items())
            self.pending.clear()
            self.logger.warning("%s [at most one such line per %.0f s]", summary, self.interval_s)


class ConnectionGuard:
    """The open connections of one server, least recently active first, and the cap on them.
    Touched only on the event loop."""

    def __init__(self, limits: ConnectionLimits, events: RateLimitedLog | None = None):
        self.limits = limits
        self.events = events or RateLimitedLog()
        self.open: dict[GuardedProtocol, None] = {}  # insertion order = least recently active first
        self.counts: Counter[str] = Counter()

    def note(self, kind: str) -> None:
        self.counts[kind] += 1
        self.events.note(kind)

    def admit(self, connection: GuardedProtocol) -> bool:
        """Make room for `connection` (closing an idle one at the cap); False when there is none."""
        if len(self.open) >= self.limits.max_connections:
            idle = next((c for c in self.open if c.evictable), None)
            if idle is None:
                self.note(f"connections refused: all {self.limits.max_connections} busy")
                return False
            self.note(f"idle connections closed at the cap of {self.limits.max_connections}")
            self.closed(idle)
            idle.evict()
        self.open[connection] = None
        return True

    def touched(self, connection: GuardedProtocol) -> None:
        if self.open.pop(connection, False) is None:
            self.open[connection] = None

    def closed(self, connection: GuardedProtocol) -> None:
        self.open.pop(connection, None)


def _error_bytes(error: APIError) -> bytes:
    return bytes(error.response().body)


def _at_cap() -> APIError:
    return APIError(503, "the server is at its connection limit; retry shortly", type="server_error",
                    code="too_many_connections")


_REFUSAL = _error_bytes(_at_cap())
REFUSAL_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                    b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(_REFUSAL)) + _REFUSAL


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol under a `ConnectionGuard`: capped, with header and body deadlines.

    Build it with `functools.partial(GuardedProtocol, guard=...)` as uvicorn's `http` class."""

    def __init__(self, config, server_state, app_state, _loop=None, *, guard: ConnectionGuard):
        super().__init__(config, server_state, app_state, _loop)
        self.guard = guard
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # "headers" or "body" while a deadline runs
        self._seen_cycle = None  # the request whose headers were seen last

    # ------------------------------------------------------------ state

    @property
    def evictable(self) -> bool:
        """Not being answered: waiting for headers, idle between requests, or still sending its body."""
        cycle = self.cycle
        return cycle is None or cycle.response_complete or (cycle.more_body and not cycle.response_started)

    def _awaiting_request(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, what: str, seconds: float, callback) -> None:
        self._disarm()
        self._waiting_for = what
        self._deadline = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._waiting_for = None, None

    def _follow_cycle(self) -> None:
        """After h11 parsed what arrived: a new request's headers end the header deadline and,
        with a body to come, start the body's; its body's end ends that."""
        cycle = self.cycle
        if cycle is None:
            return
        if cycle is not self._seen_cycle:
            self._seen_cycle = cycle
            self._disarm()
            if cycle.more_body and not cycle.response_complete:
                self._arm("body", self.guard.limits.body_timeout, self._body_timed_out)
        elif self._waiting_for == "body" and not cycle.more_body:
            self._disarm()

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self):
            transport.write(REFUSAL_RESPONSE)
            transport.close()
            return
        self._arm("headers", self.guard.limits.header_timeout, self._headers_timed_out)

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.guard.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.guard.touched(self)
        if self._deadline is None and self._awaiting_request():
            self._arm("headers", self.guard.limits.header_timeout, self._headers_timed_out)
        super().data_received(data)
        self._follow_cycle()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_cycle()  # a pipelined request may have been parsed just now

    # ------------------------------------------------------------ closing

    def _headers_timed_out(self) -> None:
        self._deadline, self._waiting_for = None, None
        self.guard.note(f"connections closed: no whole request headers within {self.guard.limits.header_timeout:g} s")
        self.transport.close()

    def _body_timed_out(self) -> None:
        self._deadline, self._waiting_for = None, None
        seconds = self.guard.limits.body_timeout
        self.guard.note(f"requests refused: no whole body within {seconds:g} s")
        self._answer_and_close(APIError(408, f"the request body did not arrive within {seconds:g} s",
                                        code="request_timeout"))

    def evict(self) -> None:
        """Closed to make room under the cap (the guard has dropped it already)."""
        self._disarm()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            self._answer_and_close(_at_cap())  # it was still sending its body
        else:
            self.transport.close()

    def _answer_and_close(self, error: APIError) -> None:
        """Answer the request whose body is still coming with `error` and close; the app,
        waiting for that body, reads a disconnect and its own answer goes nowhere."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            body = _error_bytes(error)
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:
                output = self.conn.send(h11.Response(status_code=error.status, headers=headers))
                output += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
                self.transport.write(output)
            except h11.LocalProtocolError:
                pass
        if cycle is not None:
            cycle.response_started = cycle.response_complete = cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def accept_error_handler(events: RateLimitedLog):
    """An event-loop exception handler: asyncio's accept failures (one per queued connection,
    every second, while descriptors run out) become `events`' rate-limited line; anything else
    goes to the loop's default handler."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") == ACCEPT_FAILED:
            exc = context.get("exception")
            events.note(f"cannot accept connections: {getattr(exc, 'strerror', None) or exc}")
            return
        loop.default_exception_handler(context)

    return handle
