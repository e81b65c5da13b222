"""Loads qmv_rows.cu (beside this file): quantized rows in the order of MLX's own quantized
GEMV (affine 4/8-bit, nvfp4, mxfp4, mxfp8; float16 and bfloat16 x), the weights read and
dequantized once per group of rows: each instance compiled once per machine (compiled.py)
and launched with mx.fast.precompiled_cuda_kernel, else through mx.fast.cuda_kernel.

Decode (M = 1) keeps MLX's plain quantized_matmul; a block of 2..64 rows runs this kernel,
whose rows carry the single-row call's bits because they follow its order (index model:
qmv_order.py). That order is MLX's build's, not ours: whether its affine dequantization
rounds once or twice is found by the smoke test, which compares every row with the plain
call bit for bit on this GPU; the startup self-test then proves the model. CUDA only.
"""
import math
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from . import compiled
from .gemv_order import MAX_ROWS
from .qmv_order import elems_per_thread, weight_bits
from .skinny import SHARED_CUDA_SOURCE, backend, compact_source
from .smoke_cache import smoke_verdict

SOURCE = Path(__file__).resolve().parent / "qmv_rows.cu"
SHARED = Path(__file__).resolve().parent / SHARED_CUDA_SOURCE
VALUES = Path(__file__).resolve().parent / "quant_values.cuh"  # shared with the other quantized GEMV
SKINNY_LOADER = Path(__file__).resolve().parent / "skinny.py"  # compact_source
DTYPES = (mx.float16, mx.bfloat16)
WARPS_PER_BLOCK = 8  # as MLX's rows_per_block
AFFINE_BITS = (4, 8)
AFFINE_GROUPS = (32, 64, 128)
FORMAT_CODES = {"affine": 0, "nvfp4": 1, "mxfp4": 2, "mxfp8": 3}
FP_GROUPS = {"nvfp4": 16, "mxfp4": 32, "mxfp8": 32}
_ARGS = "y, x_shape[0], w_shape[0], x_shape[1]);"
_BODIES = {
    "affine": "lockstep_qmv::qmv_rows<T, 0, BITS, GROUP, FUSED, R, MR, TILES>(x, w, scales, nullptr, biases, " + _ARGS,
    "fp": "lockstep_qmv::qmv_rows<T, FMT, BITS, GROUP, 0, R, MR, TILES>(x, w, nullptr, scales, nullptr, " + _ARGS,
}
# Both quantized GEMV kernels take these arrays and shapes (qmv_split.py too).
INPUTS = {"affine": [("x", "T"), ("w", "uint32_t"), ("scales", "T"), ("biases", "T")],
           "fp": [("x", "T"), ("w", "uint32_t"), ("scales", "uint8_t")]}
SCALARS = (("M", "x_shape[0]"), ("N", "w_shape[0]"), ("K", "x_shape[1]"))


def kind(mode: str) -> str:
    """Which of the two kernel bodies a mode runs: affine (scales and biases of T) or fp."""
    return "affine" if mode == "affine" else "fp"


def _header() -> str:
    return compact_source(SHARED.read_text() + VALUES.read_text() + SOURCE.read_text())


@lru_cache(maxsize=None)
def _kernel(kind: str):
    return mx.fast.cuda_kernel(name=f"lockstep_qmv_rows_{kind}", input_names=[n for n, _ in INPUTS[kind]],
                               output_names=["y"], source=_BODIES[kind], header=_header())


@lru_cache(maxsize=None)
def family(kind: str) -> compiled.Family:
    return compiled.Family(f"lockstep_qmv_rows_{kind}", "qmv_rows", _header(), _BODIES[kind],
                           inputs=INPUTS[kind], outputs=[("y", "T")], scalars=SCALARS)


def takes(mode: str, bits: int, group_size: int) -> bool:
    """Whether the kernel has this quantization (others keep row chunks of MLX's call)."""
    if mode == "affine":
        return bits in AFFINE_BITS and group_size in AFFINE_GROUPS
    return FP_GROUPS.get(mode) == group_size


