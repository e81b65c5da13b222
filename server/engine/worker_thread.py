"""Threads for MLX work that stay alive after the work they ran.

MLX keeps one compile cache per OS thread (`mx.compile`), and its entries hold Python objects.
A thread that exits tears its cache down after Python has let go of the thread; when that
overlaps the interpreter's finalization (an engine stopped, then the process exits), taking the
GIL there ends the thread inside a C++ destructor and the whole process aborts ("terminate
called without an active exception", sometimes a hang). So an engine's loop runs here: on a
daemon thread that, once the loop returns, waits for the next loop to run and never exits.
An idle thread holds only its cache's entries of compiled functions still alive.

    job = start(loop, name="lockstep-engine")   # runs loop() on an idle thread, else a new one
    job.join()                                  # until loop() returned
"""
from __future__ import annotations

import logging
import queue
import threading

log = logging.getLogger(__name__)

_idle: list[queue.SimpleQueue] = []  # inboxes of threads waiting for a job
_lock = threading.Lock()


class Job:
    """One function running on a worker thread."""

    def __init__(self, name: str):
        self.name = name
        self._done = threading.Event()

    def join(self) -> None:
        """Wait until the function returned (or raised)."""
        self._done.wait()


def start(fn, name: str) -> Job:
    """Run `fn()` on a worker thread named `name` (an idle one if there is one)."""
    job = Job(name)
    with _lock:
        inbox = _idle.pop() if _idle else None
    if inbox is None:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(inbox,), name=name, daemon=True).start()
    inbox.put((fn, job))
    return job


def idle_threads() -> int:
    with _lock:
        return len(_idle)


def _serve(inbox: queue.SimpleQueue) -> None:
    while True:
        fn, job = inbox.get()
        threading.current_thread().name = job.name
        try:
            fn()
        except BaseException:  # as an exception ending a thread would be: logged, the thread lives on
            log.exception("%s stopped with an error", job.name)
        finally:
            # an idle thread must not keep its last job alive (an unloaded model's engine)
            fn = None  # noqa: F841
            threading.current_thread().name = "lockstep-idle"
            with _lock:
                _idle.append(inbox)
            job._done.set()
