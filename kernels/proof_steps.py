"""Points between the steps of a long proof where its caller may do other work.

The startup proofs (self-test, ragged proof, kernel builds) run for seconds to a minute on a
fresh GPU. A server that proves its guarantee after it starts serving runs them on its engine
thread, and serves plain passes between their steps:

    with between_steps(serve_waiting_requests):
        set_batch_invariant_limit(model, 8)   # calls step_done() after each width

`step_done()` is a no-op when no caller asked for anything (every other use of the proofs).
A proof calls it only where its own arrays are evaluated, so work done there cannot mix with
the proof's graph.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable


class _Hook(threading.local):
    fn: Callable[[], None] | None = None
    running: bool = False


_hook = _Hook()


@contextmanager
def between_steps(fn: Callable[[], None]):
    """Call `fn` at every `step_done()` of the enclosed proofs on this thread."""
    previous = _hook.fn
    _hook.fn = fn
    try:
        yield
    finally:
        _hook.fn = previous


def step_done() -> None:
    """A proof finished a step: run the caller's work, if any (never from inside that work)."""
    fn = _hook.fn
    if fn is None or _hook.running:
        return
    _hook.running = True
    try:
        fn()
    finally:
        _hook.running = False