def warp_rows(m: int) -> int:
    """Rows per warp (MR): each weight load and dequantization serves MR rows; more rows
    per warp cost registers, so fewer warps in flight (4 measured best at 8 and 16 rows on
    the H200:
    bench/results/history/2026-12-01-h200-4bit-decode-qmv-rows-issue28.md).
    Never changes a row's order."""
    return 2 if m <= 2 else 4


def warp_columns(n: int, mode: str = "nvfp4", bits: int = 4) -> int:
    """Output columns per warp (R): each x load serves R columns (x is read once per
    column group, not once per column); narrow layers keep one column a warp for enough
    warps in flight. 8-bit weights hold twice the registers a column: at 4 columns they
    spill, and one column a warp ran faster at every 8B linear of affine-8 and at mxfp8's
    up to 8,192 columns. Measured at the 8B shapes on the H200 (4-bit:
    bench/results/history/2026-12-01-h200-4bit-decode-qmv-rows-issue28.md; 8-bit:
    bench/results/cuda/qmv_rows_warp_shapes_8bit_h200_2026-12-06.md). Never changes a
    row's order (each column's sum is its own)."""
    if weight_bits(mode, bits) == 8:
        return 4 if mode == "mxfp8" and n > 8192 else 1
    return 4 if n >= 4096 else 1


# The most full tiles a warp loads before computing them (bytes in flight).
MAX_TILES_AHEAD = 8


