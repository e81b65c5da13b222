"""What `--kv-pool auto|on|off` means for a model here: "kernel" (the pooled attention kernel),
"reference" (the pool with one MLX attention call per row) or "off" (each request its own
KVCache). A pool needs ragged passes (ragged.py) and, for the kernel, KV layouts it takes.
"""
from __future__ import annotations

from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..custom.attention import kernel_takes, kernel_unavailable_reason
from .kv_pool import kv_layouts
from .ragged import ragged_problem

POOL_MODES = ("auto", "on", "off")


def pool_problem(model, layouts) -> str | None:
    """Why this model's requests cannot share a KV pool (None: they can)."""
    problem = ragged_problem(model)
    if problem:
        return problem
    if any(k[1] != v[1] for k, v, _ in layouts):
        return "its keys and values have different head sizes"
    return None


def kernel_problem(layouts) -> str | None:
    """Why the pooled attention kernel cannot serve KV of these layouts here (None: it can)."""
    for dtype, dim in {(dtype, k[1]) for k, _, dtype in layouts}:
        if not kernel_takes(dtype, dim):
            return f"head size {dim} ({dtype}): the kernel takes multiples of 32 up to 256"
        reason = kernel_unavailable_reason(dtype, dim)
        if reason:
            return reason
    return None


def pool_mode(model, requested: str) -> str:
    """What `--kv-pool auto|on|off` means for this model here: "kernel", "reference" or "off"."""
    if requested not in POOL_MODES:
        raise ValueError(f"--kv-pool must be one of {POOL_MODES}")
    if requested == "off" or ragged_problem(model) is not None:
        return "off"
    if any(type(c) is not KVCache for c in make_prompt_cache(model)):
        return "off"  # the pool holds KV only: recurrent or sliding-window state stays per request
    layouts = kv_layouts(model)
    if pool_problem(model, layouts) is not None:
        return "off"
    if kernel_problem(layouts) is None:
        return "kernel"
    return "reference" if requested == "on" else "off"
