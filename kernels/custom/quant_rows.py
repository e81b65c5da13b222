"""What lockstep's two 4-bit row kernels in its own order share (qmv_split.py: K split across a
block on CUDA cores; qmv_mma.py: on tensor cores): the formats and arrays they take, how a
loader builds its source, the common part of their smoke tests (each row of a call against
the one-row call, closeness to x @ dequantized W) and the verdict kept per machine."""
from pathlib import Path

import mlx.core as mx

from . import compiled
from .qmv_rows import arrays_fit
from .skinny import SHARED_CUDA_SOURCE, backend, compact_source
from .smoke_cache import smoke_verdict

HERE = Path(__file__).resolve().parent
SHARED = HERE / SHARED_CUDA_SOURCE
VALUES = HERE / "quant_values.cuh"
SKINNY_LOADER = HERE / "skinny.py"  # compact_source
DTYPES = (mx.float16, mx.bfloat16)
FORMAT_CODES = {"affine": 0, "nvfp4": 1, "mxfp4": 2}
GROUPS = {"affine": (32, 64, 128), "nvfp4": (16,), "mxfp4": (32,)}


def takes(mode: str, bits: int, group_size: int) -> bool:
    return bits == 4 and group_size in GROUPS.get(mode, ())


def header(source: Path) -> str:
    """A kernel file with the float formats and quantized values it uses before it."""
    return compact_source(SHARED.read_text() + VALUES.read_text() + source.read_text())


def fits(m: int, k: int, mode: str, bits: int, group: int, dtype, weight_dtype, packed: int, scales_dtype,
         biases_dtype, *, max_rows: int, k_multiple: int) -> bool:
    """Whether a kernel taking up to max_rows rows and K in multiples of k_multiple takes an
    (m, k) call of an (n, packed) weight with these dtypes."""
    if not takes(mode, bits, group) or dtype not in DTYPES:
        return False
    if not 1 <= m <= max_rows or k % k_multiple or k % group:
        return False
    return arrays_fit(k, 4, mode, dtype, weight_dtype, packed, scales_dtype, biases_dtype)


def model_inputs(x, wq, scales, biases, mode: str, group: int, dtype):
    """x and the dequantized weight as NumPy float64 values of T, and T's name: what an order
    model takes."""
    import numpy as np

    from .qmv_order import dequantize

    name = str(dtype).rsplit(".", 1)[-1]

    def f64(a):
        return None if a is None else np.array(a.astype(mx.float32)) if a.dtype in DTYPES else np.array(a)

    w = dequantize(np.array(wq), f64(scales), f64(biases), mode=mode, bits=4, group_size=group, dtype=name)
    return f64(x), w, name


def smoke_rows(matmul, mode: str, dtype, shapes, seed: int, check=None) -> str | None:
    """Every row of each (M, N, K) call equals the one-row call bit for bit and is close to the
    product of x and the dequantized weight; `check(shape, x, wq, scales, biases, rows, group)`
    may add a problem of its own. None: all hold."""
    key = mx.random.key(seed)
    for group in GROUPS[mode]:
        for shape in shapes:
            m, n, k = shape
            kx, kw, key = mx.random.split(key, 3)
            x = mx.random.normal((m, k), key=kx).astype(dtype)
            wq, scales, *rest = mx.quantize(mx.random.normal((n, k), key=kw).astype(dtype), group, 4, mode=mode)
            biases = rest[0] if rest else None
            kw_ = dict(group_size=group, bits=4, mode=mode)
            block = matmul(x, wq, scales, biases, **kw_)
            alone = mx.concatenate([matmul(x[i : i + 1], wq, scales, biases, **kw_) for i in range(m)], axis=0)
            if not mx.array_equal(block, alone).item():
                return f"{mode} g{group} {dtype} {m}x{n}x{k}: rows differ from the one-row call"
            problem = check(shape, x, wq, scales, biases, block, group) if check is not None else None
            if problem is not None:
                return f"{mode} g{group} {dtype} {m}x{n}x{k}: {problem}"
            w = mx.dequantize(wq, scales, biases, group_size=group, bits=4, mode=mode).astype(mx.float32)
            exact = x.astype(mx.float32) @ w.T
            error = mx.max(mx.abs(block.astype(mx.float32) - exact)).item()
            bound = 0.05 * mx.max(mx.abs(exact)).item() + 1e-3
            if not error <= bound:
                return f"{mode} g{group} {dtype} {m}x{n}x{k}: off the dequantized product by {error:.4g}"
    return None


def verdict(kernel: str, mode: str, dtype, smoke, source: Path, loader: str) -> str | None:
    """None where `kernel`'s smoke test (`smoke()`, kept per machine for these sources) passed
    on this GPU for this format and dtype, else why not."""
    if backend() != "cuda":
        return f"{kernel} is a CUDA kernel; not on {mx.default_device()}"
    if mode not in FORMAT_CODES:
        return f"{kernel} has no {mode} kernel"
    if dtype not in DTYPES:
        return f"{kernel} takes float16 and bfloat16 x, not {dtype}"
    name = f"{kernel} {mode} {dtype} {compiled.mode(kernel)}"
    try:
        problem = smoke_verdict(name, smoke, source, SHARED, VALUES, loader, SKINNY_LOADER, __file__,
                                *compiled.SOURCES)
    except Exception as exc:  # a compile or launch failure: the kernel is not used
        problem = f"{type(exc).__name__}: {str(exc)[:300]}"
    return None if problem is None else f"{kernel}: {problem}"
