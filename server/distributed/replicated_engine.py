"""`ReplicatedEngine`: the batched Engine, run identically on every rank of a deployment.

Each rank holds a shard of the model, so every forward pass needs every rank, with the same
shapes, in the same order. The engine's iteration (admission, prefill chunks, ragged decode
passes, sampling) is a deterministic function of its queue and of which requests are
cancelled, so the ranks stay in step if they see the same events at the same iteration
boundaries. Before each iteration (`_admit`, the first thing the base loop does) rank 0
broadcasts the events since the last one:
- new requests (their GenerationRequest with its seed, the DecodePlan, n > 1 followers),
- cancellations (client gone, or cut off at the drain timeout),
- stop,
- a digest of what its previous iteration posted (tokens as text, finish reasons, errors),
  which every other rank compares with its own: a divergence is a loud failure, never silent garbage.
Requests live on every rank as `ReplicaHandle`s whose `cancelled` flag changes only at a
boundary. On rank 0 a replica forwards its Deltas to the client's RequestHandle; elsewhere
they only feed the digest. While no rank has work (every rank knows it from the last
boundary), all ranks sleep and meet at the next boundary `idle_tick` later: an empty
iteration, so the others can tell idle from dead (server/distributed/watchdog.py), without
waiting inside the collective, which keeps a core busy on the ring backend.
"""
from __future__ import annotations

import hashlib
import logging
import pickle
import time

from lockstep.server.distributed.collectives import broadcast_bytes
from lockstep.server.distributed.watchdog import Watchdog
from lockstep.server.distributed.world import World
from lockstep.server.engine import Engine
from lockstep.server.engine.scheduling.errors import GenerationError, ShuttingDown
from lockstep.server.engine.scheduling.handle import RequestHandle

log = logging.getLogger("lockstep.distributed")

# Boundaries while idle: a request arriving then waits at most this long for the next one.
IDLE_TICK_S = 0.05
# How MLX's distributed backends start their error messages (e.g. "[ring] connection to a
# peer was lost").
TRANSPORT_ERRORS = ("[ring]", "[nccl]", "[jaccl]", "[mpi]")


class ReplicaHandle(RequestHandle):
    """A request as every rank's engine sees it. `client`: the HTTP side (rank 0 only)."""

    def __init__(self, rid: int, request, plan, client: RequestHandle | None, digest):
        super().__init__(request, None, plan)
        self.rid = rid
        self.client = client
        self._digest = digest
        if client is not None:
            self.submitted_at = client.submitted_at

    def deliver_via(self, events: list) -> RequestHandle | None:
        for event in events:
            self._digest(self.rid, event)
        return self.client.deliver_via(events) if self.client is not None else None


class _Inbox(list):
    """Rank 0's scheduler queue: the base `submit_group` validates and appends the clients'
    handles as always; they are diverted here until the next boundary broadcasts them."""

    def __init__(self, diverted: list):
        super().__init__()
        self.diverted = diverted

    def append(self, handle) -> None:
        (super().append if isinstance(handle, ReplicaHandle) else self.diverted.append)(handle)

    def extend(self, handles) -> None:
        for handle in handles:
            self.append(handle)


def _describe(event) -> bytes:
    if isinstance(event, Exception):
        return f"{type(event).__name__}:{event}".encode()
    return repr((event.text, event.completion_tokens, event.finish_reason,
                 [(t.token, t.logprob) for t in getattr(event, "logprobs", None) or []])).encode()


