"""Loads qmv_split.cu (beside this file): rows of x times a 4-bit quantized weight (affine-4,
nvfp4, mxfp4; float16 and bfloat16 x) with K split across a block of 128 threads, lockstep's
own order (index model: qmv_split_order.py), built to read the weights nearer HBM speed than
MLX's quantized GEMV does. Each instance compiled once per machine (compiled.py) and launched
traced. CUDA only.

A row's bits depend only on its own x row, the weight and K, never on how many rows the call
has. Its smoke test checks that on this GPU (every row of 2..8-row calls against the one-row
call), that the rows are close to the dequantized product, and that one shape's rows are the
order model's bit for bit. Layers of at least MIN_ELEMENTS weights run their decode rows
through it where that passed (kernels/invariance/layers.py: plain calls of a few rows, and
every deterministic call whatever its width).
"""
import math
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from . import compiled
from .qmv_rows import INPUTS, SCALARS, arrays_fit, kind
from .skinny import SHARED_CUDA_SOURCE, backend, compact_source
from .smoke_cache import smoke_verdict

SOURCE = Path(__file__).resolve().parent / "qmv_split.cu"
SHARED = Path(__file__).resolve().parent / SHARED_CUDA_SOURCE
VALUES = Path(__file__).resolve().parent / "quant_values.cuh"  # shared with the other quantized GEMV
SKINNY_LOADER = Path(__file__).resolve().parent / "skinny.py"  # compact_source
DTYPES = (mx.float16, mx.bfloat16)
THREADS = 128
MAX_ROWS = 4 * 65535  # rows of MR = 4 a block row: the grid's y extent
# Layers of at least this many weights (N * K) read faster through this kernel than through
# MLX's quantized GEMV on the H200 (an 8B model's gate, up, down and head); smaller ones
# (q, k, v, o) slower (docs/BENCHMARKS.md, session 16).
MIN_ELEMENTS = 32 << 20
FORMAT_CODES = {"affine": 0, "nvfp4": 1, "mxfp4": 2}
GROUPS = {"affine": (32, 64, 128), "nvfp4": (16,), "mxfp4": (32,)}
_ARGS = "y, x_shape[0], w_shape[0], x_shape[1]);"
_BODIES = {
    "affine": "lockstep_qsplit::qmv_split<T, 0, GROUP, C, MR>(x, w, scales, nullptr, biases, " + _ARGS,
    "fp": "lockstep_qsplit::qmv_split<T, FMT, GROUP, C, MR>(x, w, nullptr, scales, nullptr, " + _ARGS,
}


def _header() -> str:
    return compact_source(SHARED.read_text() + VALUES.read_text() + SOURCE.read_text())


@lru_cache(maxsize=None)
def _kernel(kind: str):
    return mx.fast.cuda_kernel(name=f"lockstep_qmv_split_{kind}", input_names=[n for n, _ in INPUTS[kind]],
                               output_names=["y"], source=_BODIES[kind], header=_header())


@lru_cache(maxsize=None)
def family(kind: str) -> compiled.Family:
    return compiled.Family(f"lockstep_qmv_split_{kind}", "qmv_split", _header(), _BODIES[kind],
                           inputs=INPUTS[kind], outputs=[("y", "T")], scalars=SCALARS)


def takes(mode: str, bits: int, group_size: int) -> bool:
    return bits == 4 and group_size in GROUPS.get(mode, ())


def runs_here() -> bool:
    """Whether this backend has the kernel at all (its smoke test decides per format)."""
    return backend() == "cuda"


def pays(n: int, k: int) -> bool:
    """Whether a layer of (N, K) weights is large enough to be faster through this kernel."""
    return n * k >= MIN_ELEMENTS


def block_columns(n: int) -> int:
    """Outputs a block takes at a time (C): which block computes an output, never the order
    of its sum. Narrow layers take fewer, for enough blocks."""
    return 4 if n >= 4096 else 2


def block_rows(m: int) -> int:
    """Rows a block (MR): each weight load serves MR rows."""
    return min(m, 4)


# Blocks of a launch at most (each fills its code table once, then walks the column groups):
# as many as the H200's 132 multiprocessors hold at once (registers: 5 each at C = 4).
MAX_BLOCKS = 660


