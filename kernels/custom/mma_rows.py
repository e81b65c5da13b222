"""Which kernel a dense layer's canonical rows run under the dense form "mma_rows"
(kernels/invariance/ops.py): the one place that decides, per layer shape and x dtype, for the
layers' calls (ops.dense_rows, ops.dense_rows_in_one_launch) and the startup compile
(precompile.py).

- a large 16-bit layer: `skinny`'s tensor-core kernel (skinny_mma.cu) at every width, one
  row included: each row's dot product in an order fixed by K (index model: mma_order.py),
  so a row alone and the same row among 63 others have the same bits, and a wide call loads
  each weight once for all its rows instead of running an fp32 FMA chain per row;
- anything else (a small layer, float32, no CUDA, the kernel not passing its smoke test
  here): the "gemv_rows" form, whose single row is MLX's own GEMV.

The choice depends on the layer's shape and dtypes and on this machine's kernels only, never
on the call's row count, so every row of a layer has one order at every width."""
from functools import lru_cache

from . import skinny

# Layers of at least this many weights (N * K) take the tensor-core kernel: an 8B model's
# every linear (k and v from 4 M), a small model's head. Below it a single row through the
# tensor-core kernel costs more than MLX's GEMV (one SmolLM2 stream ran at 0.64x its
# gemv_rows speed through it: bench/results/history/2026-12-01-h200-gemv-rows-issue9.md), and
# a small layer's wide rows cost little on CUDA cores.
MIN_ELEMENTS = 4 << 20


def takes(n: int, k: int, dtype, weight_dtype) -> bool:
    """Whether a layer of (N, K) weights of weight_dtype, x of dtype, is one the tensor-core
    kernel is for (its size and types; not whether it runs here)."""
    return n * k >= MIN_ELEMENTS and dtype == weight_dtype and dtype in skinny.MMA_DTYPES


@lru_cache(maxsize=4096)
def form_for(n: int, k: int, dtype, weight_dtype) -> str:
    """"skinny" where the layer's rows run the tensor-core kernel here, else "gemv_rows": once
    per layer shape (every canonical linear call asks; the kernel's verdict is per process)."""
    return "skinny" if takes(n, k, dtype, weight_dtype) and skinny.uses_mma(dtype) and skinny.available() \
        else "gemv_rows"
