"""Two or three 4-bit layers that read the same x (an attention block's q, k and v; an MLP's
gate and up) in one `qmv_split` launch (qmv_split.cu's `qmv_split_parts`), one output each:
a plain one-row step dispatches one node where it dispatched two or three, and no weight is
copied.

A part's outputs are computed exactly as that layer's own `qmv_split` call computes them: the
grid's blocks are dealt to the parts (part_blocks), and a block walks its part's column groups
as a launch of that layer alone would; a column's order never depends on which block computes
it. The smoke test checks on the GPU that every part equals its own call bit for bit. CUDA
only.
"""
import math
from functools import lru_cache

import mlx.core as mx

from . import compiled, qmv_split, quant_rows
from .qmv_rows import kind

MAX_PARTS = 3
_PART = "w{i}, {st}, {su}, {b}, y{i}, w{i}_shape[0]"
_EMPTY = "nullptr, nullptr, nullptr, nullptr, nullptr, 0"


def _inputs(body: str, parts: int) -> list[tuple[str, str]]:
    arrays = [("x", "T")]
    for i in range(parts):
        arrays += [(f"w{i}", "uint32_t"), (f"s{i}", "T" if body == "affine" else "uint8_t")]
        if body == "affine":
            arrays.append((f"b{i}", "T"))
    return arrays


def _body(body: str, parts: int) -> str:
    fmt = "0" if body == "affine" else "FMT"
    cells = []
    for i in range(MAX_PARTS):
        if i >= parts:
            cells.append(_EMPTY)
        elif body == "affine":
            cells.append(_PART.format(i=i, st=f"s{i}", su="nullptr", b=f"b{i}"))
        else:
            cells.append(_PART.format(i=i, st="nullptr", su=f"s{i}", b="nullptr"))
    return (f"lockstep_qsplit::qmv_split_parts<T, {fmt}, GROUP, C, MR>(x, x_shape[0], x_shape[1], "
            + ", ".join(cells) + ");")


def _scalars(parts: int) -> tuple:
    return (("M", "x_shape[0]"), ("K", "x_shape[1]")) + tuple((f"N{i}", f"w{i}_shape[0]") for i in range(parts))


@lru_cache(maxsize=None)
def _kernel(body: str, parts: int):
    return mx.fast.cuda_kernel(name=f"lockstep_qmv_split_parts{parts}_{body}",
                               input_names=[n for n, _ in _inputs(body, parts)],
                               output_names=[f"y{i}" for i in range(parts)], source=_body(body, parts),
                               header=qmv_split._header())


@lru_cache(maxsize=None)
def family(body: str, parts: int) -> compiled.Family:
    return compiled.Family(f"lockstep_qmv_split_parts{parts}_{body}", "qmv_split", qmv_split._header(),
                           _body(body, parts), inputs=_inputs(body, parts),
                           outputs=[(f"y{i}", "T") for i in range(parts)], scalars=_scalars(parts))


