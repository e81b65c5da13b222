"""Loads the batch-invariant skinny matmul (skinny_matmul.cu / skinny_mma.cu /
skinny_matmul.metal, beside this file) through MLX's public custom-kernel API and calls it:
on CUDA each instance compiled once per machine (compiled.py) and launched with
mx.fast.precompiled_cuda_kernel (else mx.fast.cuda_kernel), on Metal mx.fast.metal_kernel.

The CPU backend has no custom-kernel API: there `unavailable_reason()` says so and callers
keep today's canonical forms. On a GPU the kernels are compiled on first use and checked
once against MLX's own matmul (a smoke test for compile and index errors; the bitwise proof
of invariance is kernels/invariance/selftest.py's, on the loaded model).
"""
import math
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from . import compiled
from .loop_order import MAX_ROWS, columns_per_warp, launch_threads

SOURCE_DIR = Path(__file__).resolve().parent
SOURCE_FILES = {"cuda": "skinny_matmul.cu", "metal": "skinny_matmul.metal", "cuda_mma": "skinny_mma.cu"}
THREADS_PER_BLOCK = 128
FLOAT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
# On CUDA, 16-bit x runs the tensor-core kernel (skinny_mma.cu: each weight tile read once
# per block for all rows, MMAs instead of per-lane FMAs); float32 keeps skinny_matmul.cu.
MMA_DTYPES = (mx.bfloat16, mx.float16)
MMA_WARPS = 4  # per block (skinny_mma.cu WARPS)
MMA_COLUMNS = 8  # output columns per column tile
MMA_ROW_TILE = 16
MMA_ROW_GROUP = 8  # a lane feeds rows g, g + 8, ...: R8 = ceil(M / 8) groups
MMA_MIN_BLOCKS = 512  # keep about 4 blocks per SM (H200: 132) before a block takes more column tiles


MMA_MAX_TILES = 8  # row tiles x column tiles: the warps' partial sums fit 32 KB of shared memory


