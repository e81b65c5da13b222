"""Keys and values as the canonical attention calls take them: a row-packed copy, and on CUDA
a key count that is a multiple of 256 handed over inside a longer buffer. Used by the
per-query attention form (kernels/invariance/ops.py) and the pool's reference attention
(attention.py), so it lives below both.
"""
import mlx.core as mx

from .. import custom

# MLX's CUDA attention hands one query to cuDNN instead of its vector kernel when the key
# buffer's row count (read from the strides) is a multiple of 256, mlx-lm's cache step, and
# the keys are still in flight with a buffer of exactly their size: allocator and timing
# state, not the row's. The two kernels round differently, so a row with exactly 256 keys
# gave other bits from one run to the next (docs/DETERMINISM.md). Such keys are handed over as a view of a
# buffer one row longer, which only the vector kernel takes (its order depends on the key
# count alone).
KV_CACHE_STEP = 256


def packed_kv(x: mx.array) -> mx.array:
    """x (B, H, S, D) as a row-packed copy the canonical attention calls use; on CUDA, for
    S a multiple of 256, a view of S rows of an (S + 1)-row buffer (see KV_CACHE_STEP)."""
    if x.shape[2] % KV_CACHE_STEP == 0 and custom.backend() == "cuda":
        return mx.pad(x, [(0, 0), (0, 0), (0, 1), (0, 0)])[:, :, : x.shape[2]]
    return mx.contiguous(x)
