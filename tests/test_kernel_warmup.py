"""Startup builds every custom-kernel instance the installed forms launch (kernels/invariance/warmup.py),
so a restart whose proof comes from the verdict cache does not compile them during the first
passes. On this CPU the custom kernels are unavailable and their forms fall back, which still
runs every width through the canonical layers."""
import threading

import lockstep.kernels.invariance.layers as layers
from tests.doubles.shape_variant import shape_variant_backend
from lockstep.kernels.invariance import STRATEGIES, set_batch_invariant_limit
from lockstep.kernels.invariance.layers import Setting
from lockstep.kernels.invariance.warmup import build_kernels
from tests.test_deterministic_double import peaked_llama

LIMIT = 5


def test_every_width_up_to_l_runs_when_the_forms_launch_custom_kernels(monkeypatch):
    model = peaked_llama()
    with shape_variant_backend():
        invariance = set_batch_invariant_limit(model, LIMIT)
    assert invariance.guaranteed and not STRATEGIES[invariance.strategy].uses_custom_kernels
    assert build_kernels(model, LIMIT) == 0  # nothing to compile for these forms

    widths, canonical, here = set(), layers.dense_rows, threading.current_thread()

    def recorded(x, weight, form):
        if threading.current_thread() is here:
            widths.add(x.reshape(-1, x.shape[-1]).shape[0])
        return canonical(x, weight, form)

    monkeypatch.setattr(layers, "dense_rows", recorded)
    model._lockstep_setting = Setting(LIMIT, STRATEGIES["skinny"])
    assert STRATEGIES["skinny"].uses_custom_kernels
    assert build_kernels(model, LIMIT) == LIMIT
    assert set(range(1, LIMIT + 1)) <= widths