def mma_column_tiles(n: int, m: int = 1) -> int:
    """Column tiles per block (NT): more where N is wide, so each x load serves more columns,
    as many as the shared memory allows for m rows. Which block computes a column never
    changes the order of its sum, so NT may follow N and M."""
    row_tiles = -(-m // MMA_ROW_TILE)
    for tiles in (4, 2):
        if n // (MMA_COLUMNS * tiles) >= MMA_MIN_BLOCKS and row_tiles * tiles <= MMA_MAX_TILES:
            return tiles
    return 1
AFFINE_GROUPS = (32, 64, 128)


def backend() -> str | None:
    """"cuda" or "metal" when the default device is a GPU with a custom-kernel API, else None."""
    return _backend_of(mx.default_device().type == mx.gpu)


@lru_cache(maxsize=None)
def _backend_of(on_gpu: bool) -> str | None:
    if not on_gpu:
        return None
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return None


SHARED_CUDA_SOURCE = "fp_formats.cuh"  # float-format decoding both CUDA kernels use


def compact_source(text: str) -> str:
    """The source without `//` comments, indentation and blank lines. MLX rebuilds and
    hashes a custom kernel's whole source at every call (host time per launch), and the
    files are mostly comment; the sources hold no `//` inside string literals."""
    lines = (line.split("//", 1)[0].strip() for line in text.splitlines())
    return "\n".join(line for line in lines if line) + "\n"


@lru_cache(maxsize=None)
def source_text(which: str) -> str:
    text = (SOURCE_DIR / SOURCE_FILES[which]).read_text()
    if which.startswith("cuda"):
        text = (SOURCE_DIR / SHARED_CUDA_SOURCE).read_text() + text
    return compact_source(text)


# Kernel bodies: one call into the template in the source file. Metal only passes the
# thread-position attributes a body names, so the body names them.
_BODIES = {
    ("cuda", "dense"): "lockstep::skinny_dense<T, M, NC, K>(x, w, y, w_shape[0]);",
    ("cuda", "affine"): ("lockstep::skinny_quantized<T, M, NC, K, GROUP, 0>"
                         "(x, w, scales, nullptr, biases, y, w_shape[0]);"),
    ("cuda", "nvfp4"): ("lockstep::skinny_quantized<T, M, NC, K, 16, 1>"
                        "(x, w, nullptr, scales, nullptr, y, w_shape[0]);"),
    ("metal", "dense"): ("lockstep::skinny_dense<T, M, NC, K>(x, w, y, w_shape[0],"
                         " thread_position_in_grid.x, thread_index_in_simdgroup);"),
    ("metal", "affine"): ("lockstep::skinny_affine<T, M, NC, K, GROUP>(x, w, scales, biases, y, w_shape[0],"
                          " thread_position_in_grid.x, thread_index_in_simdgroup);"),
    ("metal", "nvfp4"): ("lockstep::skinny_nvfp4<T, M, NC, K>(x, w, scales, y, w_shape[0],"
                         " thread_position_in_grid.x, thread_index_in_simdgroup);"),
}
_MMA_BODIES = {
    "dense": "lockstep_mma::skinny_mma_dense<T, R8, NT>(x, w, y, x_shape[0], w_shape[0], x_shape[1]);",
    "affine": ("lockstep_mma::skinny_mma_quantized<T, R8, NT, GROUP, 0>"
               "(x, w, scales, nullptr, biases, y, x_shape[0], w_shape[0], x_shape[1]);"),
    "nvfp4": ("lockstep_mma::skinny_mma_quantized<T, R8, NT, 16, 1>"
              "(x, w, nullptr, scales, nullptr, y, x_shape[0], w_shape[0], x_shape[1]);"),
}
_INPUTS = {"dense": ["x", "w"], "affine": ["x", "w", "scales", "biases"], "nvfp4": ["x", "w", "scales"]}
# The precompiled wrappers (compiled.py): each input's type, and the int parameters after y
# with the shapes they stand for in the bodies.
_INPUT_TYPES = {"dense": ["T", "T"], "affine": ["T", "uint32_t", "T", "T"], "nvfp4": ["T", "uint32_t", "uint8_t"]}
_SCALARS = {"cuda": (("N", "w_shape[0]"),),
            "cuda_mma": (("M", "x_shape[0]"), ("N", "w_shape[0]"), ("K", "x_shape[1]"))}


@lru_cache(maxsize=None)
def _kernel(which: str, kind: str):
    name = f"lockstep_skinny_{kind}"
    if which == "cuda_mma":
        return mx.fast.cuda_kernel(name=f"lockstep_skinny_mma_{kind}", input_names=_INPUTS[kind],
                                   output_names=["y"], source=_MMA_BODIES[kind],
                                   header=source_text(which))
    if which == "cuda":
        return mx.fast.cuda_kernel(name=name, input_names=_INPUTS[kind], output_names=["y"],
                                   source=_BODIES[which, kind], header=source_text(which))
    return mx.fast.metal_kernel(name=name, input_names=_INPUTS[kind], output_names=["y"],
                                source=_BODIES[which, kind], header=source_text(which))


@lru_cache(maxsize=None)
def family(which: str, kind: str) -> compiled.Family:
    """The precompiled form of _kernel(which, kind), which "cuda" or "cuda_mma"."""
    body = _MMA_BODIES[kind] if which == "cuda_mma" else _BODIES[which, kind]
    name = f"lockstep_skinny_mma_{kind}" if which == "cuda_mma" else f"lockstep_skinny_{kind}"
    return compiled.Family(name, "skinny", source_text(which), body,
                           inputs=list(zip(_INPUTS[kind], _INPUT_TYPES[kind])), outputs=[("y", "T")],
                           scalars=_SCALARS[which])


def quantized_kind(mode: str, bits: int, group_size: int) -> str | None:
    """The kernel for this quantization, or None (such layers keep today's form)."""
    if mode == "affine" and bits == 4 and group_size in AFFINE_GROUPS:
        return "affine"
    if mode == "nvfp4" and bits == 4 and group_size == 16:
        return "nvfp4"
    return None


def uses_mma(dtype) -> bool:
    """True where x of this dtype runs the tensor-core kernel."""
    return backend() == "cuda" and dtype in MMA_DTYPES


def _variant(which: str, dtype) -> str:
    """The kernel a launch runs: "cuda_mma" for 16-bit x on CUDA, else `which`."""
    return "cuda_mma" if which == "cuda" and dtype in MMA_DTYPES else which


@lru_cache(maxsize=4096)
def _geometry(which: str, kind: str, m: int, n: int, k: int, group: int, dtype) -> dict:
    """Template values, grid, threadgroup and outputs of one launch shape."""
    group_arg = [("GROUP", group)] if kind == "affine" else []
    if _variant(which, dtype) == "cuda_mma":
        # R8 and NT only size registers and the grid; M, N, K are read at run time (few compiles).
        tiles = mma_column_tiles(n, m)
        blocks = -(-n // (MMA_COLUMNS * tiles))
        return dict(
            template=[("T", dtype), ("R8", -(-m // MMA_ROW_GROUP)), ("NT", tiles), *group_arg],
            grid=(blocks * 32 * MMA_WARPS, 1, 1),
            threadgroup=(32 * MMA_WARPS, 1, 1),
            output_shapes=[(m, n)],
            output_dtypes=[dtype],
        )
    cols = columns_per_warp(m)
    return dict(
        template=[("T", dtype), ("M", m), ("NC", cols), ("K", k), *group_arg],
        grid=(launch_threads(n, cols, THREADS_PER_BLOCK), 1, 1),
        threadgroup=(THREADS_PER_BLOCK, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[dtype],
    )


@lru_cache(maxsize=4096)
def _launch_plan(which: str, kind: str, m: int, n: int, k: int, group: int, dtype) -> tuple:
    """(kernel, keyword arguments but inputs) of one launch shape through MLX's JIT kernels
    (cuda_kernel / metal_kernel)."""
    return _kernel(_variant(which, dtype), kind), _geometry(which, kind, m, n, k, group, dtype)


@lru_cache(maxsize=4096)
def _launcher(which: str, kind: str, m: int, n: int, k: int, group: int, dtype) -> tuple:
    """(call, keyword arguments but inputs) of one launch shape, built once per shape: a
    decode step makes hundreds of these calls. CUDA: the precompiled instance where
    compiled.py can build it, else _launch_plan's."""
    if which != "cuda":
        return _launch_plan(which, kind, m, n, k, group, dtype)
    variant = _variant(which, dtype)
    scalars = dict(M=m, N=n, K=k) if variant == "cuda_mma" else dict(N=n)
    return compiled.launcher(family(variant, kind), _geometry(which, kind, m, n, k, group, dtype), scalars,
                             lambda: _launch_plan(which, kind, m, n, k, group, dtype))


@lru_cache(maxsize=4096)
def _traced(*shape):
    return compiled.traced_on(shape[0], *_launcher(*shape))


compiled.on_disable("skinny", _launcher.cache_clear)
compiled.on_disable("skinny", _traced.cache_clear)


def instances(kind: str, m: int, n: int, k: int, dtype, group: int = 0) -> list:
    """The (family, template) instance a CUDA launch of x (m, k) against an (n, k) weight of
    `kind` runs (compiled.precompile); group: the affine group size."""
    group = group if kind == "affine" else 0
    template = tuple(_geometry("cuda", kind, m, n, k, group, dtype)["template"])
    return [(family(_variant("cuda", dtype), kind), template)]


def _launch(kind: str, inputs: list, m: int, n: int, k: int, dtype, group: int = 0):
    return _traced(backend(), kind, m, n, k, group, dtype)(*inputs)[0]


def dense_serves(x: mx.array, weight: mx.array) -> bool:
    return (x.ndim == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in FLOAT_DTYPES
            and weight.dtype == x.dtype and weight.ndim == 2 and weight.shape[1] == x.shape[1])


def dense_matmul(x: mx.array, weight: mx.array) -> mx.array:
    """x (M, K) @ weight (N, K).T, M <= 64, in the kernels' fixed order."""
    if not dense_serves(x, weight):
        raise ValueError(f"skinny dense kernel cannot take x {x.shape} {x.dtype}, w {weight.shape} {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    return _launch("dense", [x, weight], m, n, k, x.dtype)


@lru_cache(maxsize=4096)
def dense_one_launch(lead: tuple, n: int, k: int, dtype):
    """The launch of an x (lead + (k,)) @ (n, k).T call giving lead + (n,), both of `dtype`,
    where the dense kernel runs here and takes the call, else None: the checks made once per
    call shape (a canonical pass of a 16-bit model makes this call at every linear). On CUDA
    traced, with no reshape nodes where the launch is precompiled (compiled.shaped_launch)."""
    which, m = backend(), math.prod(lead)
    if which is None or _availability(which) is not None or not (1 <= m <= MAX_ROWS and dtype in FLOAT_DTYPES):
        return None
    call, plan = _launcher(which, "dense", m, n, k, 0, dtype)
    if which != "cuda":
        return lambda x, w: [y.reshape(*lead, n) for y in call(inputs=[x.reshape(m, k), w], **plan)]
    return compiled.shaped_launch(call, plan, (m, k), [(*lead, n)])


compiled.on_disable("skinny", lambda: dense_one_launch.cache_clear())


def quantized_serves(x: mx.array, scales: mx.array, *, group_size: int, bits: int, mode: str) -> bool:
    kind = quantized_kind(mode, bits, group_size)
    if kind is None or x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.dtype not in FLOAT_DTYPES:
        return False
    return scales.dtype == (x.dtype if kind == "affine" else mx.uint8)


def quantized_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases, *,
                     group_size: int, bits: int, mode: str) -> mx.array:
    """mx.quantized_matmul(x, W, transpose=True) for affine 4-bit and nvfp4, M <= 64."""
    if not quantized_serves(x, scales, group_size=group_size, bits=bits, mode=mode):
        raise ValueError(f"skinny quantized kernel cannot take {mode} {bits}-bit g{group_size}, x {x.dtype}")
    kind = quantized_kind(mode, bits, group_size)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] * 32 // bits != k:
        raise ValueError(f"x has K = {k}, the weight {weight.shape[1] * 32 // bits}")
    if weight.dtype != mx.uint32 or (kind == "affine" and getattr(biases, "dtype", None) != x.dtype):
        # the kernels read them as uint32 / x's type (a precompiled kernel's types are fixed)
        raise ValueError(f"skinny quantized kernel cannot take a {weight.dtype} weight with {x.dtype} x")
    if kind == "affine":
        return _launch(kind, [x, weight, scales, biases], m, n, k, x.dtype, group=group_size)
    return _launch(kind, [x, weight, scales], m, n, k, x.dtype)


_SMOKE_DENSE = ((1, 33, 48), (5, 17, 100), (21, 40, 4128))  # (M, N, K)
_SMOKE_QUANTIZED = (("affine", 32, 96, mx.bfloat16), ("affine", 64, 128, mx.float16),  # (mode, group, K, x)
                    ("affine", 128, 256, mx.bfloat16), ("nvfp4", 16, 48, mx.bfloat16),
                    ("nvfp4", 16, 4112, mx.float16))


def _smoke_test() -> str | None:
    """Compile and run each kernel on small awkward shapes (K tail, 16-mod-32 dims, N not a
    multiple of the warp's columns) against MLX's own ops; None when all agree."""
    if backend() == "cuda":  # every instance below at once, concurrently (compiled.py)
        compiled.precompile([i for dtype in FLOAT_DTYPES for m, n, k in _SMOKE_DENSE
                             for i in instances("dense", m, n, k, dtype)]
                            + [i for mode, group, k, dtype in _SMOKE_QUANTIZED
                               for i in instances(mode, 3, 48, k, dtype, group)])
    key = mx.random.key(7)
    for dtype in FLOAT_DTYPES:
        for m, n, k in _SMOKE_DENSE:
            kx, kw, key = mx.random.split(key, 3)
            x = mx.random.normal((m, k), key=kx).astype(dtype)
            w = mx.random.normal((n, k), key=kw).astype(dtype)
            got, want = dense_matmul(x, w), x.astype(mx.float32) @ w.astype(mx.float32).T
            if not mx.allclose(got.astype(mx.float32), want, rtol=2e-2, atol=5e-2 * k**0.5).item():
                return f"dense {dtype} {m}x{n}x{k} disagrees with matmul"
    for mode, group, k, dtype in _SMOKE_QUANTIZED:
        kx, kw, key = mx.random.split(key, 3)
        x = mx.random.normal((3, k), key=kx).astype(dtype)
        wq, scales, *biases = mx.quantize(mx.random.normal((48, k), key=kw).astype(dtype),
                                          group, 4, mode=mode)
        b = biases[0] if biases else None
        kw_ = dict(group_size=group, bits=4, mode=mode)
        got = quantized_matmul(x, wq, scales, b, **kw_).astype(mx.float32)
        want = (x.astype(mx.float32) @ mx.dequantize(wq, scales, b, **kw_).astype(mx.float32).T)
        if not mx.allclose(got, want, rtol=2e-2, atol=5e-2 * k**0.5).item():
            return f"{mode} g{group} K={k} disagrees with dequantize + matmul"
    return None


@lru_cache(maxsize=None)
def _availability(which: str | None) -> str | None:
    if which is None:
        return f"no custom-kernel API on {mx.default_device()}"
    try:
        problem = compiled.smoke(f"skinny {which}", "skinny", _smoke_test, __file__, *compiled.SOURCES,
                                 SOURCE_DIR / SHARED_CUDA_SOURCE,
                                 *(SOURCE_DIR / name for name in SOURCE_FILES.values()))
    except Exception as e:  # a compile or launch failure: the kernels are not used
        return f"{which} kernels failed to build or run: {type(e).__name__}: {str(e)[:300]}"
    return f"{which} kernels: {problem}" if problem else None


def unavailable_reason() -> str | None:
    """None when the kernels compiled and passed the smoke test on the default device."""
    return _availability(backend())


def available() -> bool:
    return unavailable_reason() is None
