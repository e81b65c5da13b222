"""Run one quantized layer on each kernel path the model will take; measure its error.

A probe calls the layer (or a workaround wrapper with the same interface) on fresh
random inputs and compares with a float32 NumPy reference built from the decoded
weight (`reference`). Paths: matmul at decode (M=1), short blocks (M=2..24), the
tiled matrix path (M>=33) and a prompt-sized M; embedding lookups of odd and even row
counts (the gather+dequantize path) plus `as_linear` for tied heads; gather_qmm for
MoE switch layers, unsorted at decode and sorted (mlx-lm sorts from 64 rows) for prompts.
`select(path, rows)` picks which of them run, so the audit can probe some on a slice of
the layer's output rows and others on the whole layer (`kernels/audit/slicing.py`).
`compared` (output rows, `kernels/audit/row_sample.py`) limits the comparison, and so the
reference's decode, to those rows of a large layer; every output must still be finite.
"""
from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..proof_steps import step_done
from .reference import reference_dequantize
from .report import LayerConfig, PathResult

# Max |out - ref| / max |ref| allowed, by (mode family, activation dtype): well above what
# correct kernels give and well below what a kernel fault gives (the errors behind these
# bounds: docs/QUANTIZATION.md, "Tolerances").
TOLERANCE = {
    ("affine", "float32"): 1e-3, ("fp", "float32"): 1e-3,
    ("affine", "float16"): 3e-2, ("fp", "float16"): 1e-2,
    ("affine", "bfloat16"): 1.5e-1, ("fp", "bfloat16"): 5e-2,
}

# CUDA's tiled kernel takes its tile from M, each tile size a kernel of its own: 8 and 24 rows
# run the 16- and 32-row tiles, 33 and 64 the 64-row one.
MATMUL_ROWS = (("decode", 1), ("short", 2), ("short", 5), ("short", 8), ("short", 24),
               ("tiled", 33), ("tiled", 64))
LOOKUP_ROWS = (1, 2, 3, 8, 23)
GATHER_ROWS = (("decode", 1), ("short", 5))
SORTED_GATHER_ROWS = (("sorted tiled", 33), ("sorted prompt", None))  # None: prompt rows
TOP_K = 2


def probe_paths(kind: str, prompt_rows: int) -> list[tuple[str, int]]:
    """(path, rows) of every probe of a layer kind, in the order `probe` runs them."""
    matmul = [(name, rows) for name, rows in (*MATMUL_ROWS, ("prompt", prompt_rows))]
    if kind == "linear":
        return [(f"matmul {name}", rows) for name, rows in matmul]
    if kind == "embedding":
        return ([(f"lookup {'odd' if r % 2 else 'even'}", r) for r in LOOKUP_ROWS]
                + [(f"as_linear {name}", rows) for name, rows in matmul])
    return [(f"gather {name}", rows or prompt_rows) for name, rows in
            (*GATHER_ROWS, *SORTED_GATHER_ROWS)]


def tolerance(mode: str, dtype: str) -> float:
    return TOLERANCE[("affine" if mode == "affine" else "fp", dtype)]


def layer_kind(module: nn.Module) -> str | None:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    if isinstance(module, nn.QuantizedEmbedding):
        return "embedding"
    if isinstance(module, nn.QuantizedLinear):
        return "linear"
    if isinstance(module, QuantizedSwitchLinear):
        return "switch"
    return None


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def describe(module: nn.Module, kind: str, model_dtype: mx.Dtype) -> LayerConfig:
    # Affine layers compute in their scales' dtype; fp-mode scales are uint8 and the
    # activations come from the rest of the model.
    scales = module["scales"]
    dtype = scales.dtype if mx.issubdtype(scales.dtype, mx.floating) else model_dtype
    weight = module["weight"]
    dense_in = weight.shape[-1] * 32 // module.bits
    return LayerConfig(kind=kind, shape=(*weight.shape[:-1], dense_in), mode=module.mode,
                       bits=module.bits, group_size=module.group_size,
                       dtype=dtype_name(dtype), has_bias="bias" in module)


