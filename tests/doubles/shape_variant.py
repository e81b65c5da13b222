"""A shape-variant backend test double for the CPU.

MLX's CPU backend gives a row the same bits however many rows share the call, so on CPU
alone a batch-invariance test could never fail. Inside `shape_variant_backend()` the ops a
model runs change their reduction order when a call has more than one row, the way the CUDA
backend does (GEMM vs GEMV, split-K, SDPA split counts), while a single-row call stays
native:

- dense matmul (`@`, mx.matmul, mx.addmm): with M > 1 rows, the K reduction is split in two
  halves computed separately and added. M counts every leading row when the right operand
  is a 2-D weight (MLX folds those into one GEMM) and only the second-to-last dimension
  when it is batched (a batched GEMV stays per row);
- mx.quantized_matmul: the same split at a quantization-group boundary from
  `quantized_rows` rows up (CUDA keeps its per-row kernel below 8 rows);
- mx.fast.scaled_dot_product_attention: with more than one query, the probability-weighted
  sum over keys is split in two halves (flash-decoding style);
- mx.gather_mm / mx.gather_qmm (MoE experts): with more than one token row in the call (the
  rows a backend may group per expert, sorted or not), the K reduction is split in two, for
  gather_qmm at a quantization-group boundary. A one-row call (decode: one token against its
  k experts) stays native. `gather="sorted"` models a backend like CUDA instead: a batch
  element of one row, unsorted, keeps its bits in a call of any size (a per-element GEMV),
  while a sorted call (tiled kernels grouping rows per expert) or an element of several rows
  splits; `gather_elements=n` (with "sorted") also splits every call of more than n batch
  elements (a kernel chosen by the batch's size).

These are the narrowest points both mlx-lm's own modules and kernels/invariance/ops.py go
through. Results stay close to native (tests can check outputs are sane), just not bitwise.
"""
import math
from contextlib import contextmanager

import mlx.core as mx
import numpy as np


def _dense_rows(a: mx.array, b: mx.array) -> int:
    if a.ndim < 2:
        return 1
    if b.ndim <= 2:
        m = 1
        for d in a.shape[:-1]:
            m *= d
        return m
    return a.shape[-2]