def part_blocks(ns, columns: int, grid: int) -> tuple:
    """How many of the grid's blocks each part gets: qmv_split_parts's rule (the kernel
    computes it itself), in proportion to the parts' column groups, at least one each, the
    first part the rest."""
    groups = [-(-n // columns) for n in ns]
    total = sum(groups)
    later = [max(1, grid * g // total) for g in groups[1:]]
    return (grid - sum(later), *later)


def grid_blocks(ns, columns: int, blocks: int | None = None) -> int:
    """The launch's blocks: as many as the parts have column groups, at most qmv_split's cap,
    and enough that each part gets one."""
    groups = sum(-(-n // columns) for n in ns)
    grid = min(groups, blocks or qmv_split.MAX_BLOCKS)
    while part_blocks(ns, columns, grid)[0] < 1:
        grid += 1
    return grid


@lru_cache(maxsize=4096)
def _launch_plan(m: int, ns: tuple, mode: str, group: int, dtype, blocks: int | None = None) -> dict:
    columns = qmv_split.block_columns(sum(ns))
    rows = qmv_split.block_rows(m)
    template = [("T", dtype)]
    if mode != "affine":
        template.append(("FMT", quant_rows.FORMAT_CODES[mode]))
    template += [("GROUP", group), ("C", columns), ("MR", rows)]
    return dict(
        template=template,
        grid=(grid_blocks(ns, columns, blocks) * qmv_split.THREADS, -(-m // rows), 1),
        threadgroup=(qmv_split.THREADS, 1, 1),
        output_shapes=[(m, n) for n in ns],
        output_dtypes=[dtype] * len(ns),
    )


@lru_cache(maxsize=4096)
def _launcher(m: int, ns: tuple, k: int, mode: str, group: int, dtype, blocks: int | None = None) -> tuple:
    plan = _launch_plan(m, ns, mode, group, dtype, blocks)
    body = kind(mode)
    scalars = dict(M=m, K=k, **{f"N{i}": n for i, n in enumerate(ns)})
    return compiled.launcher(family(body, len(ns)), plan, scalars, lambda: (_kernel(body, len(ns)), plan))


@lru_cache(maxsize=4096)
def _traced(*shape):
    return compiled.traced(*_launcher(*shape))


compiled.on_disable("qmv_split", _launcher.cache_clear)
compiled.on_disable("qmv_split", _traced.cache_clear)


def instances(m: int, ns: tuple, k: int, mode: str, group: int, dtype) -> list:
    """The (family, template) instance a launch runs (compiled.precompile; k as qmv_mma_parts
    takes it, not part of the instance)."""
    return [(family(kind(mode), len(ns)), tuple(_launch_plan(m, tuple(ns), mode, group, dtype)["template"]))]


def takes_parts(ns) -> bool:
    return 2 <= len(ns) <= MAX_PARTS


def matmuls(x, layers, *, group_size: int, bits: int, mode: str, blocks: int | None = None) -> list:
    """[mx.quantized_matmul(x, w, transpose=True) for each layer], each in its own qmv_split
    call's order; layers: (weight, scales, biases) of each part (biases None but affine);
    blocks: the grid's cap, for benchmarks (it changes no bits)."""
    m, k = x.shape
    ns = tuple(w.shape[0] for w, _, _ in layers)
    if not (takes_parts(ns) and all(qmv_split.serves(x, *part, group_size=group_size, bits=bits, mode=mode)
                                    for part in layers)):
        raise ValueError(f"qmv_split parts cannot take {mode} {bits}-bit g{group_size} {ns}, x {x.shape} {x.dtype}")
    launch = _traced(m, ns, k, mode, group_size, x.dtype, blocks)
    arrays = [a for part in layers for a in (part if mode == "affine" else part[:2])]
    return launch(x, *arrays)


@lru_cache(maxsize=4096)
def launch_for(lead: tuple, ns: tuple, k: int, mode: str, bits: int, group: int, dtype, weight_dtype,
               packed: int, scales_dtype, biases_dtype):
    """The traced launch of a call of x (lead + (k,)) giving one lead + (n,) output for each n
    of ns, where qmv_split takes each part and this launch passed its smoke test here; else
    None. Call it with x, then each part's weight and scales (affine: and biases)."""
    m = math.prod(lead)
    if not takes_parts(ns):
        return None
    if not qmv_split._takes(m, k, mode, bits, group, dtype, weight_dtype, packed, scales_dtype, biases_dtype):
        return None
    if unavailable_reason(mode, dtype) is not None:
        return None
    call, plan = _launcher(m, ns, k, mode, group, dtype)
    return compiled.shaped_launch(call, plan, (m, k), [(*lead, n) for n in ns])


compiled.on_disable("qmv_split", lambda: launch_for.cache_clear())

# (M, parts' N, K, grid cap): three parts with partial last groups, a part of one group beside
# wide ones, rows across blocks of 4 rows, parts sharing fewer blocks than they have groups.
SMOKE_SHAPES = ((1, (40, 8, 24), 1152, None), (5, (70, 33, 9), 640, None), (1, (8, 2050, 1030), 512, 7),
                (3, (1030, 520), 4224, 5))


def _smoke_test(mode: str, dtype) -> str | None:
    """Every part of each launch equals its layer's own qmv_split call bit for bit. None: all hold."""
    compiled.precompile(i for group in quant_rows.GROUPS[mode] for m, ns, k, _ in SMOKE_SHAPES
                        for i in instances(m, ns, k, mode, group, dtype)
                        + [j for n in ns for j in qmv_split.instances(m, n, mode, group, dtype)])
    key = mx.random.key(29)
    for group in quant_rows.GROUPS[mode]:
        for m, ns, k, blocks in SMOKE_SHAPES:
            kx, key = mx.random.split(key)
            x = mx.random.normal((m, k), key=kx).astype(dtype)
            layers = []
            for n in ns:
                kw, key = mx.random.split(key)
                wq, scales, *rest = mx.quantize(mx.random.normal((n, k), key=kw).astype(dtype), group, 4, mode=mode)
                layers.append((wq, scales, rest[0] if rest else None))
            kw_ = dict(group_size=group, bits=4, mode=mode)
            together = matmuls(x, layers, blocks=blocks, **kw_)
            for i, part in enumerate(layers):
                if not mx.array_equal(together[i], qmv_split.matmul(x, *part, **kw_)).item():
                    return f"{mode} g{group} {dtype} {m}x{ns}x{k}: part {i} differs from its own call"
    return None


@lru_cache(maxsize=None)
def unavailable_reason(mode: str = "nvfp4", dtype=mx.bfloat16) -> str | None:
    """None where parts launches passed their smoke test on this GPU for this format and dtype
    (qmv_split's own included)."""
    own = qmv_split.unavailable_reason(mode, dtype)
    if own is not None:
        return own
    return quant_rows.verdict("qmv_split_parts", mode, dtype, lambda: _smoke_test(mode, dtype), qmv_split.SOURCE,
                              __file__)
