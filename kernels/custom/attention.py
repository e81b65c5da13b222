"""Loads the pooled decode/verification attention (pooled_attention.cu / .metal, beside this
file) through MLX's custom-kernel API, and the reference form used where there is no kernel.

    out = pooled_attention(queries, k_pool, v_pool, rows, scale)

queries (1, HQ, R, D) are the rows of a pass; k_pool / v_pool (HKV, S, D) hold every
request's keys (kernels/batching/kv_pool.py); `rows` says where each row's keys start in the pool and
how many it sees. On a GPU with the kernel all rows of all requests take one launch, in an
order fixed by each row's key count (the header of pooled_attention.cu); on CUDA each
instance is compiled once per machine (compiled.py) and launched precompiled. Elsewhere each row
attends its own key range through MLX's attention, one call per row (the per-query form the
self-tests prove on the CPU). Either way a row's result does not depend on the other rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial

import mlx.core as mx

from . import compiled
from .packed_kv import packed_kv
from .skinny import FLOAT_DTYPES, SOURCE_DIR, backend, compact_source

# pooled_attention.cu's ATT_WARPS: the best of 4/8/16 at most shapes measured
# (bench/results/history/2026-12-01-h200-attention-warps-host-cost-4bit-floor.md)
ATT_WARPS = 8
THREADS = 32 * ATT_WARPS
SOURCE_FILES = {"cuda": "pooled_attention.cu", "metal": "pooled_attention.metal"}

_BODIES = {
    "cuda": ("lockstep::pooled_attention<T, D>(q, k, v, row_base, row_len, scale, out,"
             " q_shape[0], q_shape[1], k_shape[0], k_shape[1]);"),
    "metal": ("threadgroup float q_s[D]; threadgroup float m_s[4]; threadgroup float l_s[4];"
              " threadgroup float acc_s[4 * D];\n"
              "lockstep::pooled_attention<T, D>(q, k, v, row_base, row_len, scale, out,"
              " q_shape[0], q_shape[1], k_shape[0], k_shape[1], threadgroup_position_in_grid.x,"
              " thread_position_in_threadgroup.x, simdgroup_index_in_threadgroup,"
              " thread_index_in_simdgroup, q_s, m_s, l_s, acc_s);"),
}
_INPUTS = ["q", "k", "v", "row_base", "row_len", "scale"]
# The precompiled wrapper (compiled.py): each input's type, and the int parameters after
# out with the shapes they stand for in the CUDA body.
_INPUT_TYPES = ["T", "T", "T", "int", "int", "float"]
_SCALARS = (("heads", "q_shape[0]"), ("rows", "q_shape[1]"), ("kv_heads", "k_shape[0]"), ("slots", "k_shape[1]"))


@dataclass
class PoolRows:
    """Where each row of a pass reads its keys: pool slot of its request's key 0, key count."""

    base: list[int]
    lens: list[int]
    _arrays: tuple | None = None

    def arrays(self) -> tuple[mx.array, mx.array]:
        if self._arrays is None:
            self._arrays = (mx.array(self.base, dtype=mx.int32), mx.array(self.lens, dtype=mx.int32))
        return self._arrays


@lru_cache(maxsize=None)
def _kernel(which: str):
    make = mx.fast.cuda_kernel if which == "cuda" else mx.fast.metal_kernel
    return make(name="lockstep_pooled_attention", input_names=_INPUTS, output_names=["out"],
                source=_BODIES[which], header=compact_source((SOURCE_DIR / SOURCE_FILES[which]).read_text()))


@lru_cache(maxsize=None)
def family() -> compiled.Family:
    return compiled.Family("lockstep_pooled_attention", "attention",
                           compact_source((SOURCE_DIR / SOURCE_FILES["cuda"]).read_text()), _BODIES["cuda"],
                           inputs=list(zip(_INPUTS, _INPUT_TYPES)), outputs=[("out", "T")], scalars=_SCALARS)


