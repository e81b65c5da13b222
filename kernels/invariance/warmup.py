"""Build, at startup, every custom-kernel instance the installed canonical forms will launch.

On CUDA, `precompile_kernels` compiles them all at once, concurrently, and keeps each per
machine (kernels/custom/compiled.py), so a restart compiles none; it runs as soon as a
strategy is installed, before its self-test. `build_kernels` then runs the model once at every
width: what the custom kernels leave to first use (MLX's own kernels for each width, module
loads) happens at startup, not in the first passes, where it stalled the first burst of
clients (
bench/results/history/2026-11-30-h200-32-clients-issue8.md).
A proof taken from the verdict cache launches nothing itself.
"""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..proof_steps import step_done


def precompile_kernels(model, call_rows: int) -> int:
    """Every custom-kernel instance the installed setting launches at widths 1..call_rows (its
    linears, and the pooled attention at the model's head size), compiled or read from this
    machine's cache, concurrently. Returns how many are ready (0: none to build, or not CUDA)."""
    setting = getattr(model, "_lockstep_setting", None)
    if setting is None or call_rows < 1 or not setting.strategy.uses_custom_kernels:
        return 0
    from ..custom.precompile import activation_dtype, linear_shapes, precompile_for

    strategy = setting.strategy
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    head_dim = getattr(args, "head_dim", None) or (args.hidden_size // heads if heads else None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    dtype = activation_dtype(model)
    group = (heads // kv_heads,) if heads else ()  # query heads a KV head has
    attention = [(dtype, head_dim, *group)] if head_dim and dtype is not None else []
    return precompile_for(linear_shapes(model, dense=strategy.dense, quantized=strategy.quantized_form),
                          range(1, min(call_rows, setting.call_rows) + 1), attention=attention)


def build_kernels(model, call_rows: int) -> int:
    """Run the model once at every width 1..call_rows under its installed setting, when that
    setting's forms launch custom kernels. Returns the widths run (0: nothing to build)."""
    setting = getattr(model, "_lockstep_setting", None)
    if setting is None or call_rows < 1 or not setting.strategy.uses_custom_kernels:
        return 0
    widths = min(call_rows, setting.call_rows)
    for rows in range(1, widths + 1):
        mx.eval(model(mx.zeros((1, rows), dtype=mx.int32), cache=make_prompt_cache(model)))
        step_done()
    return widths
