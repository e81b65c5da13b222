"""Two or three 4-bit layers that read the same x (an attention block's q, k and v; an MLP's
gate and up) in one `qmv_mma` launch (qmv_mma.cu's `qmv_mma_parts`), one output each: a
decode step dispatches one node where it dispatched two or three, and no weight is copied.

Each part's outputs are computed exactly as that layer's own `qmv_mma` call computes them:
a block runs one part's column tile in the part's order, and the parts of one launch share
the warps a block splits K across (block_warps), the only launch setting that is part of the
order. The smoke test checks on the GPU that every part equals its own call bit for bit.
CUDA only.
"""
import math
from functools import lru_cache

import mlx.core as mx

from . import compiled, qmv_mma, quant_rows
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
    return (f"lockstep_qmma::qmv_mma_parts<T, {fmt}, GROUP, WARPS, NT, ROWS, DEPTH, CG>(x, x_shape[0], x_shape[1], "
            + ", ".join(cells) + ");")


def _scalars(parts: int) -> tuple:
    return (("M", "x_shape[0]"), ("K", "x_shape[1]")) + tuple((f"N{i}", f"w{i}_shape[0]") for i in range(parts))


@lru_cache(maxsize=None)
def _kernel(body: str, parts: int, shared_memory: int = 0):
    return mx.fast.cuda_kernel(name=f"lockstep_qmv_mma_parts{parts}_{body}",
                               input_names=[n for n, _ in _inputs(body, parts)],
                               output_names=[f"y{i}" for i in range(parts)], source=_body(body, parts),
                               header=qmv_mma._header(), shared_memory=shared_memory)


@lru_cache(maxsize=None)
def family(body: str, parts: int) -> compiled.Family:
    return compiled.Family(f"lockstep_qmv_mma_parts{parts}_{body}", "qmv_mma", qmv_mma._header(),
                           _body(body, parts), inputs=_inputs(body, parts),
                           outputs=[(f"y{i}", "T") for i in range(parts)], scalars=_scalars(parts),
                           threads=qmv_mma.block_threads)


def shares_order(ns, k: int) -> bool:
    """Whether layers of these widths (one K) can be parts of one launch: two or three, all
    split across the same warps as on their own."""
    return 2 <= len(ns) <= MAX_PARTS and len({qmv_mma.block_warps(n, k) for n in ns}) == 1


@lru_cache(maxsize=4096)
def _launch_plan(m: int, ns: tuple, k: int, mode: str, group: int, dtype, tiles: int | None = None,
                 ahead: int | None = None, groups: int | None = None) -> dict:
    if any(qmv_mma.block_warps(n, k) != qmv_mma.block_warps(ns[0], k) for n in ns):
        raise ValueError(f"qmv_mma parts {ns} x {k} split K across different warps")
    # NT, DEPTH and CG as for the parts' widths summed; WARPS each part's own (its order)
    whole = qmv_mma.launch_shape(sum(ns), k, m, tiles, ahead, groups)
    shape = qmv_mma.launch_shape(ns[0], k, m, whole["tiles"], whole["ahead"], whole["groups"])
    return qmv_mma.plan_of(shape, m, ns, mode, group, dtype)


@lru_cache(maxsize=4096)
def _launcher(m: int, ns: tuple, k: int, mode: str, group: int, dtype, tiles: int | None = None,
              ahead: int | None = None, groups: int | None = None) -> tuple:
    plan = _launch_plan(m, ns, k, mode, group, dtype, tiles, ahead, groups)
    body = kind(mode)
    scalars = dict(M=m, K=k, **{f"N{i}": n for i, n in enumerate(ns)})
    return compiled.launcher(family(body, len(ns)), plan, scalars,
                             lambda: qmv_mma.fallback(_kernel(body, len(ns), plan.get("shared_memory", 0)), plan))


@lru_cache(maxsize=4096)
def _traced(*shape):
    return compiled.traced(*_launcher(*shape))


compiled.on_disable("qmv_mma", _launcher.cache_clear)
compiled.on_disable("qmv_mma", _traced.cache_clear)


def instances(m: int, ns: tuple, k: int, mode: str, group: int, dtype, groups: int | None = None) -> list:
    """The (family, template) instance a launch runs (compiled.precompile)."""
    plan = _launch_plan(m, tuple(ns), k, mode, group, dtype, groups=groups)
    return [(family(kind(mode), len(ns)), tuple(plan["template"]))]


