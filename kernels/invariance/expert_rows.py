"""The token rows of an MoE expert block (mlx-lm's `SwitchGLU` / `SwitchMLP`) in a
deterministic pass, in one of two forms, and the proof that picks between them.

- per row: the block's own call once per row, each exactly as decode calls it (x (1, 1, D),
  indices (1, 1, k)): 3 gather launches a row (2 for SwitchMLP).
- one call: every projection once for all rows, unsorted, x shaped so that every (row,
  expert) pair is its own M = 1 batch element of `gather_mm` / `gather_qmm`, which is how a
  single row's call runs its k experts. mlx-lm's own call sorts the pairs by expert from 64
  pairs up (tiled kernels, whose order depends on how many rows share an expert); this form
  never does. The projections' own `__call__` runs with `sorted_indices=False`; the
  activation between them is elementwise.

Whether a backend's gather kernel gives a batch element the same bits whatever the batch's
size is a fact about the backend, so the one-call form is used only for the widths
`prove_one_call` compared, bit for bit, with the per-row calls on this model's blocks (each
distinct expert configuration, its own weights); a wider call runs as one call per block of
that many rows. Where the proof fails, the rows run per row.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from ..proof_steps import step_done
from .selftest import bits_equal

log = logging.getLogger(__name__)

EXPERT_BLOCKS = (SwitchGLU, SwitchMLP)


def default_pass_rows() -> int:
    """The widest pass the one-call form is proven for when L is smaller: the most rows the
    engine puts in a pass by default here (server/engine/scheduling/admission.py: at most 64 on
    a GPU, 32 on the CPU). A wider pass runs one call per block of this many rows."""
    return 32 if mx.default_device() == mx.cpu else 64

# Attributes naming the experts a token routes to, on the block's parent or the model's args.
_TOP_K_NAMES = ("num_experts_per_tok", "top_k", "num_experts_per_token", "experts_per_token", "moe_topk")


def native_call(block):
    """mlx-lm's own call of the expert block (its class or the one lockstep swapped in)."""
    for cls in type(block).__mro__:
        if cls in EXPERT_BLOCKS:
            return cls.__call__
    raise TypeError(f"{type(block).__name__} is not one of mlx-lm's expert blocks")


def per_row(block, x: mx.array, indices: mx.array) -> mx.array:
    """The block's own call once per token row, each as decode makes it. x: (..., D) hidden
    states, indices: (..., k) experts per row; returns (..., k, D) as the block's own call."""
    call = native_call(block)
    rows, k = x.size // x.shape[-1], indices.shape[-1]
    xs, idx = x.reshape(1, rows, x.shape[-1]), indices.reshape(1, rows, k)
    out = mx.concatenate([call(block, xs[:, i:i + 1], idx[:, i:i + 1]) for i in range(rows)], axis=1)
    return out.reshape(*x.shape[:-1], *out.shape[2:])


def one_call(block, x: mx.array, indices: mx.array) -> mx.array:
    """Every row in one unsorted gather call per projection; shapes as `per_row`. x (1, R, D)
    becomes (1, R, 1, 1, D) against indices (1, R, k): R * k batch elements of one row each,
    as a single row's call (1, 1, 1, 1, D) against (1, 1, k) has k."""
    rows, k = x.size // x.shape[-1], indices.shape[-1]
    xs = mx.expand_dims(x.reshape(1, rows, x.shape[-1]), (-2, -3))
    idx = mx.stop_gradient(indices.reshape(1, rows, k))
    if isinstance(block, SwitchGLU):
        up = block.up_proj(xs, idx, sorted_indices=False)
        gate = block.gate_proj(xs, idx, sorted_indices=False)
        out = block.down_proj(block.activation(up, gate), idx, sorted_indices=False)
    else:
        out = block.fc2(block.activation(block.fc1(xs, idx, sorted_indices=False)), idx, sorted_indices=False)
    out = out.squeeze(-2)  # (1, R, k, D)
    return out.reshape(*x.shape[:-1], *out.shape[2:])


def canonical(block, x: mx.array, indices: mx.array, one_call_rows: int) -> mx.array:
    """The rows of a deterministic call: one call where `one_call_rows` (the widest width the
    proof covered; 0: none) covers them, one call per block of that many rows where it is
    smaller than the call, else per row."""
    if one_call_rows <= 0:
        return per_row(block, x, indices)
    rows = x.size // x.shape[-1]
    if rows <= one_call_rows:
        return one_call(block, x, indices)
    k = indices.shape[-1]
    xs, idx = x.reshape(rows, x.shape[-1]), indices.reshape(rows, k)
    out = mx.concatenate([one_call(block, xs[None, i:i + one_call_rows], idx[None, i:i + one_call_rows])[0]
                          for i in range(0, rows, one_call_rows)], axis=0)
    return out.reshape(*x.shape[:-1], *out.shape[1:])


@dataclass(frozen=True)
class ExpertRowsProof:
    """What `prove_one_call` found: the widest width whose one call kept every row's per-row
    bits (0: the rows run per row) and why."""

    one_call_rows: int
    reason: str
    cached: bool = False

    def describe(self) -> str:
        if self.one_call_rows:
            return f"MoE experts: one call for 1..{self.one_call_rows} rows ({self.reason})"
        return f"MoE experts: per row ({self.reason})"