def reference_weight(module: nn.Module, rows: np.ndarray | None = None) -> np.ndarray:
    """The decoded weight of `module`, only its output `rows` (None: all): a quantized weight's
    rows decode independently (groups run along K)."""
    arrays = [module["weight"], module["scales"], module.get("biases")]
    if rows is not None:
        # int32, as the served lookups take: on CUDA each index dtype is a kernel of its own
        index, axis = mx.array(rows, dtype=mx.int32), module["weight"].ndim - 2
        arrays = [None if a is None else mx.take(a, index, axis=axis) for a in arrays]
    return reference_dequantize(*arrays, module.mode, module.bits, module.group_size)


def _bias(module, cfg: LayerConfig, compared: np.ndarray | None) -> np.ndarray | None:
    if not cfg.has_bias:
        return None
    bias = np.array(module["bias"].astype(mx.float32))
    return bias if compared is None else bias[..., compared]


def _round_to(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return a.astype(np.float32)
    return np.array(mx.array(a).astype(getattr(mx, dtype)).astype(mx.float32))


def _rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    if got.shape != ref.shape:
        raise ValueError(f"output shape {got.shape} != expected {ref.shape}")
    scale = float(np.abs(ref).max()) or 1.0
    err = np.abs(got - ref)
    return float("inf") if not np.isfinite(err).all() else float(err.max()) / scale


Select = Callable[[str, int], bool]


def _all(path: str, rows: int) -> bool:
    return True


def _compared_part(out: mx.array, compared: np.ndarray | None) -> np.ndarray:
    """The output's compared rows, as float32 on the host (picked there: a gather on the device
    would be a kernel of the output's dtype that serving never takes, compiled for the audit
    alone on CUDA)."""
    got = np.array(out.astype(mx.float32))
    if compared is None:
        return got
    # the rows not compared must still hold numbers: a NaN or inf anywhere fails the path
    picked = got[..., compared]
    return picked if np.isfinite(got).all() else np.full_like(picked, np.nan)


def _measure(path: str, rows: int, tol: float, run: Callable[[], tuple[mx.array, np.ndarray]],
             out_rows: int, compared: np.ndarray | None = None) -> PathResult:
    """One path's probe, then a step (kernels/proof_steps.py): an audit on the engine thread
    serves requests between probes, not only between configurations (on a fresh GPU each probe
    compiles kernels, and requests at audited widths need not wait for a configuration's all)."""
    sampled = None if compared is None else len(compared)
    try:
        out, ref = run()
        result = PathResult(path, rows, _rel_error(_compared_part(out, compared), ref), tol, out_rows=out_rows, compared_rows=sampled)
    except Exception as exc:  # a kernel that raises is a failing path, not a crash
        result = PathResult(path, rows, None, tol, exception=f"{type(exc).__name__}: {exc}",
                            out_rows=out_rows, compared_rows=sampled)
    step_done()
    return result


def _inputs(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> tuple[mx.array, np.ndarray]:
    x = _round_to(rng.standard_normal(shape).astype(np.float32), dtype)
    return mx.array(x).astype(getattr(mx, dtype)), x


def _matmul_paths(call, w: np.ndarray, bias: np.ndarray | None, cfg: LayerConfig, rng, rows_list,
                  select: Select, out_rows: int, compared: np.ndarray | None,
                  prefix: str = "matmul") -> list[PathResult]:
    tol = tolerance(cfg.mode, cfg.dtype)
    results = []
    for name, rows in rows_list:
        if not select(f"{prefix} {name}", rows):
            continue

        def run(rows=rows):
            x, xn = _inputs(rng, (1, rows, w.shape[1]), cfg.dtype)
            ref = xn @ w.T + (bias if bias is not None else 0.0)
            return call(x), ref
        results.append(_measure(f"{prefix} {name}", rows, tol, run, out_rows, compared))
    return results


def _out_rows(module) -> int:
    return module["weight"].shape[-2]


def probe_linear(module, cfg: LayerConfig, w: np.ndarray, rng, prompt_rows: int,
                 select: Select = _all, compared: np.ndarray | None = None) -> list[PathResult]:
    w = _round_to(w, cfg.dtype)
    rows = (*MATMUL_ROWS, ("prompt", prompt_rows))
    return _matmul_paths(module, w, _bias(module, cfg, compared), cfg, rng, rows, select,
                         _out_rows(module), compared)


def probe_embedding(module, cfg: LayerConfig, w: np.ndarray, rng, prompt_rows: int,
                    select: Select = _all, compared: np.ndarray | None = None) -> list[PathResult]:
    tol = tolerance(cfg.mode, cfg.dtype)
    w = _round_to(w, cfg.dtype)
    n = _out_rows(module)
    results = []
    for rows in LOOKUP_ROWS:
        path = f"lookup {'odd' if rows % 2 else 'even'}"
        if not select(path, rows):
            continue

        def run(rows=rows):
            at = rng.integers(0, w.shape[0], size=(1, rows))  # rows of w: of the sample, if one
            ids = at if compared is None else compared[at]
            # int32 ids, as a prompt's tokens reach the model: the gather kernels served
            return module(mx.array(ids, dtype=mx.int32)), w[at]
        results.append(_measure(path, rows, tol, run, n))
    rows = (*MATMUL_ROWS, ("prompt", prompt_rows))
    return results + _matmul_paths(module.as_linear, w, None, cfg, rng, rows, select, n,
                                   compared, prefix="as_linear")


def _expert_order(rng, experts: int) -> np.ndarray:
    """Every expert once, the last one first, the rest shuffled: a gather probe routes as many
    of them as its rows hold, so each expert's (compared) rows are checked where the rows allow
    and the end of the expert stack always (as the row sample keeps a layer's last rows)."""
    return np.concatenate([[experts - 1], rng.permutation(experts - 1)]).astype(np.int64)


def probe_switch(module, cfg: LayerConfig, w: np.ndarray, rng, prompt_rows: int,
                 select: Select = _all, compared: np.ndarray | None = None) -> list[PathResult]:
    tol = tolerance(cfg.mode, cfg.dtype)
    w = _round_to(w, cfg.dtype)
    experts, _, k = w.shape
    n = _out_rows(module)
    bias = _bias(module, cfg, compared)
    top_k = min(TOP_K, experts)
    results = []

    def ref_rows(xn: np.ndarray, idx: np.ndarray) -> np.ndarray:
        # one product per expert routed: w[idx] would copy an expert's weight for every row
        out = np.empty((len(idx), w.shape[1]), dtype=np.float32)
        for e in np.unique(idx):
            at = idx == e
            out[at] = xn[at] @ w[e].T
        return out + bias[idx] if bias is not None else out

    for name, tokens in GATHER_ROWS:
        if not select(f"gather {name}", tokens):
            continue

        def run(tokens=tokens):
            # SwitchGLU's unsorted layout: x (B, L, 1, 1, K), indices (B, L, top_k).
            x, xn = _inputs(rng, (1, tokens, 1, 1, k), cfg.dtype)
            # consecutive slots of the order: a token's top_k experts are distinct
            slots = np.arange(tokens * top_k).reshape(1, tokens, top_k)
            idx = _expert_order(rng, experts)[slots % experts]
            ref = ref_rows(np.repeat(xn[0, :, 0, 0], top_k, 0), idx.reshape(-1))
            return module(x, mx.array(idx)), ref.reshape(1, tokens, top_k, 1, -1)
        results.append(_measure(f"gather {name}", tokens, tol, run, n, compared))
    for name, tokens in SORTED_GATHER_ROWS:
        tokens = tokens or prompt_rows
        if not select(f"gather {name}", tokens):
            continue

        def run(tokens=tokens):
            # Sorted layout (mlx-lm sorts once indices.size >= 64): x (N, 1, K), sorted ids.
            n = tokens * top_k
            x, xn = _inputs(rng, (n, 1, k), cfg.dtype)
            covered = _expert_order(rng, experts)[:n]
            idx = np.sort(np.concatenate([covered, rng.integers(0, experts, size=n - len(covered))]))
            ref = ref_rows(xn[:, 0], idx)[:, None]
            return module(x, mx.array(idx), sorted_indices=True), ref
        results.append(_measure(f"gather {name}", tokens, tol, run, n, compared))
    return results


PROBES = {"linear": probe_linear, "embedding": probe_embedding, "switch": probe_switch}


def probe(module, cfg: LayerConfig, w: np.ndarray, seed: int, prompt_rows: int,
          select: Select = _all, compared: np.ndarray | None = None) -> list[PathResult]:
    """The paths `select` picks (default all) for `module` (a quantized layer or a wrapper
    standing in for one) whose decoded weight is `w`: all its output rows, or (`compared`
    given) only those rows, in that order."""
    rng = np.random.default_rng(seed)
    return PROBES[cfg.kind](module, cfg, w, rng, prompt_rows, select, compared)