def matmuls(x, layers, *, group_size: int, bits: int, mode: str, tiles: int | None = None,
            ahead: int | None = None, groups: int | None = None) -> list:
    """[mx.quantized_matmul(x, w, transpose=True) for each layer], each in its own qmv_mma
    call's order; layers: (weight, scales, biases) of each part (biases None but affine);
    tiles, ahead, groups: launch shape for benchmarks and the smoke test (they change no bits)."""
    m, k = x.shape
    ns = tuple(w.shape[0] for w, _, _ in layers)
    if not (shares_order(ns, k) and all(qmv_mma.serves(x, *part, group_size=group_size, bits=bits, mode=mode)
                                        for part in layers)):
        raise ValueError(f"qmv_mma parts cannot take {mode} {bits}-bit g{group_size} {ns}, x {x.shape} {x.dtype}")
    launch = _traced(m, ns, k, mode, group_size, x.dtype, tiles, ahead, groups)
    arrays = [a for part in layers for a in (part if mode == "affine" else part[:2])]
    return launch(x, *arrays)


@lru_cache(maxsize=4096)
def launch_for(lead: tuple, ns: tuple, k: int, mode: str, bits: int, group: int, dtype, weight_dtype,
               packed: int, scales_dtype, biases_dtype):
    """The traced launch of a call of x (lead + (k,)) giving one lead + (n,) output for each n
    of ns, where the parts share an order, qmv_mma takes each and this launch passed its smoke
    test here; else None. Call it with x, then each part's weight and scales (affine: and
    biases)."""
    m = math.prod(lead)
    if not shares_order(ns, k):
        return None
    if not qmv_mma._takes(m, k, mode, bits, group, dtype, weight_dtype, packed, scales_dtype, biases_dtype):
        return None
    if unavailable_reason(mode, dtype) is not None:
        return None
    call, plan = _launcher(m, ns, k, mode, group, dtype)
    return compiled.shaped_launch(call, plan, (m, k), [(*lead, n) for n in ns])


compiled.on_disable("qmv_mma", lambda: launch_for.cache_clear())

# (M, parts' N, K): three parts with partial last tiles, two wide parts (4 warps), rows across
# 8-, 16- and 32-row blocks.
SMOKE_SHAPES = ((1, (40, 8, 24), 1152), (5, (70, 33, 9), 640), (16, (8200, 8200), 512), (20, (64, 16, 16), 4096),
                (33, (24, 40), 256))


def _smoke_test(mode: str, dtype) -> str | None:
    """Every part of each launch equals its layer's own qmv_mma call bit for bit. None: all hold."""
    compiled.precompile(i for group in quant_rows.GROUPS[mode] for m, ns, k in SMOKE_SHAPES
                        for i in [j for cg in (None,) + qmv_mma.STAGED_GROUPS
                                  for j in instances(m, ns, k, mode, group, dtype, groups=cg)]
                        + [j for n in ns for j in qmv_mma.instances(m, n, k, mode, group, dtype)])
    key = mx.random.key(23)
    for group in quant_rows.GROUPS[mode]:
        for m, ns, k in SMOKE_SHAPES:
            kx, key = mx.random.split(key)
            x = mx.random.normal((m, k), key=kx).astype(dtype)
            layers = []
            for n in ns:
                kw, key = mx.random.split(key)
                wq, scales, *rest = mx.quantize(mx.random.normal((n, k), key=kw).astype(dtype), group, 4, mode=mode)
                layers.append((wq, scales, rest[0] if rest else None))
            kw_ = dict(group_size=group, bits=4, mode=mode)
            for cg in (None,) + qmv_mma.STAGED_GROUPS:
                together = matmuls(x, layers, groups=cg, **kw_)
                for i, part in enumerate(layers):
                    if not mx.array_equal(together[i], qmv_mma.matmul(x, *part, **kw_)).item():
                        return f"{mode} g{group} {dtype} {m}x{ns}x{k} CG {cg}: part {i} differs from its own call"
    return None


@lru_cache(maxsize=None)
def unavailable_reason(mode: str = "nvfp4", dtype=mx.bfloat16) -> str | None:
    """None where parts launches passed their smoke test on this GPU for this format and dtype
    (qmv_mma's own included)."""
    own = qmv_mma.unavailable_reason(mode, dtype)
    if own is not None:
        return own
    return quant_rows.verdict("qmv_mma_parts", mode, dtype, lambda: _smoke_test(mode, dtype), qmv_mma.SOURCE,
                              __file__)