@lru_cache(maxsize=4096)
def _launcher(which: str, dtype, dim: int, heads: int, count: int, kv_heads: int, slots: int) -> tuple:
    """(call, keyword arguments but inputs) of one launch shape, built once per shape."""
    launch = dict(
        template=[("T", dtype), ("D", dim)],
        grid=(heads * count * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(heads, count, dim)],
        output_dtypes=[dtype],
    )
    if which != "cuda":
        return _kernel(which), launch
    return compiled.launcher(family(), launch, dict(heads=heads, rows=count, kv_heads=kv_heads, slots=slots),
                             lambda: (_kernel(which), launch))


@lru_cache(maxsize=4096)
def _traced(which: str, dtype, dim: int, heads: int, count: int, kv_heads: int, slots: int):
    """The launch of queries (1, HQ, R, D) giving (1, HQ, R, D): on CUDA compiled, with no view
    nodes around it where it is precompiled (compiled.shaped_launch); elsewhere the direct call."""
    call, launch = _launcher(which, dtype, dim, heads, count, kv_heads, slots)
    if which == "cuda":
        return compiled.shaped_launch(call, launch, (heads, count, dim), [(1, heads, count, dim)])
    return lambda q, *rest: [call(inputs=[q.squeeze(0), *rest], **launch)[0][None]]


@lru_cache(maxsize=64)
def scale_array(value: float) -> mx.array:
    """The softmax scale as the kernels read it (one float32), made once per value."""
    return mx.array([value], dtype=mx.float32)


compiled.on_disable("attention", _launcher.cache_clear)
compiled.on_disable("attention", _traced.cache_clear)


def instances(dtype, dim: int) -> list:
    """The (family, template) instance of this element type and head size (compiled.precompile)."""
    return [(family(), (("T", dtype), ("D", dim)))]


def kernel_takes(dtype, dim: int) -> bool:
    """Element types and head sizes the kernel is written for."""
    return dim % 32 == 0 and dim <= 256 and dtype in FLOAT_DTYPES


def pool_shapes_fit(queries: mx.array, k_pool: mx.array, takes) -> bool:
    """A pool kernel's shapes: one batch entry, a (dtype, head size) `takes` accepts, GQA."""
    _, heads, _, dim = queries.shape
    kv_heads, _, kdim = k_pool.shape
    return (queries.shape[0] == 1 and dim == kdim and takes(queries.dtype, dim)
            and heads % kv_heads == 0 and k_pool.dtype == queries.dtype)


def kernel_serves(queries: mx.array, k_pool: mx.array) -> bool:
    """The kernel's shapes: one batch entry, a head size it takes, GQA."""
    return pool_shapes_fit(queries, k_pool, kernel_takes)


def run_on_pool(traced, queries: mx.array, k_pool: mx.array, v_pool: mx.array, rows: PoolRows,
                scale: float) -> mx.array:
    """One launch of a pool attention kernel over all rows: `traced(dtype, dim, heads, rows,
    kv_heads, slots)` gives the launch of its shape; queries (1, HQ, R, D) -> (1, HQ, R, D)."""
    _, heads, count, dim = queries.shape
    base, lens = rows.arrays()
    run = traced(queries.dtype, dim, heads, count, k_pool.shape[0], k_pool.shape[1])
    return run(queries, k_pool, v_pool, base, lens, scale_array(float(scale)))[0]


def kernel_attention(queries: mx.array, k_pool: mx.array, v_pool: mx.array, rows: PoolRows,
                     scale: float) -> mx.array:
    """All rows in one launch (the GPU kernel); queries (1, HQ, R, D) -> (1, HQ, R, D)."""
    return run_on_pool(partial(_traced, backend()), queries, k_pool, v_pool, rows, scale)