def tiles_ahead(k: int, w_bits: int) -> int:
    """Full tiles a warp loads before computing them (TILES): up to MAX_TILES_AHEAD, never more
    than K holds (each is one more unrolled copy of a tile's code in the cubin; a SmolLM2
    layer's K of 576 holds one). Never changes an order, and a launch of K's count loads what
    one of 8 would."""
    return min(MAX_TILES_AHEAD, max(1, k // (32 * elems_per_thread(16, w_bits))))


@lru_cache(maxsize=4096)
def _launch_plan(m: int, n: int, k: int, mode: str, bits: int, group: int, fused: int, dtype, rows: int | None = None,
                 columns: int | None = None) -> dict:
    rows = rows or warp_rows(m)
    columns = columns or warp_columns(n, mode, bits)
    template = [("T", dtype)]
    if mode != "affine":
        template.append(("FMT", FORMAT_CODES[mode]))
    w_bits = weight_bits(mode, bits)
    template += [("BITS", w_bits), ("GROUP", group)]
    if mode == "affine":
        template.append(("FUSED", fused))
    template += [("R", columns), ("MR", rows), ("TILES", tiles_ahead(k, w_bits))]
    warps = -(-n // columns)
    return dict(
        template=template,
        grid=(-(-warps // WARPS_PER_BLOCK) * 32 * WARPS_PER_BLOCK, -(-m // rows), 1),
        threadgroup=(32 * WARPS_PER_BLOCK, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[dtype],
    )


@lru_cache(maxsize=4096)
def _launcher(m: int, n: int, k: int, mode: str, bits: int, group: int, fused: int, dtype,
              rows: int | None = None, columns: int | None = None) -> tuple:
    """(call, keyword arguments but inputs) of one launch shape, built once per shape."""
    plan = _launch_plan(m, n, k, mode, bits, group, fused, dtype, rows, columns)
    body = kind(mode)
    return compiled.launcher(family(body), plan, dict(M=m, N=n, K=k), lambda: (_kernel(body), plan))


@lru_cache(maxsize=4096)
def _traced(*shape):
    return compiled.traced(*_launcher(*shape))


compiled.on_disable("qmv_rows", _launcher.cache_clear)
compiled.on_disable("qmv_rows", _traced.cache_clear)


def instances(m: int, n: int, k: int, mode: str, bits: int, group: int, dtype, fused: int = 0) -> list:
    """The (family, template) instance a launch runs (compiled.precompile)."""
    return [(family(kind(mode)), tuple(_launch_plan(m, n, k, mode, bits, group, fused, dtype)["template"]))]


def _takes(m: int, k: int, mode: str, bits: int, group: int, dtype, weight_dtype, packed: int, scales_dtype,
           biases_dtype) -> bool:
    """Whether the kernel takes an (m, k) call of an (n, packed) weight with these dtypes."""
    if not takes(mode, bits, group) or dtype not in DTYPES:
        return False
    w_bits = weight_bits(mode, bits)
    if not 1 <= m <= MAX_ROWS or k % elems_per_thread(16, w_bits) or k % group:
        return False
    return arrays_fit(k, w_bits, mode, dtype, weight_dtype, packed, scales_dtype, biases_dtype)


def arrays_fit(k: int, w_bits: int, mode: str, dtype, weight_dtype, packed: int, scales_dtype, biases_dtype) -> bool:
    """Whether a weight of `packed` uint32 words a row holds K codes of w_bits, with the scales
    (and biases) a quantized GEMV kernel reads for this mode and x dtype."""
    if weight_dtype != mx.uint32 or packed * (32 // w_bits) != k:
        return False
    if mode == "affine":
        return scales_dtype == dtype and biases_dtype == dtype
    return scales_dtype == mx.uint8


def serves(x: mx.array, weight: mx.array, scales: mx.array, biases, *, group_size: int, bits: int,
           mode: str) -> bool:
    return (x.ndim == 2 and weight.ndim == 2
            and _takes(*x.shape, mode, bits, group_size, x.dtype, weight.dtype, weight.shape[1], scales.dtype,
                       getattr(biases, "dtype", None)))


def _launch(x, weight, scales, biases, group_size: int, bits: int, mode: str, fused: int,
            rows: int | None = None, columns: int | None = None) -> mx.array:
    m, k = x.shape
    return run(_traced(m, weight.shape[0], k, mode, bits, group_size, fused, x.dtype, rows, columns), mode, x, weight,
               scales, biases)


@lru_cache(maxsize=4096)
def one_launch(lead: tuple, n: int, k: int, mode: str, bits: int, group: int, dtype, weight_dtype, packed: int,
               scales_dtype, biases_dtype):
    """The traced launch of a call of x (lead + (k,)) of an (n, packed) weight, giving lead + (n,),
    where the kernel is proven here for this quantization and dtype and takes the arrays (their
    dtypes and shapes as given), else None: try_matmul's decision, made once per call shape
    (compiled.shaped_launch: no reshape nodes where the launch is precompiled). Run it with `run`."""
    m = math.prod(lead)
    if not _takes(m, k, mode, bits, group, dtype, weight_dtype, packed, scales_dtype, biases_dtype):
        return None
    fused = proven_variant(mode, weight_bits(mode, bits), dtype)
    if fused is None:
        return None
    call, plan = _launcher(m, n, k, mode, bits, group, fused, dtype)
    return compiled.shaped_launch(call, plan, (m, k), [(*lead, n)])


def run(launch, mode: str, x, weight, scales, biases) -> mx.array:
    """A traced launch's output for these arrays (affine weights take their biases too)."""
    return (launch(x, weight, scales, biases) if mode == "affine" else launch(x, weight, scales))[0]


compiled.on_disable("qmv_rows", lambda: one_launch.cache_clear())


def matmul(x, weight, scales, biases, *, group_size: int, bits: int, mode: str, fused: int = 0,
           rows: int | None = None, columns: int | None = None) -> mx.array:
    """mx.quantized_matmul(x, weight, transpose=True) with each row in the order of MLX's
    single-row quantized GEMV (fused: the affine dequantization's rounding, the proven one is
    try_matmul's; rows: rows per warp, for benchmarks, default warp_rows(M))."""
    if not serves(x, weight, scales, biases, group_size=group_size, bits=bits, mode=mode):
        raise ValueError(f"qmv_rows cannot take {mode} {bits}-bit g{group_size}, x {x.shape} {x.dtype}")
    return _launch(x, weight, scales, biases, group_size, bits, mode, fused, rows, columns)


def try_matmul(x, weight, scales, biases, *, group_size: int, bits: int, mode: str):
    """matmul(...) where the kernel is proven here for this quantization and x's dtype and
    takes the arrays, else None."""
    if x.ndim != 2 or weight.ndim != 2:
        return None
    launch = one_launch(x.shape[:1], weight.shape[0], x.shape[1], mode, bits, group_size, x.dtype, weight.dtype,
                        weight.shape[1], scales.dtype, getattr(biases, "dtype", None))
    return None if launch is None else run(launch, mode, x, weight, scales, biases)


# (M, N, K): K % 512 a tail for 4-bit codes (640, 384: lanes 0..7 / 0..23 take one more
# tile; 384 has no full tile), N a partial last block, M a partial last row group, and
# 4099 a partial last group of four columns.
SMOKE_SHAPES = ((2, 33, 640), (5, 70, 384), (11, 9, 4096), (3, 1030, 1024), (6, 4099, 640))


def _smoke_groups(mode: str) -> tuple:
    return AFFINE_GROUPS if mode == "affine" else (FP_GROUPS[mode],)


def _smoke_test(mode: str, bits: int, dtype, fused: int) -> str | None:
    """Every row of the kernel against MLX's own single-row call, bit for bit; None: equal."""
    compiled.precompile(i for group in _smoke_groups(mode) for m, n, k in SMOKE_SHAPES
                        for i in instances(m, n, k, mode, bits, group, dtype, fused))
    key = mx.random.key(13)
    for group in _smoke_groups(mode):
        for m, n, k in SMOKE_SHAPES:
            kx, kw, key = mx.random.split(key, 3)
            x = mx.random.normal((m, k), key=kx).astype(dtype)
            wq, scales, *rest = mx.quantize(mx.random.normal((n, k), key=kw).astype(dtype), group, bits,
                                            mode=mode)
            biases = rest[0] if rest else None
            kw_ = dict(group_size=group, bits=bits, mode=mode)
            block = matmul(x, wq, scales, biases, fused=fused, **kw_)
            alone = mx.concatenate([mx.quantized_matmul(x[i : i + 1], wq, scales, biases, transpose=True, **kw_)
                                    for i in range(m)], axis=0)
            if not mx.array_equal(block, alone).item():
                return f"{mode} {bits}-bit g{group} {dtype} {m}x{n}x{k}: rows differ from MLX's single-row GEMV"
    return None


# The affine dequantization's roundings to try, in order (qmv_order.dequantize).
AFFINE_VARIANTS = (0, 1)


@lru_cache(maxsize=None)
def proven_variant(mode: str, bits: int, dtype) -> int | None:
    """The kernel variant whose rows equal MLX's single-row call for this quantization and
    dtype on this GPU (affine: 0 two roundings, 1 one), or None: none does, or no CUDA."""
    if backend() != "cuda" or dtype not in DTYPES:  # the kernel has no float32 x (no value pairs)
        return None
    for fused in AFFINE_VARIANTS if mode == "affine" else (0,):
        name = f"qmv_rows {mode} {bits}-bit {dtype} fused={fused} {compiled.mode('qmv_rows')}"
        try:
            problem = smoke_verdict(name, lambda: _smoke_test(mode, bits, dtype, fused), SOURCE, SHARED, VALUES, __file__,
                                    SKINNY_LOADER, *compiled.SOURCES)
        except Exception:  # a compile or launch failure: the kernel is not used for this case
            return None
        if problem is None:
            return fused
    return None


def unavailable_reason(mode: str = "nvfp4", bits: int = 4, dtype=mx.bfloat16) -> str | None:
    """None when the kernel matched MLX's single-row quantized GEMV on this GPU for this case."""
    if backend() != "cuda":
        return f"qmv_rows follows MLX's CUDA quantized GEMV; not on {mx.default_device()}"
    if not takes(mode, bits, FP_GROUPS.get(mode, 64)):
        return f"qmv_rows has no {mode} {bits}-bit kernel"
    if proven_variant(mode, weight_bits(mode, bits), dtype) is None:
        return f"qmv_rows: no variant matched MLX's single-row quantized GEMV for {mode} {bits}-bit {dtype}"
    return None
