"""Loads qmv_mma.cu (beside this file): rows of x times a 4-bit quantized weight (affine-4,
nvfp4, mxfp4; float16 and bfloat16 x) on tensor cores, K split across a block's warps,
lockstep's own order (index model: qmv_mma_order.py). Each weight is loaded and dequantized
once for all of a block's rows (8, 16 or 32), so sixteen rows cost about what one does. Calls
of 2..16 rows run its staged tile, whose block copies x's rows into shared memory once a round
for CG column groups of warps (column_groups): the same MMAs in the same sequence, so the same
bits. Each instance compiled once per machine (compiled.py) and launched traced. CUDA only.

A row's bits depend only on its own x row, the weight, K and the warps a block splits K
across (a function of the layer's shape), never on how many rows the call has or where a row
sits in its tile. Its smoke test checks that on this GPU (every row of 2..40-row calls against
the one-row call), that the rows are close to the dequantized product, and close to the order
model (which sums each MMA exactly: the tensor core's own rounding is the hardware's).
"""
import math
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from . import compiled, quant_rows
from .qmv_rows import INPUTS, SCALARS, kind
from .quant_rows import FORMAT_CODES, GROUPS, takes  # noqa: F401 (takes: part of this API)
from .skinny import backend

SOURCE = Path(__file__).resolve().parent / "qmv_mma.cu"
CHUNK = 128  # codes of a column a warp takes at a time
MAX_GRID_Y = 65535
# Layers of at least this many weights (N * K) read faster through this kernel than through
# MLX's quantized GEMV at one row on the H200 (an 8B model's q and o, gate, up, down, head);
# smaller ones (k, v) slower (bench/results/history/2026-12-02-h200-qmv-mma-issue28.md).
MIN_ELEMENTS = 16 << 20
# Canonical rows of smaller layers would otherwise run qmv_rows blocks in MLX's GEMV order,
# which are slower than this kernel at 16 and 32 rows from layers of 4 M weights on (an 8B's
# k and v; bench/results/history/2026-12-03-h200-plain-read-4bit-bounds-issue28.md).
CANONICAL_MIN_ELEMENTS = MIN_ELEMENTS // 4
_ARGS = "y, x_shape[0], w_shape[0], x_shape[1]);"
_TEMPLATE = "<T, {fmt}, GROUP, WARPS, NT, ROWS, DEPTH, CG>"
_BODIES = {
    "affine": "lockstep_qmma::qmv_mma" + _TEMPLATE.format(fmt="0") + "(x, w, scales, nullptr, biases, " + _ARGS,
    "fp": "lockstep_qmma::qmv_mma" + _TEMPLATE.format(fmt="FMT") + "(x, w, nullptr, scales, nullptr, " + _ARGS,
}


def _header() -> str:
    return quant_rows.header(SOURCE)


@lru_cache(maxsize=None)
def _kernel(kind: str, shared_memory: int = 0):
    return mx.fast.cuda_kernel(name=f"lockstep_qmv_mma_{kind}", input_names=[n for n, _ in INPUTS[kind]],
                               output_names=["y"], source=_BODIES[kind], header=_header(),
                               shared_memory=shared_memory)


def block_threads(template) -> int | None:
    """A staged instance's block size (its wrapper's launch bounds); None for CG = 0, whose
    blocks of at most 256 threads need none."""
    values = dict(template)
    return 32 * values["WARPS"] * values["CG"] if values.get("CG") else None


@lru_cache(maxsize=None)
def family(kind: str) -> compiled.Family:
    return compiled.Family(f"lockstep_qmv_mma_{kind}", "qmv_mma", _header(), _BODIES[kind],
                           inputs=INPUTS[kind], outputs=[("y", "T")], scalars=SCALARS, threads=block_threads)


def fallback(kernel, plan: dict) -> tuple:
    """cuda_kernel's (call, arguments) for a plan: the shared memory went into the kernel."""
    return kernel, {key: value for key, value in plan.items() if key != "shared_memory"}


def runs_here() -> bool:
    """Whether this backend has the kernel at all (its smoke test decides per format)."""
    return backend() == "cuda"