class ReplicatedEngine(Engine):
    def __init__(self, loaded, *, world: World, watchdog: Watchdog,
                 idle_tick: float = IDLE_TICK_S, **engine_options):
        super().__init__(loaded, **engine_options)
        self.world = world
        self.watchdog = watchdog
        self.idle_tick = idle_tick
        self._idle = True  # the last boundary left no rank anything to do (the same on every rank)
        self._last_boundary = time.monotonic()
        self.stopped_cleanly = False
        self._new: list[RequestHandle] = []  # rank 0: submitted, not yet broadcast
        self.scheduler.waiting = _Inbox(self._new)
        self._stop_requested = False
        self._next_id = 0
        self._iteration_digest = hashlib.sha256()  # what this rank's last iteration posted
        self._iterations = 0
        if loaded is not None:
            from lockstep.server.engine.structured.grammar import compiler_for

            compiler_for(loaded)  # constrained requests arrive pickled: their grammars recompile here

    # ------------------------------------------------------------ event loop side (rank 0)

    def stop(self) -> None:
        """Stop every rank at the next boundary (the stop is broadcast, like any event)."""
        with self._wake:
            self._stop_requested = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    def join(self) -> None:
        """Workers: wait for the engine loop to end (rank 0 broadcast stop)."""
        if self._thread is not None:
            self._thread.join()

    def cut_off(self, message: str) -> int:
        """End every request now (drain timeout): the clients at once; the replicas at the
        next boundary, where the cancellations are broadcast."""
        with self._wake:
            clients = [h.client for h in self._replicas() if h.client is not None] + list(self._new)
        for client in clients:
            client.cut = True
            client.post(ShuttingDown(message))
            client.cancel()
        return len(clients)

    def fail_clients(self, reason: str) -> None:
        """Watchdog hook: every client gets an error instead of waiting for a dead deployment."""
        with self._wake:
            clients = [h.client for h in self._replicas() if h.client is not None] + list(self._new)
        for client in clients:
            client.post(GenerationError(f"the distributed deployment failed: {reason}"))

    # ------------------------------------------------------------------ engine thread

    def _fail(self, handle, exc: Exception) -> None:
        """A request failed. If a collective failed (a lost peer), the ranks are no longer in
        step and the transport may stall from now on: the deployment fails at once."""
        if isinstance(exc, RuntimeError) and str(exc).startswith(TRANSPORT_ERRORS):
            self.watchdog.fail(f"a collective failed: {exc}")
        super()._fail(handle, exc)

    def _replicas(self) -> list[ReplicaHandle]:
        return [slot.handle for slot in self.scheduler.active] + list(self.scheduler.waiting)

    def _run(self) -> None:
        try:
            super()._run()  # a lost peer surfaces as a RuntimeError from MLX: the base keeps it in `failure`
        except BaseException as exc:
            self.watchdog.fail(f"engine iteration failed: {type(exc).__name__}: {exc}")
        if self.failure is not None:
            self.watchdog.fail(f"engine iteration failed: {self.failure}")
        if self._new:  # submitted after the stop was broadcast
            for client in self._new:
                client.post(GenerationError("the server is shutting down"))

    def _admit(self) -> bool:
        """One boundary: exchange the events, apply them on every rank, then admit as the base
        does. An idle iteration (every rank slept to it) admits nothing and runs nothing."""
        if self._idle:
            time.sleep(max(0.0, self._last_boundary + self.idle_tick - time.monotonic()))
        payload = self._collect() if self.world.is_root else None
        data = broadcast_bytes(self.world.group, payload)
        self._last_boundary = time.monotonic()
        self.watchdog.beat()
        events = pickle.loads(data)
        self._apply(events)
        if self._stopping:
            self.stopped_cleanly = True
            return False
        self._idle = not self.scheduler.waiting and not self.scheduler.active
        if self._idle:
            return True  # nothing to do on any rank; the base would block here
        return super()._admit()

    def _collect(self) -> bytes:
        """Rank 0: take the events since the last boundary."""
        with self._wake:
            new, self._new[:] = list(self._new), []
            cancels = [(h.rid, h.client.cut) for h in self._replicas()
                       if h.client is not None and h.client.cancelled and not h.cancelled]
            stop = self._stop_requested
        groups = []
        ids = {}
        for client in new:
            ids[id(client)] = rid = self._next_id
            self._next_id += 1
            leader = getattr(client, "leader", None)
            groups.append((rid, client.request, client.plan,
                           ids.get(id(leader)) if leader is not None else None,
                           client.cancelled))
        self._clients = {ids[id(c)]: c for c in new}
        return pickle.dumps({"new": groups, "cancel": cancels, "stop": stop,
                             "check": (self._iterations, self._iteration_digest.hexdigest())})

    def _apply(self, events: dict) -> None:
        iteration, digest = events["check"]
        mine = self._iteration_digest.hexdigest()
        if not self.world.is_root and (iteration, digest) != (self._iterations, mine):
            self.watchdog.fail(
                f"rank {self.world.rank} diverged from rank 0 at iteration {iteration}: the output "
                f"digest of its previous iteration {mine[:12]} != rank 0's {digest[:12]}")
        self._iteration_digest = hashlib.sha256()
        self._iterations += 1
        clients = getattr(self, "_clients", {}) if self.world.is_root else {}
        with self._wake:
            made = {}
            for rid, request, plan, leader, cancelled in events["new"]:
                handle = ReplicaHandle(rid, request, plan, clients.get(rid), self._record)
                if leader is not None and hasattr(handle, "leader"):
                    handle.leader = made[leader]
                if cancelled:
                    handle.cancel()
                made[rid] = handle
                self.scheduler.waiting.append(handle)
            by_id = {h.rid: h for h in self._replicas()}
            for rid, cut in events["cancel"]:
                handle = by_id.get(rid)
                if handle is not None:
                    handle.cut = cut
                    handle.cancel()
            if events["stop"]:
                self._stopping = True
        self._clients = {}

    def _record(self, rid: int, event) -> None:
        self._iteration_digest.update(rid.to_bytes(8, "little") + _describe(event))
