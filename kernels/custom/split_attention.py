"""Loads the plain passes' pool attention (split_attention.cu, beside this file) through MLX's
CUDA custom-kernel API.

    out = kernel_attention(queries, k_pool, v_pool, rows, scale)   # as attention.kernel_attention

The pooled attention (attention.py) keeps one order on CUDA and Metal, which the self-tests
prove for deterministic rows; at one row it runs a block of 8 warps per head, each lane a key's
whole dot product. A plain pass promises no bits, so it may take this kernel instead: a
(head, row)'s keys over 16 warps at once, each key read by contiguous lanes (the header of
split_attention.cu; its order's NumPy model is split_attention_order.py). CUDA only: on
Metal and the CPU plain passes keep the pooled attention or its reference form.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from . import compiled
from .attention import PoolRows, pool_shapes_fit, reference_problem, run_on_pool, smoke_inputs
from .skinny import FLOAT_DTYPES, SOURCE_DIR, backend, compact_source

WARPS = 16  # split_attention.cu's SPLIT_WARPS
THREADS = 32 * WARPS
SOURCE_FILE = "split_attention.cu"

_BODY = ("lockstep::split_attention<T, D, HG>(q, k, v, row_base, row_len, scale, out,"
         " q_shape[0], q_shape[1], k_shape[0], k_shape[1]);")
_INPUTS = ["q", "k", "v", "row_base", "row_len", "scale"]
_INPUT_TYPES = ["T", "T", "T", "int", "int", "float"]
_SCALARS = (("heads", "q_shape[0]"), ("rows", "q_shape[1]"), ("kv_heads", "k_shape[0]"), ("slots", "k_shape[1]"))


def _header() -> str:
    return compact_source((SOURCE_DIR / SOURCE_FILE).read_text())


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(name="lockstep_split_attention", input_names=_INPUTS, output_names=["out"],
                               source=_BODY, header=_header())


@lru_cache(maxsize=None)
def family() -> compiled.Family:
    # 512 threads a block: unbounded, NVRTC gave the float32 instances more registers than such a
    # block may hold, and their launch failed (docs/DESIGN.md, Kernels)
    return compiled.Family("lockstep_split_attention", "attention", _header(), _BODY,
                           inputs=list(zip(_INPUTS, _INPUT_TYPES)), outputs=[("out", "T")], scalars=_SCALARS,
                           threads=THREADS)


# Rows a launch needs before a block takes two query heads of a KV head (HG 2), each key and
# value loaded once for both; with fewer rows blocks of one head ran faster, and four a block
# spill registers (docs/BENCHMARKS.md, Kernels).
PAIRED_HEADS_FROM_ROWS = 32


def heads_a_block(dtype, dim: int, group: int, rows: int) -> int:
    """Query heads of one KV head a block takes (HG; group: query heads a KV head has, rows:
    the launch's). Never the order: each head's work is its own."""
    if rows >= PAIRED_HEADS_FROM_ROWS and dtype != mx.float32 and dim <= 128 and group % 2 == 0:
        return 2
    return 1


def launch_plan(dtype, dim: int, heads: int, count: int, kv_heads: int, per_block: int | None = None) -> dict:
    """A launch's template, grid and block: a block a (group of HG query heads, row)
    (per_block: HG, for benchmarks; it changes no bits)."""
    hg = per_block or heads_a_block(dtype, dim, heads // kv_heads, count)
    return dict(
        template=[("T", dtype), ("D", dim), ("HG", hg)],
        grid=(heads // hg * count * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(heads, count, dim)],
        output_dtypes=[dtype],
    )


@lru_cache(maxsize=4096)
def _launcher(dtype, dim: int, heads: int, count: int, kv_heads: int, slots: int, per_block: int | None = None) -> tuple:
    """(call, keyword arguments but inputs) of one launch shape, built once per shape."""
    launch = launch_plan(dtype, dim, heads, count, kv_heads, per_block)
    return compiled.launcher(family(), launch, dict(heads=heads, rows=count, kv_heads=kv_heads, slots=slots),
                             lambda: (_kernel(), launch))


@lru_cache(maxsize=4096)
def _traced(dtype, dim: int, heads: int, count: int, kv_heads: int, slots: int, per_block: int | None = None):
    """The launch of queries (1, HQ, R, D) giving (1, HQ, R, D), no view nodes around it where
    it is precompiled (compiled.shaped_launch)."""
    call, launch = _launcher(dtype, dim, heads, count, kv_heads, slots, per_block)
    return compiled.shaped_launch(call, launch, (heads, count, dim), [(1, heads, count, dim)])


compiled.on_disable("attention", _launcher.cache_clear)
compiled.on_disable("attention", _traced.cache_clear)


def instances(dtype, dim: int, group: int | None = None) -> list:
    """The (family, template) instances of this element type and head size (compiled.precompile),
    at any rows: for query heads a KV head has (group), else for a group of two."""
    counts = {1, heads_a_block(dtype, dim, group or 2, PAIRED_HEADS_FROM_ROWS)}
    return [(family(), (("T", dtype), ("D", dim), ("HG", hg))) for hg in sorted(counts)]


def kernel_takes(dtype, dim: int) -> bool:
    """Element types and head sizes the kernel is written for: a key of 64, 128, 256 or 512
    bytes (16 bytes a lane; a warp's lanes hold whole keys)."""
    return dtype in FLOAT_DTYPES and dim * dtype.size in (64, 128, 256, 512)


def kernel_serves(queries: mx.array, k_pool: mx.array) -> bool:
    """The kernel's shapes: one batch entry, a head size it takes, GQA."""
    return pool_shapes_fit(queries, k_pool, kernel_takes)


def kernel_attention(queries: mx.array, k_pool: mx.array, v_pool: mx.array, rows: PoolRows,
                     scale: float, per_block: int | None = None) -> mx.array:
    """All rows in one launch; queries (1, HQ, R, D) -> (1, HQ, R, D) (per_block: query heads a
    block, else heads_a_block's)."""
    return run_on_pool(lambda *shape: _traced(*shape, per_block), queries, k_pool, v_pool, rows, scale)


def _smoke_test(dtype, dim: int) -> str | None:
    """Compile and run the kernel for one element type and head size on awkward lengths (pass
    tails, one key, several passes a warp) with grouped heads, against the reference form, a
    row alone against the same row beside others, and blocks of one query head against blocks
    of several; None when all agree."""
    compiled.precompile(instances(dtype, dim, 3))  # smoke_inputs: three query heads a KV head
    lens = [1, 15, 16, 17, 300, 1100]
    base = [0, 5, 40, 80, 400, 900]
    q, kp, vp = smoke_inputs(dtype, dim, len(lens), 2100, 12)
    rows = PoolRows(base, lens)
    got = kernel_attention(q, kp, vp, rows, dim ** -0.5)
    problem = reference_problem(got, q, kp, vp, rows)
    if problem:
        return problem
    beside = got[:, :, 4:5]
    alone = kernel_attention(q[:, :, 4:5], kp, vp, PoolRows(base[4:5], lens[4:5]), dim ** -0.5)
    if not mx.array_equal(alone, beside).item():
        return f"{dtype} head size {dim}: a row alone differs from the same row beside others"
    if heads_a_block(dtype, dim, 2, PAIRED_HEADS_FROM_ROWS) == 2:
        q2 = mx.concatenate([q, q[:, :2]], axis=1)  # four query heads a KV head
        compiled.precompile(instances(dtype, dim, 2))
        paired = kernel_attention(q2, kp, vp, rows, dim ** -0.5, per_block=2)
        if not mx.array_equal(kernel_attention(q2, kp, vp, rows, dim ** -0.5, per_block=1), paired).item():
            return f"{dtype} head size {dim}: blocks of two query heads differ from blocks of one"
    return None


@lru_cache(maxsize=None)
def _availability(which: str | None, dtype, dim: int) -> str | None:
    if which != "cuda":
        return f"the split attention kernel is CUDA's (here: {which or mx.default_device()})"
    if not kernel_takes(dtype, dim):
        return f"head size {dim} ({dtype}): the split kernel takes keys of 64, 128, 256 or 512 bytes"
    try:
        problem = compiled.smoke(f"split_attention {dtype} D{dim}", "attention",
                                 lambda: _smoke_test(dtype, dim), __file__, SOURCE_DIR / "skinny.py",
                                 SOURCE_DIR / "attention.py", *compiled.SOURCES, SOURCE_DIR / SOURCE_FILE)
    except Exception as e:  # a compile or launch failure: plain passes keep the pooled kernel
        return f"split attention failed to build or run: {type(e).__name__}: {str(e)[:300]}"
    return f"split attention: {problem}" if problem else None


def kernel_unavailable_reason(dtype=mx.float16, dim: int = 64) -> str | None:
    """None when the kernel for this element type and head size compiled and passed its smoke
    test on the default device (checked once per combination, on first use)."""
    return _availability(backend(), dtype, dim)