def pays(n: int, k: int, canonical: bool = False) -> bool:
    """Whether a layer of (N, K) weights is large enough to be faster through this kernel
    (canonical: for canonical rows, against the layer's other canonical form)."""
    return n * k >= (CANONICAL_MIN_ELEMENTS if canonical else MIN_ELEMENTS)


def block_warps(n: int, k: int) -> int:
    """Warps a block splits K across: part of a row's order, so a function of the layer's
    shape alone. Narrow layers split K further, for enough warps in flight."""
    return 8 if n < 8192 else 4


def block_tiles(n: int, k: int, m: int) -> int:
    """Column tiles of 8 a block takes (NT): which block computes an output, never its order.
    Wide layers, and large ones at more than 8 rows, read faster with more a block
    (bench/results/history/2026-12-02-h200-qmv-mma-issue28.md)."""
    return 4 if n >= 8192 or (m > 8 and n * k >= 32 << 20) else 2


def block_rows(m: int) -> int:
    """Rows a block (ROWS): each weight load and dequantization serves them all."""
    return 8 if m <= 8 else 16 if m <= 16 else 32


def depth(rows: int) -> int:
    """Chunks a warp loads ahead of its MMAs (latency, never order), fewer where registers
    run short."""
    return 2 if rows <= 16 else 1


# The column groups (CG) column_groups gives anywhere: the smoke test runs each on its shapes.
STAGED_GROUPS = (1, 2)
# The staged tile's column tiles a warp (NT) and chunks loaded ahead (DEPTH), and the rows its
# calls take; wider calls (to 32 rows) read no faster through it.
STAGED_TILES, STAGED_DEPTH = 4, 1
STAGED_ROWS = range(2, 17)


def column_groups(n: int, k: int, m: int) -> int:
    """Column groups a block stages x for (CG; 0: each warp reads x from global memory): which
    block computes an output and where its x comes from, never its order. Calls of 2..16 rows
    take the staged tile, one group a block for layers split across 8 warps, two for wider ones
    (4 warps); where it ran faster at the 8B's linears on the H100
    (bench/results/cuda/qmv_mma_staged_h100_2026-12-06.md)."""
    if m not in STAGED_ROWS:
        return 0
    return 1 if block_warps(n, k) == 8 else 2


# The most dynamic shared memory a block may take on sm_80 / sm_90 (bytes).
MAX_SHARED_BYTES = 227 << 10