@lru_cache(maxsize=4096)
def _launch_plan(m: int, n: int, mode: str, group: int, dtype, columns: int | None = None,
                 blocks: int | None = None) -> dict:
    columns = columns or block_columns(n)
    rows = block_rows(m)
    template = [("T", dtype)]
    if mode != "affine":
        template.append(("FMT", FORMAT_CODES[mode]))
    template += [("GROUP", group), ("C", columns), ("MR", rows)]
    return dict(
        template=template,
        grid=(min(-(-n // columns), blocks or MAX_BLOCKS) * THREADS, -(-m // rows), 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[dtype],
    )


@lru_cache(maxsize=4096)
def _launcher(m: int, n: int, k: int, mode: str, group: int, dtype, columns: int | None = None,
              blocks: int | None = None) -> tuple:
    plan = _launch_plan(m, n, mode, group, dtype, columns, blocks)
    body = kind(mode)
    return compiled.launcher(family(body), plan, dict(M=m, N=n, K=k), lambda: (_kernel(body), plan))


@lru_cache(maxsize=4096)
def _traced(*shape):
    return compiled.traced(*_launcher(*shape))


compiled.on_disable("qmv_split", _launcher.cache_clear)
compiled.on_disable("qmv_split", _traced.cache_clear)


def instances(m: int, n: int, mode: str, group: int, dtype) -> list:
    """The (family, template) instance a launch runs (compiled.precompile)."""
    return [(family(kind(mode)), tuple(_launch_plan(m, n, mode, group, dtype)["template"]))]


def _takes(m: int, k: int, mode: str, bits: int, group: int, dtype, weight_dtype, packed: int, scales_dtype,
           biases_dtype) -> bool:
    if not takes(mode, bits, group) or dtype not in DTYPES:
        return False
    if not 1 <= m <= MAX_ROWS or k % 32 or k % group:
        return False
    return arrays_fit(k, 4, mode, dtype, weight_dtype, packed, scales_dtype, biases_dtype)


def serves(x: mx.array, weight: mx.array, scales: mx.array, biases, *, group_size: int, bits: int,
           mode: str) -> bool:
    return (x.ndim == 2 and weight.ndim == 2
            and _takes(*x.shape, mode, bits, group_size, x.dtype, weight.dtype, weight.shape[1], scales.dtype,
                       getattr(biases, "dtype", None)))


def matmul(x, weight, scales, biases, *, group_size: int, bits: int, mode: str, columns: int | None = None,
           blocks: int | None = None) -> mx.array:
    """mx.quantized_matmul(x, weight, transpose=True) in this kernel's order (columns,
    blocks: launch shape for benchmarks; they change no bits)."""
    if not serves(x, weight, scales, biases, group_size=group_size, bits=bits, mode=mode):
        raise ValueError(f"qmv_split cannot take {mode} {bits}-bit g{group_size}, x {x.shape} {x.dtype}")
    m, k = x.shape
    launch = _traced(m, weight.shape[0], k, mode, group_size, x.dtype, columns, blocks)
    return (launch(x, weight, scales, biases) if mode == "affine" else launch(x, weight, scales))[0]


@lru_cache(maxsize=4096)
def launch_for(lead: tuple, n: int, k: int, mode: str, bits: int, group: int, dtype, weight_dtype, packed: int,
               scales_dtype, biases_dtype):
    """The traced launch of a call of x (lead + (k,)) giving lead + (n,), where the kernel
    passed its smoke test here for this quantization and dtype and takes the arrays, else
    None. Its reshapes are traced with the launch: a layer's call costs one compiled call on
    the host. Call it with x, the weight and the scales (affine: and the biases)."""
    m = math.prod(lead)
    if not _takes(m, k, mode, bits, group, dtype, weight_dtype, packed, scales_dtype, biases_dtype):
        return None
    if unavailable_reason(mode, dtype) is not None:
        return None
    call, plan = _launcher(m, n, k, mode, group, dtype, None, None)
    return mx.compile(lambda x, *weights: call(inputs=[x.reshape(m, k), *weights], **plan)[0].reshape(*lead, n))


compiled.on_disable("qmv_split", lambda: launch_for.cache_clear())


# (M, N, K), K a multiple of every group size: 36 chunks (fewer than the block's threads),
# 132 chunks (threads 0..3 take a second one), N a partial last block, odd M.
SMOKE_SHAPES = ((2, 33, 1152), (5, 70, 4224), (8, 9, 4096), (3, 1030, 512))


def _model_agrees(x, wq, scales, biases, got, mode: str, group: int, dtype) -> bool:
    """Whether the kernel's rows are the NumPy order model's, bit for bit."""
    import numpy as np

    from .qmv_order import dequantize
    from .qmv_split_order import qmv_split

    name = str(dtype).rsplit(".", 1)[-1]

    def f64(a):
        return None if a is None else np.array(a.astype(mx.float32)) if a.dtype in DTYPES else np.array(a)

    w = dequantize(np.array(wq), f64(scales), f64(biases), mode=mode, bits=4, group_size=group, dtype=name)
    want = qmv_split(f64(x), w, dtype=name)
    return bool(np.array_equal(want, np.array(got.astype(mx.float32)).astype(np.float64)))


def _smoke_test(mode: str, dtype) -> str | None:
    """Every row of 2..8-row calls equals the one-row call bit for bit and is close to the
    product of x and the dequantized weight; the first shape's rows are the order model's,
    bit for bit. None: all hold."""
    compiled.precompile(i for group in GROUPS[mode] for m, n, _ in SMOKE_SHAPES
                        for rows in {m, 1} for i in instances(rows, n, mode, group, dtype))
    key = mx.random.key(17)
    for group in GROUPS[mode]:
        for m, n, k in SMOKE_SHAPES:
            kx, kw, key = mx.random.split(key, 3)
            x = mx.random.normal((m, k), key=kx).astype(dtype)
            wq, scales, *rest = mx.quantize(mx.random.normal((n, k), key=kw).astype(dtype), group, 4, mode=mode)
            biases = rest[0] if rest else None
            kw_ = dict(group_size=group, bits=4, mode=mode)
            block = matmul(x, wq, scales, biases, **kw_)
            alone = mx.concatenate([matmul(x[i : i + 1], wq, scales, biases, **kw_) for i in range(m)], axis=0)
            if not mx.array_equal(block, alone).item():
                return f"{mode} g{group} {dtype} {m}x{n}x{k}: rows differ from the one-row call"
            if (m, n, k) == SMOKE_SHAPES[0] and not _model_agrees(x, wq, scales, biases, block, mode, group, dtype):
                return f"{mode} g{group} {dtype} {m}x{n}x{k}: rows differ from the order model (qmv_split_order.py)"
            w = mx.dequantize(wq, scales, biases, group_size=group, bits=4, mode=mode).astype(mx.float32)
            exact = x.astype(mx.float32) @ w.T
            error = mx.max(mx.abs(block.astype(mx.float32) - exact)).item()
            bound = 0.05 * mx.max(mx.abs(exact)).item() + 1e-3
            if not error <= bound:
                return f"{mode} g{group} {dtype} {m}x{n}x{k}: off the dequantized product by {error:.4g}"
    return None


@lru_cache(maxsize=None)
def unavailable_reason(mode: str = "nvfp4", dtype=mx.bfloat16) -> str | None:
    """None where the kernel passed its smoke test on this GPU for this format and dtype."""
    if backend() != "cuda":
        return f"qmv_split is a CUDA kernel; not on {mx.default_device()}"
    if mode not in FORMAT_CODES:
        return f"qmv_split has no {mode} kernel"
    if dtype not in DTYPES:
        return f"qmv_split takes float16 and bfloat16 x, not {dtype}"
    name = f"qmv_split {mode} {dtype} {compiled.mode('qmv_split')}"
    try:
        problem = smoke_verdict(name, lambda: _smoke_test(mode, dtype), SOURCE, SHARED, VALUES, __file__, SKINNY_LOADER,
                                *compiled.SOURCES)
    except Exception as exc:  # a compile or launch failure: the kernel is not used
        problem = f"{type(exc).__name__}: {str(exc)[:300]}"
    return None if problem is None else f"qmv_split: {problem}"