@contextmanager
def shape_variant_backend(quantized_rows: int = 8, dense_rows: int = 1, gather: str = "rows",
                          gather_elements: int | None = None):
    """Within this context, calls with several rows reduce in a different order: dense calls
    of more than `dense_rows` rows (1: every multi-row call; more: a backend whose rows also
    change between a narrow and a wide GEMM), quantized calls from `quantized_rows` rows,
    gather calls as `gather` says ("rows": every call of several token rows; "sorted": sorted
    calls, elements of several rows and, given `gather_elements`, calls of more elements)."""
    if gather not in ("rows", "sorted"):
        raise ValueError(f"gather {gather!r}: 'rows' or 'sorted'")
    native_matmul = mx.matmul
    native_dunder = mx.array.__matmul__
    native_addmm = mx.addmm
    native_qmm = mx.quantized_matmul
    native_sdpa = mx.fast.scaled_dot_product_attention
    native_gather_mm = mx.gather_mm
    native_gather_qmm = mx.gather_qmm

    def split_k_matmul(a, b):
        k = a.shape[-1]
        if _dense_rows(a, b) <= dense_rows or k < 2 or b.ndim < 2:
            return native_matmul(a, b)
        h = k // 2
        return native_matmul(a[..., :h], b[..., :h, :]) + native_matmul(a[..., h:], b[..., h:, :])

    def matmul(a, b, **kwargs):
        return split_k_matmul(a, b) if not kwargs else native_matmul(a, b, **kwargs)

    def dunder(a, b):
        return split_k_matmul(a, b) if isinstance(b, mx.array) else native_dunder(a, b)

    def addmm(c, a, b, alpha=1.0, beta=1.0, **kwargs):
        if _dense_rows(a, b) <= dense_rows or kwargs:
            return native_addmm(c, a, b, alpha=alpha, beta=beta, **kwargs)
        return beta * c + alpha * split_k_matmul(a, b)

    def quantized_matmul(x, w, scales, biases=None, transpose=True, group_size=None,
                         bits=None, mode="affine", **kwargs):
        def native(xx, ww, ss, bb):
            return native_qmm(xx, ww, scales=ss, biases=bb, transpose=transpose,
                              group_size=group_size, bits=bits, mode=mode, **kwargs)

        rows = x.shape[-2] if x.ndim >= 2 else 1
        k = x.shape[-1]
        h = (k // 2) // group_size * group_size if group_size else 0
        if rows < quantized_rows or not transpose or h == 0 or (h * bits) % 32:
            return native(x, w, scales, biases)
        wc, sc = h * bits // 32, h // group_size
        low = native(x[..., :h], w[..., :wc], scales[..., :sc],
                     None if biases is None else biases[..., :sc])
        high = native(x[..., h:], w[..., wc:], scales[..., sc:],
                      None if biases is None else biases[..., sc:])
        return low + high

    def sdpa(q, k, v, *, scale, mask=None, sinks=None, **kwargs):
        t, s = q.shape[2], k.shape[2]
        if t <= 1 or sinks is not None or kwargs or s < 2:
            return native_sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)
        b, heads, _, d = q.shape
        kv_heads = k.shape[1]
        qg = (q * scale).reshape(b, kv_heads, heads // kv_heads, t, d)
        kg, vg = k[:, :, None], v[:, :, None]
        scores = native_matmul(qg, kg.swapaxes(-1, -2)).astype(mx.float32)
        if isinstance(mask, str):  # "causal", aligned to the last query
            mask = mx.arange(s - t, s)[:, None] >= mx.arange(s)[None]
        if mask is not None:
            if mask.ndim == 4:
                mask = mx.expand_dims(mask, 2)
            if mask.dtype == mx.bool_:
                scores = mx.where(mask, scores, mx.finfo(mx.float32).min)
            else:
                scores = scores + mask
        p = mx.softmax(scores, axis=-1, precise=True).astype(v.dtype)
        h = s // 2
        out = native_matmul(p[..., :h], vg[..., :h, :]) + native_matmul(p[..., h:], vg[..., h:, :])
        return out.reshape(b, heads, t, -1)

    def gather_splits(x, lhs_indices, rhs_indices, sorted_indices=False) -> bool:
        if gather == "rows":
            return x.size // max(x.shape[-1], 1) > 1
        lhs = x.shape[:-2] if lhs_indices is None else lhs_indices.shape
        batches = [lhs] + ([] if rhs_indices is None else [rhs_indices.shape])
        elements = math.prod(np.broadcast_shapes(*batches))
        return (sorted_indices or (x.ndim >= 2 and x.shape[-2] > 1)
                or (gather_elements is not None and elements > gather_elements))

    def gather_mm(a, b, lhs_indices=None, rhs_indices=None, **kwargs):
        k = a.shape[-1]
        if not gather_splits(a, lhs_indices, rhs_indices, kwargs.get("sorted_indices", False)) or k < 2:
            return native_gather_mm(a, b, lhs_indices, rhs_indices, **kwargs)
        h = k // 2
        return (native_gather_mm(a[..., :h], b[..., :h, :], lhs_indices, rhs_indices, **kwargs)
                + native_gather_mm(a[..., h:], b[..., h:, :], lhs_indices, rhs_indices, **kwargs))

    def gather_qmm(x, w, scales, biases=None, lhs_indices=None, rhs_indices=None, transpose=True,
                   group_size=None, bits=None, mode="affine", global_scale=None, **kwargs):
        def native(xx, ww, ss, bb):
            return native_gather_qmm(xx, ww, ss, bb, lhs_indices, rhs_indices, transpose=transpose,
                                     group_size=group_size, bits=bits, mode=mode,
                                     global_scale=global_scale, **kwargs)

        k = x.shape[-1]
        h = (k // 2) // group_size * group_size if group_size else 0
        splits = gather_splits(x, lhs_indices, rhs_indices, kwargs.get("sorted_indices", False))
        if not splits or not transpose or h == 0 or (h * bits) % 32:
            return native(x, w, scales, biases)
        wc, sc = h * bits // 32, h // group_size
        low = native(x[..., :h], w[..., :wc], scales[..., :sc], None if biases is None else biases[..., :sc])
        high = native(x[..., h:], w[..., wc:], scales[..., sc:], None if biases is None else biases[..., sc:])
        return low + high

    mx.matmul, mx.array.__matmul__, mx.addmm = matmul, dunder, addmm
    mx.quantized_matmul, mx.fast.scaled_dot_product_attention = quantized_matmul, sdpa
    mx.gather_mm, mx.gather_qmm = gather_mm, gather_qmm
    try:
        yield
    finally:
        mx.matmul, mx.array.__matmul__, mx.addmm = native_matmul, native_dunder, native_addmm
        mx.quantized_matmul, mx.fast.scaled_dot_product_attention = native_qmm, native_sdpa
        mx.gather_mm, mx.gather_qmm = native_gather_mm, native_gather_qmm