def staged_bytes(warps: int, tiles: int, rows: int, ahead: int, groups: int) -> int:
    """The dynamic shared memory of a staged launch (qmv_mma.cu's Staged::BYTES): the code
    table (none in 32-row blocks, which place a code's bits) and a round's x slab, later the
    warps' partial sums over them; 0 for CG = 0."""
    if not groups:
        return 0
    tiles_m = -(-rows // 16)
    table = 0 if rows >= 32 else 256 * (32 if rows >= 16 else 1) * 4
    slab = rows * warps * ahead * 16 * 16
    partial = groups * warps * tiles_m * tiles * 128 * 4
    return max(table + slab, partial)


def launch_shape(n: int, k: int, m: int, tiles: int | None = None, ahead: int | None = None,
                 groups: int | None = None) -> dict:
    """WARPS, NT, ROWS, DEPTH and CG of a launch (each given one kept), and its block's threads,
    columns and shared memory."""
    warps = block_warps(n, k)
    rows = block_rows(m)
    groups = column_groups(n, k, m) if groups is None else groups
    tiles = tiles or (STAGED_TILES if groups else block_tiles(n, k, m))
    ahead = ahead or (STAGED_DEPTH if groups else depth(rows))
    shared = staged_bytes(warps, tiles, rows, ahead, groups)
    if shared > MAX_SHARED_BYTES:
        raise ValueError(f"qmv_mma: {warps} warps, {tiles} tiles, {rows} rows, depth {ahead}, {groups} column "
                         f"groups need {shared} bytes of shared memory")
    return dict(warps=warps, tiles=tiles, rows=rows, ahead=ahead, groups=groups, threads=32 * warps * max(groups, 1),
                columns=8 * tiles * max(groups, 1), shared=shared)


def max_rows() -> int:
    return MAX_GRID_Y * 32


def template_of(shape: dict, mode: str, group: int, dtype) -> list:
    """The instance's template values for a launch_shape."""
    template = [("T", dtype)]
    if mode != "affine":
        template.append(("FMT", FORMAT_CODES[mode]))
    return template + [("GROUP", group), ("WARPS", shape["warps"]), ("NT", shape["tiles"]), ("ROWS", shape["rows"]),
                       ("DEPTH", shape["ahead"]), ("CG", shape["groups"])]


def plan_of(shape: dict, m: int, ns: tuple, mode: str, group: int, dtype) -> dict:
    """The launch of a launch_shape for m rows and outputs of widths ns (one layer, or the
    parts of a qmv_mma_parts launch: each part's column tiles in turn)."""
    plan = dict(
        template=template_of(shape, mode, group, dtype),
        grid=(sum(-(-n // shape["columns"]) for n in ns) * shape["threads"], -(-m // shape["rows"]), 1),
        threadgroup=(shape["threads"], 1, 1),
        output_shapes=[(m, n) for n in ns],
        output_dtypes=[dtype] * len(ns),
    )
    if shape["shared"]:
        plan["shared_memory"] = shape["shared"]
    return plan


@lru_cache(maxsize=4096)
def _launch_plan(m: int, n: int, k: int, mode: str, group: int, dtype, tiles: int | None = None,
                 ahead: int | None = None, groups: int | None = None) -> dict:
    return plan_of(launch_shape(n, k, m, tiles, ahead, groups), m, (n,), mode, group, dtype)


@lru_cache(maxsize=4096)
def _launcher(m: int, n: int, k: int, mode: str, group: int, dtype, tiles: int | None = None,
              ahead: int | None = None, groups: int | None = None) -> tuple:
    plan = _launch_plan(m, n, k, mode, group, dtype, tiles, ahead, groups)
    body = kind(mode)
    return compiled.launcher(family(body), plan, dict(M=m, N=n, K=k),
                             lambda: fallback(_kernel(body, plan.get("shared_memory", 0)), plan))


@lru_cache(maxsize=4096)
def _traced(*shape):
    return compiled.traced(*_launcher(*shape))


compiled.on_disable("qmv_mma", _launcher.cache_clear)
compiled.on_disable("qmv_mma", _traced.cache_clear)


def instances(m: int, n: int, k: int, mode: str, group: int, dtype, tiles: int | None = None,
              ahead: int | None = None, groups: int | None = None) -> list:
    """The (family, template) instance a launch runs (compiled.precompile)."""
    return [(family(kind(mode)), tuple(_launch_plan(m, n, k, mode, group, dtype, tiles, ahead, groups)["template"]))]


def _takes(m: int, k: int, mode: str, bits: int, group: int, dtype, weight_dtype, packed: int, scales_dtype,
           biases_dtype) -> bool:
    return quant_rows.fits(m, k, mode, bits, group, dtype, weight_dtype, packed, scales_dtype, biases_dtype,
                           max_rows=max_rows(), k_multiple=CHUNK)


def serves(x: mx.array, weight: mx.array, scales: mx.array, biases, *, group_size: int, bits: int,
           mode: str) -> bool:
    return (x.ndim == 2 and weight.ndim == 2
            and _takes(*x.shape, mode, bits, group_size, x.dtype, weight.dtype, weight.shape[1], scales.dtype,
                       getattr(biases, "dtype", None)))


def matmul(x, weight, scales, biases, *, group_size: int, bits: int, mode: str, tiles: int | None = None,
           ahead: int | None = None, groups: int | None = None) -> mx.array:
    """mx.quantized_matmul(x, weight, transpose=True) in this kernel's order (tiles, ahead,
    groups: launch shape for benchmarks and the smoke test; they change no bits)."""
    if not serves(x, weight, scales, biases, group_size=group_size, bits=bits, mode=mode):
        raise ValueError(f"qmv_mma cannot take {mode} {bits}-bit g{group_size}, x {x.shape} {x.dtype}")
    m, k = x.shape
    launch = _traced(m, weight.shape[0], k, mode, group_size, x.dtype, tiles, ahead, groups)
    return (launch(x, weight, scales, biases) if mode == "affine" else launch(x, weight, scales))[0]


@lru_cache(maxsize=4096)
def launch_for(lead: tuple, n: int, k: int, mode: str, bits: int, group: int, dtype, weight_dtype, packed: int,
               scales_dtype, biases_dtype):
    """The traced launch of a call of x (lead + (k,)) giving lead + (n,), where the kernel
    passed its smoke test here for this quantization and dtype and takes the arrays, else
    None (compiled.shaped_launch: no reshape nodes where the launch is precompiled). Call it with
    x, the weight and the scales (affine: and the biases)."""
    m = math.prod(lead)
    if not _takes(m, k, mode, bits, group, dtype, weight_dtype, packed, scales_dtype, biases_dtype):
        return None
    if unavailable_reason(mode, dtype) is not None:
        return None
    call, plan = _launcher(m, n, k, mode, group, dtype)
    launch = compiled.shaped_launch(call, plan, (m, k), [(*lead, n)])
    return lambda x, *weights: launch(x, *weights)[0]


compiled.on_disable("qmv_mma", lambda: launch_for.cache_clear())


# (M, N, K), K a multiple of 128: 9 chunks (fewer than 2 a warp), 33 (a partial round), N a
# partial last tile, a wide layer (4 warps, 2 tiles); M across 8-, 16- and 32-row blocks.
SMOKE_SHAPES = ((2, 33, 1152), (5, 70, 4224), (16, 9, 4096), (20, 8200, 512), (40, 24, 640))


def _model_gap(x, wq, scales, biases, got, mode: str, group: int, dtype) -> float:
    """How far the kernel's rows are from the order model's, in units of T's epsilon at each
    output (plus a thousandth of the largest): below 2 where only the MMA's own rounding
    differs."""
    import numpy as np

    from .qmv_mma_order import qmv_mma

    x64, w, name = quant_rows.model_inputs(x, wq, scales, biases, mode, group, dtype)
    want = qmv_mma(x64, w, dtype=name, warps=block_warps(w.shape[0], w.shape[1]))
    have = np.array(got.astype(mx.float32)).astype(np.float64)
    eps = 2.0 ** (-7 if name == "bfloat16" else -10)
    scale = eps * (np.abs(want) + 1e-3 * np.max(np.abs(want)))
    return float(np.max(np.abs(have - want) / scale))


def _smoke_test(mode: str, dtype) -> str | None:
    """Every row of 2..40-row calls equals the one-row call bit for bit and is close to the
    product of x and the dequantized weight; the small shapes' rows are within two of T's
    epsilon of the order model. None: all hold."""
    compiled.precompile(i for group in GROUPS[mode] for m, n, k in SMOKE_SHAPES
                        for rows in {m, 1} for cg in (None,) + STAGED_GROUPS
                        for i in instances(rows, n, k, mode, group, dtype, groups=cg))

    def check(shape, x, wq, scales, biases, block, group):
        _, n, k = shape
        for cg in STAGED_GROUPS:  # the staged tile's x path: the same bits
            staged = matmul(x, wq, scales, biases, group_size=group, bits=4, mode=mode, groups=cg)
            if not mx.array_equal(staged, block).item():
                return f"the staged tile (CG {cg}) differs from qmv_mma_tile"
        if n * k <= 70 * 4224:
            gap = _model_gap(x, wq, scales, biases, block, mode, group, dtype)
            if not gap <= 2.0:
                return f"{gap:.3g} epsilons off the order model"
        return None

    return quant_rows.smoke_rows(matmul, mode, dtype, SMOKE_SHAPES, 19, check)


@lru_cache(maxsize=None)
def unavailable_reason(mode: str = "nvfp4", dtype=mx.bfloat16) -> str | None:
    """None where the kernel passed its smoke test on this GPU for this format and dtype."""
    return quant_rows.verdict("qmv_mma", mode, dtype, lambda: _smoke_test(mode, dtype), SOURCE, __file__)
