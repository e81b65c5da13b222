"""Build, at startup, every custom-kernel instance the installed canonical forms will launch.

MLX compiles a custom kernel per template instance on its first launch (the `skinny` kernels'
instances depend on the row count). A fresh self-test launches them all; a proof taken from
the verdict cache launches none, so without this the first passes after a restart would
stall for seconds while their widths compile (docs/BENCHMARKS.md, session 7: the first-burst
stalls).
"""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def build_kernels(model, limit: int) -> int:
    """Run the model once at every width 1..limit under its installed setting, when that
    setting's forms launch custom kernels. Returns the widths run (0: nothing to build)."""
    setting = getattr(model, "_lockstep_setting", None)
    if setting is None or limit < 1 or not setting.strategy.uses_custom_kernels:
        return 0
    widths = min(limit, setting.limit)
    for rows in range(1, widths + 1):
        mx.eval(model(mx.zeros((1, rows), dtype=mx.int32), cache=make_prompt_cache(model)))
    return widths
