"""A wide plain call of a 4-bit layer (a prompt chunk) as MLX's dequantize and a dense matmul
on CUDA: at prompt widths the dense GEMM on tensor cores beats MLX's tiled quantized matmul by
far more than decoding the weight costs (docs/BENCHMARKS.md, "Prompt chunks"). custom/split_rows.py
decides which calls take it; canonical rows never do (their order is lockstep's own kernels').

Both steps are MLX's, so nothing is compiled here; its smoke test compares the path with the
kernel audit's own NumPy decoding of the weight (kernels/audit/reference.py), per format and
dtype, once per machine, as the audit would: a faulty dequantize is not used.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from . import quant_rows
from .skinny import backend

# (weights N * K from, rows from): calls of a layer this large take the path from this many
# rows, where the dense matmul's gain has outgrown the decoding's cost (an 8B's gate, up and
# down from 256 rows, q and o from 384, k and v from 512).
ROWS_FROM = ((32 << 20, 256), (16 << 20, 384), (0, 512))
# Larger layers (a vocabulary's head) would decode a whole dense copy, gigabytes at 8B, for a
# call; they keep MLX's quantized matmul.
MAX_ELEMENTS = 64 << 20
# (M, N, K): a call as wide as the path takes, K a multiple of every group size.
SMOKE_SHAPES = ((256, 96, 512), (259, 40, 1152))


def min_rows(n: int, k: int) -> int:
    """The fewest rows of a call of an (N, K) layer that take the path."""
    return next(rows for elements, rows in ROWS_FROM if n * k >= elements)


def pays(n: int, k: int, rows: int) -> bool:
    """Whether a plain call of `rows` rows of an (N, K) layer is for this path."""
    return n * k <= MAX_ELEMENTS and rows >= min_rows(n, k)


def matmul(x, wq, scales, biases, *, group_size: int, bits: int, mode: str):
    """x times the layer's weight, decoded to x's dtype first."""
    dense = mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits, mode=mode, dtype=x.dtype)
    return x @ dense.T


def launch_for(lead: tuple, n: int, k: int, mode: str, bits: int, group: int, dtype, *_):
    """The call for x (lead + (k,)) where the smoke test passed here for this format and dtype,
    else None (the layer's own path)."""
    if unavailable_reason(mode, dtype) is not None:
        return None

    def launch(x, w, scales, biases=None):
        return matmul(x, w, scales, biases, group_size=group, bits=bits, mode=mode)
    return launch


def _smoke_test(mode: str, dtype) -> str | None:
    """The path against the audit's NumPy decoding of the weight, within the audit's bound for
    the format and dtype. None: every shape and group size holds."""
    import numpy as np

    from ..audit.probes import tolerance
    from ..audit.reference import reference_dequantize

    key = mx.random.key(29)
    for group in quant_rows.GROUPS[mode]:
        for m, n, k in SMOKE_SHAPES:
            kx, kw, key = mx.random.split(key, 3)
            x = mx.random.normal((m, k), key=kx).astype(dtype)
            wq, scales, *rest = mx.quantize(mx.random.normal((n, k), key=kw).astype(dtype), group, 4, mode=mode)
            biases = rest[0] if rest else None
            got = np.array(matmul(x, wq, scales, biases, group_size=group, bits=4, mode=mode).astype(mx.float32))
            want = np.array(x.astype(mx.float32)).astype(np.float64) @ reference_dequantize(
                wq, scales, biases, mode, 4, group).astype(np.float64).T
            if not np.isfinite(got).all():
                return f"{mode} g{group} {dtype} {m}x{n}x{k}: not finite"
            error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            if not error <= tolerance(mode, str(dtype).rsplit(".", 1)[-1]):
                return f"{mode} g{group} {dtype} {m}x{n}x{k}: off the audit's reference by {error:.3g} (relative)"
    return None


@lru_cache(maxsize=None)
def unavailable_reason(mode: str = "nvfp4", dtype=mx.bfloat16) -> str | None:
    """None where the path passed its smoke test on this GPU for this format and dtype."""
    return quant_rows.verdict("dequantized_rows", mode, dtype, lambda: _smoke_test(mode, dtype), __file__, __file__)


def runs_here() -> bool:
    return backend() == "cuda"
