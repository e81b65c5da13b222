"""Attention for all query rows of a pass in a few calls whose bits do not depend on how many
rows there are, for the CPU strategy `cpu_kernel` (attention form "composed").

Per-query attention (one MLX attention call per row) spends a CPU step's time in per-op
overhead (docs/BENCHMARKS.md, the CPU kernel). Here the rows share each call, and every
reduction runs as a matmul that the shim's invariant kernel takes (M = the pass's rows <= L;
kernels/cpu_blas/invariant_gemm.c), whose order depends on K alone:
- scores = (q * scale) @ kᵀ per head: K = head size, the same for any row count;
- a row's keys past its own position are masked to -inf, so its max is exact and its
  exp weights there are exact zeros;
- weights @ [v | 1] gives the weighted sum and the softmax denominator in one matmul over
  the keys, padded with zero weights (and zero values) to a multiple of 8 keys, the
  kernel's lanes: a row then differs from the same row alone only by zero weights appended
  to each lane's chain (fma(0, v, acc) == acc), and the kernel's K tail is always empty.
Decode (one row) runs the same code, so a row gives the same bits alone and in a block.
GQA repeats the key/value heads instead of folding query heads into rows, which would make
M = heads x rows. The self-test proves the whole on the running machine, as for every form.
"""
import mlx.core as mx

LANES = 8  # the invariant kernel's K lanes


def composed_serves(mask, sinks) -> bool:
    """The form takes causal or no masks and no attention sinks; others keep per-query."""
    return sinks is None and (mask is None or isinstance(mask, str) and mask == "causal")


def composed_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """queries (B, H, T, D): the last T positions of keys/values (B, Hkv, S, D)."""
    b, heads, t, d = queries.shape
    kv_heads, s = keys.shape[1], keys.shape[2]
    padded = -(-s // LANES) * LANES
    ones = mx.ones((b, kv_heads, s, 1), dtype=values.dtype)
    values = mx.concatenate([values, ones], axis=-1)  # last column: the denominator
    if padded > s:
        values = mx.pad(values, [(0, 0), (0, 0), (0, padded - s), (0, 0)])
    if heads != kv_heads:
        keys = mx.repeat(keys, heads // kv_heads, axis=1)
        values = mx.repeat(values, heads // kv_heads, axis=1)
    scores = (queries * scale) @ keys.swapaxes(-1, -2)  # (B, H, T, S)
    if t > 1:  # a row sees keys up to its own position (one row sees them all)
        visible = mx.arange(s)[None, :] <= mx.arange(s - t, s)[:, None]
        scores = mx.where(visible, scores, mx.array(-float("inf"), dtype=scores.dtype))
    weights = mx.exp(scores - scores.max(axis=-1, keepdims=True))
    if padded > s:  # zero weights for the zero keys that round S up to the kernel's lanes
        weights = mx.pad(weights, [(0, 0), (0, 0), (0, 0), (0, padded - s)])
    summed = weights @ values  # (B, H, T, D + 1)
    return (summed[..., :d] / summed[..., d:]).astype(queries.dtype)
