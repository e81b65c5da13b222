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

from . import compiled, quant_rows
from .qmv_rows import INPUTS, SCALARS, kind
from .quant_rows import FORMAT_CODES, GROUPS, takes  # noqa: F401 (takes: part of this API)
from .skinny import backend

SOURCE = Path(__file__).resolve().parent / "qmv_split.cu"
THREADS = 128
MAX_ROWS = 4 * 65535  # rows of MR = 4 a block row: the grid's y extent
# Layers of at least this many weights (N * K) read faster through this kernel than through
# MLX's quantized GEMV on the H200 (an 8B model's gate, up, down and head); smaller ones
# (q, k, v, o) slower (bench/results/history/2026-12-02-h200-node-cost-qmv-split-issue28.md).
MIN_ELEMENTS = 32 << 20
_ARGS = "y, x_shape[0], w_shape[0], x_shape[1]);"
_BODIES = {
    "affine": "lockstep_qsplit::qmv_split<T, 0, GROUP, C, MR>(x, w, scales, nullptr, biases, " + _ARGS,
    "fp": "lockstep_qsplit::qmv_split<T, FMT, GROUP, C, MR>(x, w, nullptr, scales, nullptr, " + _ARGS,
}


def _header() -> str:
    return quant_rows.header(SOURCE)


@lru_cache(maxsize=None)
def _kernel(kind: str):
    return mx.fast.cuda_kernel(name=f"lockstep_qmv_split_{kind}", input_names=[n for n, _ in INPUTS[kind]],
                               output_names=["y"], source=_BODIES[kind], header=_header())


@lru_cache(maxsize=None)
def family(kind: str) -> compiled.Family:
    return compiled.Family(f"lockstep_qmv_split_{kind}", "qmv_split", _header(), _BODIES[kind],
                           inputs=INPUTS[kind], outputs=[("y", "T")], scalars=SCALARS)


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


# Blocks of a launch at most (each, for e2m1 codes, fills its code table once, then walks the
# column groups):
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
    return quant_rows.fits(m, k, mode, bits, group, dtype, weight_dtype, packed, scales_dtype, biases_dtype,
                           max_rows=MAX_ROWS, k_multiple=32)


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
    None. A layer's call costs one compiled call on the host, and no reshape nodes where the
    launch is precompiled (compiled.shaped_launch). Call it with x, the weight and the scales
    (affine: and the biases)."""
    m = math.prod(lead)
    if not _takes(m, k, mode, bits, group, dtype, weight_dtype, packed, scales_dtype, biases_dtype):
        return None
    if unavailable_reason(mode, dtype) is not None:
        return None
    call, plan = _launcher(m, n, k, mode, group, dtype, None, None)
    launch = compiled.shaped_launch(call, plan, (m, k), [(*lead, n)])
    return lambda x, *weights: launch(x, *weights)[0]


compiled.on_disable("qmv_split", lambda: launch_for.cache_clear())


# (M, N, K), K a multiple of every group size: 36 chunks (fewer than the block's threads),
# 132 chunks (threads 0..3 take a second one), N a partial last block, odd M.
SMOKE_SHAPES = ((2, 33, 1152), (5, 70, 4224), (8, 9, 4096), (3, 1030, 512))


def _model_agrees(x, wq, scales, biases, got, mode: str, group: int, dtype) -> bool:
    """Whether the kernel's rows are the NumPy order model's, bit for bit."""
    import numpy as np

    from .qmv_split_order import qmv_split

    x64, w, name = quant_rows.model_inputs(x, wq, scales, biases, mode, group, dtype)
    return bool(np.array_equal(qmv_split(x64, w, dtype=name), np.array(got.astype(mx.float32)).astype(np.float64)))


def _smoke_test(mode: str, dtype) -> str | None:
    """Every row of 2..8-row calls equals the one-row call bit for bit and is close to the
    product of x and the dequantized weight; the first shape's rows are the order model's,
    bit for bit. None: all hold."""
    compiled.precompile(i for group in GROUPS[mode] for m, n, _ in SMOKE_SHAPES
                        for rows in {m, 1} for i in instances(rows, n, mode, group, dtype))

    def check(shape, x, wq, scales, biases, block, group):
        if shape == SMOKE_SHAPES[0] and not _model_agrees(x, wq, scales, biases, block, mode, group, dtype):
            return "rows differ from the order model (qmv_split_order.py)"
        return None

    return quant_rows.smoke_rows(matmul, mode, dtype, SMOKE_SHAPES, 17, check)


@lru_cache(maxsize=None)
def unavailable_reason(mode: str = "nvfp4", dtype=mx.bfloat16) -> str | None:
    """None where the kernel passed its smoke test on this GPU for this format and dtype."""
    return quant_rows.verdict("qmv_split", mode, dtype, lambda: _smoke_test(mode, dtype), SOURCE, __file__)
