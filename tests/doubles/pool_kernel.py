"""A stand-in for the KV pool's attention kernel on the CPU.

The CPU has no custom-kernel API, so the pool attends by its reference form there, which
slices the pool by Python ints and cannot be traced (kernels/batching/compiled_pass.py).
Inside `pool_kernel_double()` the pool's kernel path (`kernel_attention`) is this: every
row against exactly its own keys, from the same (base, count) arrays the kernel reads, in
MLX ops on the whole pool (a mask, then a float32 softmax), by elementwise products and sums
rather than matmuls, so a row's bits never depend on the pass's other rows (also under
tests/doubles/shape_variant.py). Close to the reference form, not bitwise; uncompiled and
compiled passes both go through it, so those two can be compared bit for bit.
"""
from contextlib import contextmanager

import mlx.core as mx


def masked_attention(queries: mx.array, k_pool: mx.array, v_pool: mx.array, rows, scale: float) -> mx.array:
    """queries (1, HQ, R, D), pools (HKV, S, D) -> (1, HQ, R, D); row r reads slots
    base[r] .. base[r] + lens[r]."""
    base, lens = rows.arrays()
    heads, kv_heads, slots = queries.shape[1], k_pool.shape[0], k_pool.shape[1]
    keys = mx.repeat(k_pool, heads // kv_heads, axis=0)
    values = mx.repeat(v_pool, heads // kv_heads, axis=0)
    scores = (queries[0][:, :, None, :] * keys[:, None]).astype(mx.float32).sum(-1) * scale  # (HQ, R, S)
    at = mx.arange(slots)[None]
    own = (at >= base[:, None]) & (at < (base + lens)[:, None])
    weights = mx.softmax(mx.where(own[None], scores, -mx.inf), axis=-1).astype(queries.dtype)
    return (weights[..., None] * values[:, None]).sum(-2)[None]


@contextmanager
def pool_kernel_double():
    """The pool's kernel path is `masked_attention` for the enclosed calls."""
    from lockstep.kernels.custom import attention

    saved = attention.kernel_attention, attention.kernel_unavailable_reason, attention.kernel_serves
    attention.kernel_attention = masked_attention
    attention.kernel_unavailable_reason = lambda *args, **kwargs: None
    attention.kernel_serves = lambda queries, k_pool: queries.shape[0] == 1 and k_pool.dtype == queries.dtype
    try:
        yield
    finally:
        attention.kernel_attention, attention.kernel_unavailable_reason, attention.kernel_serves = saved
