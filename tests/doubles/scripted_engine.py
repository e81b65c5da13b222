"""Test double: an `Engine` whose requests run a scripted generator instead of the model.

HTTP-level tests (limits, queueing, drains, disconnects) need generations that stall or end
exactly when the test says. `ScriptedEngine` keeps the real engine's queue, its cap, its
counts, cancellation and cut-off (server/engine/engine.py), and replaces only the worker
loop: each admitted request steps `script(loaded, request, plan=..., cancelled=...)`, a generator of
`Delta | None`, one item per turn (None: no output yet, the loop goes on).
"""
from __future__ import annotations

from lockstep.server.engine.engine import Engine
from lockstep.server.engine.scheduling.errors import GenerationError
from lockstep.server.engine.scheduling.scheduler import Slot


class _NoModel:
    """What the engine asks of a runner, for a double that never runs the model."""

    kv_pool = None
    batched = False

    def describe(self) -> dict:
        return {"batched": False, "kv_pool": "off"}


class ScriptedEngine(Engine):
    def __init__(self, loaded, script, max_active: int = 4, **options):
        super().__init__(loaded, max_active, runner=_NoModel(), **options)
        self.script = script

    def _run(self) -> None:
        scheduler = self.scheduler
        while self._admit_scripted():
            for slot in list(scheduler.active):
                if slot.handle.cancelled:
                    scheduler.note_cancelled(slot.handle)
                    self._drop(slot)
                    continue
                try:
                    event = next(slot.state)
                except StopIteration:  # finished, or gave up inside the step because it was cancelled
                    scheduler.note_cancelled(slot.handle)
                    self._drop(slot)
                    continue
                except Exception as exc:  # reaches the client as an error, never a hang
                    self._fail(slot.handle, exc)
                    self._drop(slot)
                    continue
                if event is not None:
                    slot.handle.post(event)
                    if event.finish_reason is not None:
                        self._drop(slot)
        for slot in scheduler.active:
            slot.handle.post(GenerationError("the server is shutting down"))
        for handle in scheduler.waiting:
            handle.post(GenerationError("the server is shutting down"))

    def _admit_scripted(self) -> bool:
        scheduler = self.scheduler
        with self._wake:
            while not self._stopping and not scheduler.waiting and not scheduler.active:
                self._wake.wait()
            if self._stopping:
                return False
            while scheduler.waiting and len(scheduler.active) < scheduler.max_active:
                handle = scheduler.waiting.pop(0)
                if handle.cancelled:
                    scheduler.note_cancelled(handle)
                    continue
                script = self.script(self.loaded, handle.request, plan=handle.plan,
                                     cancelled=lambda h=handle: h.cancelled)
                scheduler.active.append(Slot(handle, script, 0))
            return True

    def _drop(self, slot: Slot) -> None:
        with self._wake:
            if slot in self.scheduler.active:
                self.scheduler.active.remove(slot)
        slot.state.close()