def reference_attention(queries: mx.array, k_pool: mx.array, v_pool: mx.array, rows: PoolRows,
                        scale: float, *, sinks=None) -> mx.array:
    """Each row against exactly its own keys, one MLX attention call per row on packed copies
    (the per-query form of kernels/invariance/ops.py)."""
    outs = []
    for r, (start, length) in enumerate(zip(rows.base, rows.lens)):
        q = mx.contiguous(queries[:, :, r:r + 1])
        k = packed_kv(k_pool[None, :, start:start + length])
        v = packed_kv(v_pool[None, :, start:start + length])
        extra = {} if sinks is None else {"sinks": sinks}
        outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, **extra))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def pooled_attention(queries: mx.array, k_pool: mx.array, v_pool: mx.array, rows: PoolRows,
                     scale: float, *, sinks=None, use_kernel: bool = True) -> mx.array:
    """The kernel where it is available and takes these shapes, else the reference form."""
    if (use_kernel and sinks is None and kernel_serves(queries, k_pool)
            and kernel_unavailable_reason(queries.dtype, queries.shape[3]) is None):
        return kernel_attention(queries, k_pool, v_pool, rows, scale)
    return reference_attention(queries, k_pool, v_pool, rows, scale, sinks=sinks)


def smoke_inputs(dtype, dim: int, rows: int, slots: int, seed: int) -> tuple:
    """(queries (1, 6, rows, dim), key pool, value pool (2, slots, dim)) of a pool kernel's
    smoke test: random, three query heads a key head."""
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((1, 6, rows, dim), key=kq).astype(dtype),
            mx.random.normal((2, slots, dim), key=kk).astype(dtype),
            mx.random.normal((2, slots, dim), key=kv).astype(dtype))


def reference_problem(got: mx.array, queries: mx.array, k_pool: mx.array, v_pool: mx.array,
                      rows: PoolRows) -> str | None:
    """Where a kernel's output `got` for these inputs (scale dim ** -0.5) is not close to the
    reference form in float32, why."""
    dim = queries.shape[-1]
    got = got.astype(mx.float32)
    want = reference_attention(queries.astype(mx.float32), k_pool.astype(mx.float32), v_pool.astype(mx.float32),
                               rows, dim ** -0.5)
    if not mx.allclose(got, want, rtol=2e-2, atol=2e-2).item():
        return f"{queries.dtype} head size {dim} disagrees with the reference attention"
    return None


def _smoke_test(dtype, dim: int) -> str | None:
    """Compile and run the kernel for one element type and head size on awkward lengths
    (tile tails, one key) with grouped heads, against the reference form; None when they agree."""
    if backend() == "cuda":
        compiled.precompile(instances(dtype, dim))
    lens = [1, 31, 32, 33, 129, 7]
    base = [0, 5, 40, 80, 120, 260]
    q, kp, vp = smoke_inputs(dtype, dim, len(lens), 300, 11)
    rows = PoolRows(base, lens)
    return reference_problem(kernel_attention(q, kp, vp, rows, dim ** -0.5), q, kp, vp, rows)


@lru_cache(maxsize=None)
def _availability(which: str | None, dtype, dim: int) -> str | None:
    if which is None:
        return f"no custom-kernel API on {mx.default_device()}"
    try:
        problem = compiled.smoke(f"pooled_attention {which} {dtype} D{dim}", "attention",
                                 lambda: _smoke_test(dtype, dim), __file__, SOURCE_DIR / "skinny.py",
                                 *compiled.SOURCES, *(SOURCE_DIR / name for name in SOURCE_FILES.values()))
    except Exception as e:  # a compile or launch failure: the reference form is used
        return f"{which} pooled attention failed to build or run: {type(e).__name__}: {str(e)[:300]}"
    return f"{which} pooled attention: {problem}" if problem else None


def kernel_unavailable_reason(dtype=mx.float16, dim: int = 64) -> str | None:
    """None when the kernel for this element type and head size compiled and passed its
    smoke test on the default device (each combination is compiled and checked once, on
    first use: a model needs one)."""
    return _availability(backend(), dtype, dim)
