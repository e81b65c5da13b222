"""Attention for all query rows of a pass in a few calls whose bits do not depend on how many
rows there are, for the CPU strategy `cpu_kernel` (attention form "composed").

Per-query attention (one MLX attention call per row) spends a CPU step's time in per-op
overhead (
bench/results/history/2026-11-30-cpu-kernel-issue13.md).
Here the rows share each call, and every
reduction runs as a matmul that the shim's invariant kernel takes (M = the pass's rows <= L;
kernels/cpu_blas/invariant_gemm.c), whose order depends on K alone:
- scores = (q * scale) @ kᵀ per head: K = head size, the same for any row count;
- a row's keys past its own position are masked to -inf, so its max is exact and its
  exp weights there are exact zeros;
- weights @ [v | 1] gives the weighted sum and the softmax denominator in one matmul over
  the keys, padded with zero weights to a multiple of 8 keys, the kernel's lanes: a row
  then differs from the same row alone only by zero weights appended to each lane's chain
  (fma(+0, v, acc) == acc for the finite v padded in), and the kernel's K tail is always
  empty. [v | 1] is padded with ones to a multiple of 8 columns in the same op, so every
  column runs in the kernel's vector blocks (a column's bits depend on K alone).
Decode (one row) runs the same code, so a row gives the same bits alone and in a block.
GQA folds a key head's query heads into the rows of one matmul where group x rows fits
under the kernel's limit (the kernel's rows never depend on M: the bits of repeated keys,
without copying them per query head), else repeats the key/value heads. The self-test
proves the whole on the running machine, as for every form.
"""
import mlx.core as mx

from .. import cpu_blas

LANES = 8  # the invariant kernel's K lanes, and its vector block of N columns


def composed_serves(mask, sinks) -> bool:
    """The form takes causal or no masks and no attention sinks; others keep per-query."""
    return sinks is None and (mask is None or isinstance(mask, str) and mask == "causal")


def composed_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """queries (B, H, T, D): the last T positions of keys/values (B, Hkv, S, D)."""
    b, heads, t, d = queries.shape
    kv_heads, s = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    padded = -(-s // LANES) * LANES
    # column d: the denominator; padded keys (weight +0) and the unread columns hold ones
    columns = -(-(d + 1) // LANES) * LANES
    values = mx.pad(values, [(0, 0), (0, 0), (0, padded - s), (0, columns - d)], constant_values=1)
    q = queries * scale
    fold = group * t <= cpu_blas.kernel_limit()  # else the folded rows would leave the kernel
    if fold:
        q = q.reshape(b, kv_heads, group * t, d)  # rows (query head of the group, position)
    elif group > 1:
        keys = mx.repeat(keys, group, axis=1)
        values = mx.repeat(values, group, axis=1)
    scores = q @ keys.swapaxes(-1, -2)  # (B, Hkv, group x T, S) folded, else (B, H, T, S)
    if t > 1:  # a row sees keys up to its own position (one row sees them all)
        visible = mx.arange(s)[None, :] <= mx.arange(s - t, s)[:, None]
        if fold and group > 1:
            visible = mx.tile(visible, (group, 1))
        scores = mx.where(visible, scores, mx.array(-float("inf"), dtype=scores.dtype))
    weights = mx.exp(scores - scores.max(axis=-1, keepdims=True))
    if padded > s:  # zero weights for the keys that round S up to the kernel's lanes
        weights = mx.pad(weights, [(0, 0), (0, 0), (0, 0), (0, padded - s)])
    summed = weights @ values
    out = summed[..., :d] / summed[..., d:d + 1]
    if fold:
        out = out.reshape(b, heads, t, d)
    return out if out.dtype == queries.dtype else out.astype(queries.dtype)