def _config(block) -> tuple:
    """What a gather kernel's choice can depend on: the block kind, each projection's kind,
    shape, dtypes, quantization and bias, and the activation."""
    projections = []
    for proj_name, proj in sorted(block.children().items()):
        if not hasattr(proj, "weight"):
            continue
        w = proj["weight"]
        projections.append((proj_name, type(proj).__name__, tuple(w.shape), str(w.dtype),
                            getattr(proj, "mode", None), getattr(proj, "bits", None),
                            getattr(proj, "group_size", None), "bias" in proj,
                            getattr(proj, "global_scale", None) is not None))
    return native_call(block).__qualname__, tuple(projections), type(block.activation).__name__


def _top_k(model, parents: dict, name: str):
    parent = parents.get(name.rpartition(".")[0])
    for source in (parent, getattr(model, "args", None)):
        for attr in _TOP_K_NAMES:
            value = getattr(source, attr, None) if source is not None else None
            if isinstance(value, int) and value > 0:
                return value
    return None


def expert_blocks(model) -> list[tuple[str, object]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, EXPERT_BLOCKS)]


def _num_experts(block) -> int:
    proj = block.down_proj if isinstance(block, SwitchGLU) else block.fc2
    return proj["weight"].shape[0]


def _input_dims(block) -> int:
    proj = block.up_proj if isinstance(block, SwitchGLU) else block.fc1
    return proj.input_dims


def _routes(rows: int, experts: int, k: int, seed: int) -> mx.array:
    """(1, rows, k) distinct experts per row, as a router's top-k gives them."""
    scores = mx.random.uniform(shape=(rows, experts), key=mx.random.key(seed))
    return mx.argsort(scores, axis=-1)[:, :k].astype(mx.uint32)[None]


def first_divergence(block, widest: int, dtype, k: int, seed: int = 0) -> tuple[int, int] | None:
    """One block: for every width 1..widest, the one call's rows against each row's own call,
    bit for bit. None: all equal; else the (width, row) where they first differ."""
    k = min(k, _num_experts(block))
    x = mx.random.normal((1, widest, _input_dims(block)), key=mx.random.key(seed)).astype(dtype)
    idx = _routes(widest, _num_experts(block), k, seed + 1)
    alone = per_row(block, x, idx)
    mx.eval(alone)
    for width in range(1, widest + 1):
        together = one_call(block, x[:, :width], idx[:, :width])
        mx.eval(together)
        if not bits_equal(together, alone[:, :width]):
            return width, next(row for row in range(width) if not bits_equal(together[:, row], alone[:, row]))
    return None


def prove_one_call(model, widest: int, *, dtype=None, proof_cache=None, strategy: str = "") -> ExpertRowsProof:
    """Prove the one-call form on this model's expert blocks (one block per distinct
    configuration) for widths 1..widest; where a width fails, the form holds for the widths
    below it (0 under 2: per row). `proof_cache` (selftest.ProofCache) keeps the verdict per
    machine, keyed like the self-test."""
    from ..custom.precompile import activation_dtype

    blocks = expert_blocks(model)
    if not blocks or widest < 1:
        return ExpertRowsProof(0, "no expert blocks")
    dtype = dtype or activation_dtype(model)
    parents = dict(model.named_modules())
    configs = {}
    for name, block in blocks:
        configs.setdefault((_config(block), _top_k(model, parents, name)), (name, block))
    key = None
    if proof_cache is not None:
        key = _proof_key(model, widest, dtype, list(configs), proof_cache.model_identity, strategy)
        value = None if proof_cache.fresh else proof_cache.store.get(key)
        if isinstance(value, dict) and isinstance(value.get("one_call_rows"), int) and isinstance(value.get("reason"), str):
            return ExpertRowsProof(value["one_call_rows"], value["reason"], cached=True)
    result = _prove(configs, widest, dtype)
    log.info("%s", result.describe())
    if key is not None:
        proof_cache.store.put(key, {"one_call_rows": result.one_call_rows, "reason": result.reason})
    return result


def _prove(configs: dict, widest: int, dtype) -> ExpertRowsProof:
    proven = widest
    first = None
    for (_, top_k), (name, block) in configs.items():
        # a router's k where the model names it, else a narrow and a wide one
        for k in (top_k,) if top_k else (2, 8):
            where = first_divergence(block, proven, dtype, k)
            if where is not None:
                width, row = where
                proven = width - 1
                first = f"{name}: one call differs from per-row calls at width {width}, row {row} (top-{k})"
                if proven < 2:
                    return ExpertRowsProof(0, first)
        step_done()
    if first is None:
        return ExpertRowsProof(proven, f"proven bit-identical to per-row calls at widths 1..{proven}, "
                                       f"{len(configs)} configuration(s)")
    return ExpertRowsProof(proven, f"proven at widths 1..{proven}; {first}")


def _proof_key(model, widest: int, dtype, configs: list, model_identity: dict, strategy: str) -> dict:
    from ..verdict_cache import environment, function_identity
    from .selftest import kernels_code_version

    return {
        "what": "MoE expert rows in one call",
        "model": model_identity,
        "configs": [repr(c) for c in configs],
        "widest": widest,
        "dtype": str(dtype),
        "strategy": strategy,
        "environment": environment(),
        "code": kernels_code_version(),
        "ops": [function_identity(f) for f in (mx.gather_mm, mx.gather_qmm)],
    }
