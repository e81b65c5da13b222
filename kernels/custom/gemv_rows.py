"""Loads gemv_rows.cu (beside this file): dense rows in the order of MLX's own single-row
GEMV, with the weights read once per group of rows: each instance compiled once per machine
(compiled.py) and launched with mx.fast.precompiled_cuda_kernel, else through mx.fast.cuda_kernel.

Decode (M = 1) keeps MLX's plain call; a block of 2..64 rows runs this kernel, whose rows
carry the single-row call's bits because they follow its reduction order (index model:
gemv_order.py). That order is MLX's, not ours, so the kernel is used only after its smoke
test found every row equal to the plain call, bit for bit, on this GPU; the startup
self-test then proves the model. CUDA only (Metal's GEMV has another order; CPU has no
custom-kernel API).
"""
import math
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from . import compiled
from .gemv_order import MAX_ROWS, lanes_per_step, warp_shape
from .skinny import backend, compact_source

SOURCE = Path(__file__).resolve().parent / "gemv_rows.cu"
SKINNY_LOADER = Path(__file__).resolve().parent / "skinny.py"  # compact_source
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
WARPS_PER_BLOCK = 4
_BODY = "lockstep_gemv::gemv_rows<T, NPT, R, MR>(x, w, y, x_shape[0], w_shape[0], x_shape[1]);"
# The precompiled wrapper's int parameters after y, and the shapes they stand for in _BODY.
_SCALARS = (("M", "x_shape[0]"), ("N", "w_shape[0]"), ("K", "x_shape[1]"))


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(name="lockstep_gemv_rows", input_names=["x", "w"], output_names=["y"],
                               source=_BODY, header=compact_source(SOURCE.read_text()))


@lru_cache(maxsize=None)
def family() -> compiled.Family:
    return compiled.Family("lockstep_gemv_rows", "gemv_rows", compact_source(SOURCE.read_text()), _BODY,
                           inputs=[("x", "T"), ("w", "T")], outputs=[("y", "T")], scalars=_SCALARS)


