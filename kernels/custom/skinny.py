"""Loads the batch-invariant skinny matmul (skinny_matmul.cu / skinny_matmul.metal, beside
this file) through MLX's public custom-kernel API and calls it.

The CPU backend has no custom-kernel API: there `unavailable_reason()` says so and callers
keep today's canonical forms. On a GPU the kernels are compiled on first use and checked
once against MLX's own matmul (a smoke test for compile and index errors; the bitwise proof
of invariance is kernels/selftest.py's, on the loaded model).
"""
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from .loop_order import MAX_ROWS, columns_per_warp, launch_threads

SOURCE_DIR = Path(__file__).resolve().parent
SOURCE_FILES = {"cuda": "skinny_matmul.cu", "metal": "skinny_matmul.metal"}
THREADS_PER_BLOCK = 128
FLOAT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
AFFINE_GROUPS = (32, 64, 128)


def backend() -> str | None:
    """"cuda" or "metal" when the default device is a GPU with a custom-kernel API, else None."""
    if mx.default_device().type != mx.gpu:
        return None
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return None


def source_text(which: str) -> str:
    return (SOURCE_DIR / SOURCE_FILES[which]).read_text()


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
_INPUTS = {"dense": ["x", "w"], "affine": ["x", "w", "scales", "biases"], "nvfp4": ["x", "w", "scales"]}


@lru_cache(maxsize=None)
def _kernel(which: str, kind: str):
    name = f"lockstep_skinny_{kind}"
    if which == "cuda":
        return mx.fast.cuda_kernel(name=name, input_names=_INPUTS[kind], output_names=["y"],
                                   source=_BODIES[which, kind], header=source_text(which))
    return mx.fast.metal_kernel(name=name, input_names=_INPUTS[kind], output_names=["y"],
                                source=_BODIES[which, kind], header=source_text(which))


def quantized_kind(mode: str, bits: int, group_size: int) -> str | None:
    """The kernel for this quantization, or None (such layers keep today's form)."""
    if mode == "affine" and bits == 4 and group_size in AFFINE_GROUPS:
        return "affine"
    if mode == "nvfp4" and bits == 4 and group_size == 16:
        return "nvfp4"
    return None


def _launch(kind: str, inputs: list, template: list, m: int, n: int, dtype):
    which = backend()
    cols = columns_per_warp(m)
    return _kernel(which, kind)(
        inputs=inputs,
        template=[("T", dtype), ("M", m), ("NC", cols), *template],
        grid=(launch_threads(n, cols, THREADS_PER_BLOCK), 1, 1),
        threadgroup=(THREADS_PER_BLOCK, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[dtype],
    )[0]


def dense_serves(x: mx.array, weight: mx.array) -> bool:
    return (x.ndim == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in FLOAT_DTYPES
            and weight.dtype == x.dtype and weight.ndim == 2 and weight.shape[1] == x.shape[1])


def dense_matmul(x: mx.array, weight: mx.array) -> mx.array:
    """x (M, K) @ weight (N, K).T, M <= 64, in the kernels' fixed order."""
    if not dense_serves(x, weight):
        raise ValueError(f"skinny dense kernel cannot take x {x.shape} {x.dtype}, w {weight.shape} {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    return _launch("dense", [x, weight], [("K", k)], m, n, x.dtype)


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
    if kind == "affine":
        return _launch(kind, [x, weight, scales, biases], [("K", k), ("GROUP", group_size)],
                       m, n, x.dtype)
    return _launch(kind, [x, weight, scales], [("K", k)], m, n, x.dtype)


def _smoke_test() -> str | None:
    """Compile and run each kernel on small awkward shapes (K tail, 16-mod-32 dims, N not a
    multiple of the warp's columns) against MLX's own ops; None when all agree."""
    key = mx.random.key(7)
    for dtype in FLOAT_DTYPES:
        for m, n, k in ((1, 33, 48), (5, 17, 100)):
            kx, kw, key = mx.random.split(key, 3)
            x = mx.random.normal((m, k), key=kx).astype(dtype)
            w = mx.random.normal((n, k), key=kw).astype(dtype)
            got, want = dense_matmul(x, w), x.astype(mx.float32) @ w.astype(mx.float32).T
            if not mx.allclose(got.astype(mx.float32), want, rtol=2e-2, atol=5e-2 * k**0.5).item():
                return f"dense {dtype} {m}x{n}x{k} disagrees with matmul"
    for mode, group, k in (("affine", 32, 96), ("affine", 64, 128), ("affine", 128, 256), ("nvfp4", 16, 48)):
        kx, kw, key = mx.random.split(key, 3)
        x = mx.random.normal((3, k), key=kx).astype(mx.bfloat16)
        wq, scales, *biases = mx.quantize(mx.random.normal((48, k), key=kw).astype(mx.bfloat16),
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
        problem = _smoke_test()
    except Exception as e:  # a compile or launch failure: the kernels are not used
        return f"{which} kernels failed to build or run: {type(e).__name__}: {str(e)[:300]}"
    return f"{which} kernels: {problem}" if problem else None


def unavailable_reason() -> str | None:
    """None when the kernels compiled and passed the smoke test on the default device."""
    return _availability(backend())


def available() -> bool:
    return unavailable_reason() is None
