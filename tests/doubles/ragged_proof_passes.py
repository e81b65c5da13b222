"""Test double: a spy on the ragged proof (kernels/batching/ragged_selftest.py) that counts its
passes by width and its setup, and can break one width's pass as a kernel that breaks invariance
there would. Used by tests/test_ragged_proof_resume.py and bench/fallback_proof.py; it patches the
modules while its `with` block runs and puts them back after."""
from __future__ import annotations

import contextlib
import threading

import lockstep.kernels.batching.ragged_selftest as ragged_selftest
import lockstep.kernels.invariance.layers as layers


@contextlib.contextmanager
def counted_widths(on_pass=None, broken_width=None, setup=None):
    """The widths of the ragged proof's passes, in the order they run (its solo passes are not
    counted: a width's pass runs inside `calls_in_blocks`). `on_pass(width)` runs before each.
    `broken_width`: that width's pass gives its first request other logits (a kernel that breaks
    invariance there). `setup`: a dict that gets the proof's setup work, "caches" (the proof's
    caches made: a KV pool where it uses one), "prefills" (each pool member's prompt) and "solo"
    (each member's rows run alone), and "members": the requests of the widths' passes (by their
    rows), so what was set up can be matched with what the passes needed."""
    widths, inside = [], threading.local()
    if setup is not None:
        setup.update(caches=0, prefills=0, solo=[], members=set())
        caches = ragged_selftest._Caches

        class CountedCaches(caches):
            def __init__(self, *args, **kwargs):
                setup["caches"] += 1
                super().__init__(*args, **kwargs)

            def new(self):
                setup["prefills"] += 1
                return super().new()
        ragged_selftest._Caches = CountedCaches
    blocks, forward = layers.calls_in_blocks, ragged_selftest.ragged_forward

    @contextlib.contextmanager
    def marked():
        inside.on = True
        try:
            with blocks():
                yield
        finally:
            inside.on = False

    def spy(model, requests, *args, **kwargs):
        rows = [tuple(tokens) for _, tokens in requests]
        if not getattr(inside, "on", False):
            if setup is not None:
                setup["solo"] += rows
            return forward(model, requests, *args, **kwargs)
        width = sum(map(len, rows))
        if on_pass is not None:
            on_pass(width)
        widths.append(width)
        if setup is not None:
            setup["members"] |= set(rows)
        outs = forward(model, requests, *args, **kwargs)
        return [outs[0] + 1, *outs[1:]] if width == broken_width else outs

    layers.calls_in_blocks, ragged_selftest.ragged_forward = marked, spy
    try:
        yield widths
    finally:
        layers.calls_in_blocks, ragged_selftest.ragged_forward = blocks, forward
        if setup is not None:
            ragged_selftest._Caches = caches