@lru_cache(maxsize=4096)
def _launch_plan(m: int, n: int, k: int, dtype, shape: tuple | None) -> dict:
    columns, rows = shape or warp_shape(m, n)
    warps = -(-n // columns)
    blocks = -(-warps // WARPS_PER_BLOCK)
    return dict(
        template=[("T", dtype), ("NPT", lanes_per_step(k)), ("R", columns), ("MR", rows)],
        grid=(blocks * 32 * WARPS_PER_BLOCK, -(-m // rows), 1),
        threadgroup=(32 * WARPS_PER_BLOCK, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[dtype],
    )


@lru_cache(maxsize=4096)
def _launcher(m: int, n: int, k: int, dtype, shape: tuple | None) -> tuple:
    """(call, keyword arguments but inputs) of one launch shape, built once per shape."""
    plan = _launch_plan(m, n, k, dtype, shape)
    return compiled.launcher(family(), plan, dict(M=m, N=n, K=k), lambda: (_kernel(), plan))


@lru_cache(maxsize=4096)
def _traced(m: int, n: int, k: int, dtype, shape: tuple | None):
    return compiled.traced(*_launcher(m, n, k, dtype, shape))


compiled.on_disable("gemv_rows", _launcher.cache_clear)
compiled.on_disable("gemv_rows", _traced.cache_clear)
compiled.on_disable("gemv_rows", lambda: one_launch.cache_clear())


def instances(m: int, n: int, k: int, dtype, shape: tuple | None = None) -> list:
    """The (family, template) instance a launch of x (m, k), w (n, k) runs (compiled.precompile)."""
    return [(family(), tuple(_launch_plan(m, n, k, dtype, shape)["template"]))]


def _takes(m: int, dtype) -> bool:
    """The rows and element type the kernel has instances for."""
    return 1 <= m <= MAX_ROWS and dtype in DTYPES


def serves(x: mx.array, weight: mx.array) -> bool:
    return (x.ndim == 2 and weight.ndim == 2 and weight.dtype == x.dtype and weight.shape[1] == x.shape[1]
            and _takes(x.shape[0], x.dtype))


def matmul(x: mx.array, weight: mx.array, shape: tuple | None = None) -> mx.array:
    """x (M, K) @ weight (N, K).T, every row as MLX's single-row GEMV computes it.
    shape: (columns, rows) per warp, for benchmarks; default warp_shape(M, N)."""
    if not serves(x, weight):
        raise ValueError(f"gemv_rows cannot take x {x.shape} {x.dtype}, w {weight.shape} {weight.dtype}")
    return _launch(x, weight, shape)


def try_matmul(x: mx.array, weight: mx.array):
    """matmul(x, weight) where the kernel is proven here and takes these arrays, else None."""
    if not serves(x, weight):
        return None
    launch = one_launch(x.shape[:1], weight.shape[0], x.shape[1], x.dtype)
    return None if launch is None else launch(x, weight)[0]


@lru_cache(maxsize=4096)
def one_launch(lead: tuple, n: int, k: int, dtype):
    """The traced launch of an x (lead + (k,)) @ (n, k).T call giving lead + (n,), both of
    `dtype`, where the kernel is proven here and takes it, else None: try_matmul's decision,
    made once per call shape (a canonical pass makes it for every linear, and each check costs
    host time; compiled.shaped_launch: no reshape nodes where the launch is precompiled)."""
    m = math.prod(lead)
    if unavailable_reason() is not None or not _takes(m, dtype):
        return None
    call, plan = _launcher(m, n, k, dtype, None)
    return compiled.shaped_launch(call, plan, (m, k), [(*lead, n)])


def _launch(x: mx.array, weight: mx.array, shape: tuple | None) -> mx.array:
    m, k = x.shape
    return _traced(m, weight.shape[0], k, x.dtype, shape)(x, weight)[0]


# (M, N, K): K picks the lanes' step (4, 2 or 1 elements: K % 128, K % 64, else), N a
# partial last warp, M a partial last row group.
SMOKE_SHAPES = ((2, 33, 256), (5, 70, 192), (11, 9, 100), (3, 1030, 4096))


def _smoke_test() -> str | None:
    """Every row of the kernel against MLX's own single-row call, bit for bit; None: equal."""
    compiled.precompile(i for dtype in DTYPES for m, n, k in SMOKE_SHAPES for i in instances(m, n, k, dtype))
    key = mx.random.key(11)
    for dtype in DTYPES:
        for m, n, k in SMOKE_SHAPES:
            kx, kw, key = mx.random.split(key, 3)
            x = mx.random.normal((m, k), key=kx).astype(dtype)
            w = mx.random.normal((n, k), key=kw).astype(dtype)
            block = matmul(x, w)
            alone = mx.concatenate([x[i : i + 1] @ w.T for i in range(m)], axis=0)
            if not mx.array_equal(block, alone).item():
                return f"{dtype} {m}x{n}x{k}: rows differ from MLX's single-row GEMV"
    return None


@lru_cache(maxsize=None)
def _availability(which: str | None) -> str | None:
    if which != "cuda":
        return f"gemv_rows follows MLX's CUDA GEMV; not on {mx.default_device()}"
    try:
        problem = compiled.smoke("gemv_rows", "gemv_rows", _smoke_test, SOURCE, __file__, SKINNY_LOADER,
                                 *compiled.SOURCES)
    except Exception as e:  # a compile or launch failure: the kernel is not used
        return f"gemv_rows failed to build or run: {type(e).__name__}: {str(e)[:300]}"
    return f"gemv_rows: {problem}" if problem else None


def unavailable_reason() -> str | None:
    """None when the kernel compiled and matched MLX's single-row GEMV on this GPU."""
    return _availability(backend())
