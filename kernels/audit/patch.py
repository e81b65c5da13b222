"""Load-time audit of a model's quantized kernels, and the patches that route around faults.

    report = audit_model(model)          # probe every distinct quantized-layer config
    apply_workarounds(model, report)     # swap in stand-ins; ModelError if any refused
    print(format_table(report)); summary(report)  # for the CLI and GET /v1/models
    audit_model(model, cache=audit_verdict_cache())  # re-use this machine's verdicts

Each distinct configuration (kind, shape, mode, bits, group size, dtype, bias) is
probed once, on the first layer that has it, on every path the model will take
(`probes`; an embedding's `as_linear` only where it is the head: `untaken_paths`). A
configuration with a failing path (wrong values or an exception) tries the workarounds in
order (`workarounds.WORKAROUNDS`), each probed again on every path; the first that passes
everywhere is the verdict. If none does, the model
is refused, naming the layer and the path.

Probes run on a slice of the layer's output rows, exact because quantization groups run
along K; a path whose kernel choice depends on N on this backend runs on the whole
layer as well (`slicing`, which says which and why), compared with the reference on a fixed
sample of its rows (`row_sample`: the reference decodes only those). With a `VerdictCache` a
configuration's result is stored per machine and re-used (`kernels.verdict_cache`).
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .. import verdict_cache
from ..verdict_cache import VerdictCache, code_version, environment, function_identity
from . import probes, reference, row_sample, slicing, widths, workarounds
from . import report as report_module
from .probes import describe, layer_kind, probe, probe_paths, reference_weight
from .row_sample import compared_rows
from .report import (OK, REFUSED, AuditReport, ConfigResult, LayerConfig, PathResult,
                     format_table, summary)
from .slicing import as_mlx_runs_it, backend_kind, full_size, sliced_layer, sliced_rows
from .widths import STAGES, stage_of
from ..proof_steps import step_done

__all__ = ["audit_model", "apply_workarounds", "audit_and_patch", "format_table", "summary",
           "AuditReport", "merge_reports", "patch_config"]

log = logging.getLogger(__name__)

DEFAULT_PROMPT_ROWS = 96


def model_float_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of the model's dense float parameters (norms): its activation dtype."""
    for _, a in tree_flatten(model.parameters()):
        if mx.issubdtype(a.dtype, mx.floating):
            return a.dtype
    return mx.float32


def quantized_layers(model: nn.Module) -> dict[LayerConfig, list[tuple[str, nn.Module]]]:
    """Quantized layers grouped by configuration, in model order."""
    dtype = model_float_dtype(model)
    groups: dict[LayerConfig, list[tuple[str, nn.Module]]] = {}
    for path, module in model.named_modules():
        kind = layer_kind(module)
        if kind is not None:
            groups.setdefault(describe(module, kind, dtype), []).append((path, module))
    for layers in groups.values():
        layers.sort(key=lambda pm: pm[0])
    return groups


def untaken_paths(model: nn.Module, cfg: LayerConfig) -> tuple[str, ...]:
    """Path prefixes of `cfg` the model never calls: an embedding's `as_linear` where the model
    has its own head (mlx-lm builds `lm_head` only when the embeddings are not tied)."""
    args = getattr(model, "args", None)
    own_head = (getattr(args, "tie_word_embeddings", True) is False
                and isinstance(getattr(model, "lm_head", None), nn.Module))
    return ("as_linear",) if cfg.kind == "embedding" and own_head else ()


def backend_name() -> str:
    device = mx.default_device()
    return f"mlx {mx.__version__} {device.type.name if hasattr(device.type, 'name') else device}"


def _probe_every_path(layer, cfg: LayerConfig, seed: int, prompt_rows: int, backend: str,
                      workaround: str | None = None, stages=STAGES,
                      untaken: tuple[str, ...] = (), widths=None) -> list[PathResult] | None:
    """Every path of `stages` (kernels/audit/widths.py) of `layer` (or of its `workaround`
    stand-in; None: not applicable): on a slice of its output rows, and on the whole layer
    where `full_size` says so, that one compared on the rows `compared_rows` picks. `widths`
    (a set of row counts) keeps only the paths of those widths (kernels/audit/compile_ahead.py)."""
    layer = as_mlx_runs_it(layer)
    n = cfg.shape[-2]
    rows = sliced_rows(n, backend)
    staged = lambda path, r: (stage_of(path, r) in stages and not path.startswith(untaken)
                              and (widths is None or r in widths))
    on_whole = lambda path, r: full_size(path, r, n, backend)
    parts = [(sliced_layer(layer, rows) if rows < n else layer,
              lambda path, r: staged(path, r) and not on_whole(path, r))]
    if rows < n:
        parts.append((layer, lambda path, r: staged(path, r) and on_whole(path, r)))
    paths = [(p, r) for p, r in probe_paths(cfg.kind, prompt_rows) if staged(p, r)]
    results = []
    for part, select in parts:
        if not any(select(p, r) for p, r in paths):
            continue
        compared = compared_rows(part["weight"].shape[-2])
        dense = reference_weight(part, compared)
        if workaround is None:
            target = part
        else:  # the dequantized stand-in serves every row: it needs them all decoded
            whole = (reference_weight(part) if compared is not None and workaround == "dequantized"
                     else dense)
            target = workarounds.build(workaround, part, cfg.kind, whole)
        if target is None:
            return None
        results += probe(target, cfg, dense, seed, prompt_rows, select, compared)
    order = {key: i for i, key in enumerate(paths)}
    return sorted(results, key=lambda p: order[(p.path, p.rows)])


def _audit_config(cfg: LayerConfig, layers, seed: int, prompt_rows: int, stages=STAGES,
                  untaken: tuple[str, ...] = ()) -> ConfigResult:
    """The kernel on the paths of `stages` (less those `untaken`); where one fails, the
    workarounds on every such path (a stand-in replaces the layer at every width), so a verdict
    other than OK is final."""
    path0, layer = layers[0]
    backend = backend_kind()
    result = ConfigResult(cfg, [p for p, _ in layers],
                          _probe_every_path(layer, cfg, seed, prompt_rows, backend, stages=stages,
                                            untaken=untaken))
    if not result.failing:
        return result
    for name in workarounds.WORKAROUNDS:
        attempt = _probe_every_path(layer, cfg, seed + 1, prompt_rows, backend, workaround=name,
                                    untaken=untaken)
        if attempt is None:
            continue
        result.attempts.append((name, attempt))
        if all(p.ok for p in attempt):
            result.verdict = name
            break
    else:
        result.verdict = REFUSED
    failed = ", ".join(f"{p.path} (rows {p.rows})" for p in result.failing)
    log.warning("quantized kernel FAILED for %s [%s, %d layers] on %s -> %s",
                path0, cfg.label(), len(layers), failed, result.verdict)
    return result


def audit_verdict_cache(root=None) -> VerdictCache:
    """This machine's store of audit verdicts (under the user cache dir unless `root`)."""
    return VerdictCache("audit", root)


def verdict_key(cfg: LayerConfig, seed: int, prompt_rows: int, stages=STAGES,
                untaken: tuple[str, ...] = ()) -> dict:
    """Everything a configuration's verdict on the paths of `stages` (less those `untaken`)
    depends on (see kernels/verdict_cache.py)."""
    return {
        "what": "quantized kernel audit",
        "stages": list(stages),
        "untaken": list(untaken),
        "config": {"kind": cfg.kind, "shape": list(cfg.shape), "mode": cfg.mode,
                   "bits": cfg.bits, "group_size": cfg.group_size, "dtype": cfg.dtype,
                   "transpose": cfg.transpose, "has_bias": cfg.has_bias},
        "seed": seed,
        "prompt_rows": prompt_rows,
        "environment": environment(),
        "code": code_version(sys.modules[__name__], verdict_cache, probes, reference,
                             report_module, row_sample, slicing, workarounds, widths),
        "workarounds": list(workarounds.WORKAROUNDS),
        "ops": [function_identity(f) for f in (mx.quantized_matmul, mx.dequantize, mx.gather_qmm)],
    }


def _paths_to_json(paths: list[PathResult]) -> list[dict]:
    return [dict(p.__dict__) for p in paths]


def _paths_from_json(rows) -> list[PathResult]:
    return [PathResult(**r) for r in rows]


def result_to_json(c: ConfigResult) -> dict:
    return {"verdict": c.verdict, "paths": _paths_to_json(c.paths),
            "attempts": [[name, _paths_to_json(r)] for name, r in c.attempts]}


def result_from_json(cfg: LayerConfig, layers: list[str], value: dict) -> ConfigResult:
    """A cached verdict; ValueError/TypeError/KeyError when it is not a well-formed one."""
    verdict = value["verdict"]
    if verdict not in (OK, REFUSED, *workarounds.WORKAROUNDS):
        raise ValueError(f"unknown verdict {verdict!r}")
    result = ConfigResult(cfg, layers, _paths_from_json(value["paths"]),
                          [(str(n), _paths_from_json(r)) for n, r in value["attempts"]], verdict)
    chosen = result.accepted
    if ((verdict == OK) != (not result.failing)
            or (verdict not in (OK, REFUSED) and not (chosen and all(p.ok for p in chosen)))):
        raise ValueError("verdict does not match its path results")
    return result


def _cached(cache: VerdictCache, key: dict, cfg: LayerConfig, layers) -> ConfigResult | None:
    value = cache.get(key)
    if value is None:
        return None
    try:
        return result_from_json(cfg, [p for p, _ in layers], value)
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("ignoring malformed cached audit verdict for %s: %s", cfg.label(), exc)
        return None


def audit_model(model: nn.Module, *, seed: int = 0, prompt_rows: int = DEFAULT_PROMPT_ROWS,
                cache: VerdictCache | None = None, fresh: bool = False, stages=STAGES, defer=(),
                on_result: Callable[[ConfigResult, list], None] | None = None) -> AuditReport:
    """Probe every distinct quantized-layer configuration of `model` (see module doc) on the
    paths of `stages` (kernels/audit/widths.py), in their order.

    cache: verdicts are looked up there (unless `fresh`) and stored there after probing.
    defer: stages probed only where the cache has their verdict; the others are left for a
    later `audit_model(model, stages=report.deferred)` (`merge_reports`). A configuration given
    a workaround in an earlier stage is not probed in later ones (its stand-in was probed on
    every path), so its table lacks the kernel's later paths.
    on_result: called with each configuration's result of a stage and its layers as soon as
    it is in (probed or cached), before `step_done` lets the caller's other work run (a workaround applied there is in
    place before any of it).
    """
    start = time.perf_counter()
    configs, cached, deferred = [], 0, set()
    # The stages audited now together (one verdict, one reference decode of each layer); each
    # deferred stage apart, its verdict cached as the later audit of that stage looks it up.
    units = [unit for unit in [tuple(s for s in stages if s not in defer)] + [(s,) for s in stages if s in defer]
             if unit]
    for cfg, layers in quantized_layers(model).items():
        result, from_cache = None, True
        untaken = untaken_paths(model, cfg)
        for unit in units:
            if result is not None and result.verdict != OK:
                break  # a workaround or refusal is judged on every path already
            key = verdict_key(cfg, seed, prompt_rows, unit, untaken) if cache is not None else None
            part = _cached(cache, key, cfg, layers) if cache is not None and not fresh else None
            if part is None and set(unit) <= set(defer):
                deferred.update(unit)
                from_cache = False
                continue
            probed = part is None
            if probed:
                from_cache = False
                part = _audit_config(cfg, layers, seed, prompt_rows, unit, untaken)
                if cache is not None:
                    cache.put(key, result_to_json(part))
            if on_result is not None:
                on_result(part, layers)
            if probed:
                step_done()
            result = part if result is None else merge_results(result, part)
        if result is None:
            continue
        cached += from_cache
        configs.append(result)
    report = AuditReport(backend=backend_name(), configs=configs,
                         seconds=time.perf_counter() - start, cached=cached,
                         deferred=tuple(s for s in stages if s in deferred))
    log.info("kernel audit%s: %d configurations in %.1fs (%d from the audit cache), "
             "%d patched, %d refused%s", "" if tuple(stages) == STAGES else f" ({', '.join(stages)})",
             len(configs), report.seconds, cached, len(report.patched), len(report.refused),
             f"; left for after serving starts: {', '.join(report.deferred)}" if report.deferred else "")
    return report


def _path_order(cfg: LayerConfig, prompt_rows: int):
    order = {key: i for i, key in enumerate(probe_paths(cfg.kind, prompt_rows))}
    return lambda p: order.get((p.path, p.rows), len(order))


def merge_results(earlier: ConfigResult, later: ConfigResult) -> ConfigResult:
    """One configuration's results of two stages as one: the paths of both (a path probed
    again is the later one's), the later verdict and attempts (a verdict other than OK is
    final, judged on every path)."""
    paths = {(p.path, p.rows): p for p in earlier.paths}
    paths.update({(p.path, p.rows): p for p in later.paths})
    ordered = sorted(paths.values(), key=_path_order(earlier.config, max(
        [p.rows for p in paths.values() if p.path.endswith("prompt")] or [DEFAULT_PROMPT_ROWS])))
    if earlier.verdict != OK:
        return ConfigResult(earlier.config, earlier.layers, ordered, earlier.attempts, earlier.verdict)
    return ConfigResult(earlier.config, earlier.layers, ordered, later.attempts, later.verdict)


def merge_reports(earlier: AuditReport, later: AuditReport) -> AuditReport:
    """A report of the stages `earlier` deferred (`later`: run on the model `earlier` patched,
    so on its unpatched configurations) merged into it."""
    by_config = {c.config: c for c in later.configs}
    configs = [merge_results(c, by_config[c.config]) if c.config in by_config else c for c in earlier.configs]
    return AuditReport(backend=earlier.backend, configs=configs, seconds=earlier.seconds + later.seconds,
                       cached=earlier.cached, deferred=later.deferred)


def raise_if_refused(report: AuditReport) -> None:
    """`ModelError` naming each refused configuration's first layer and failing paths."""
    from lockstep.models.errors import ModelError

    if report.refused:
        raise ModelError(_refusal(report))


def _refusal(report: AuditReport) -> str:
    lines = []
    for c in report.refused:
        paths = ", ".join(f"{p.path} rows={p.rows}" for p in c.failing)
        lines.append(f"layer {c.layers[0]} ({c.config.label()}, {len(c.layers)} layers): "
                     f"failing path(s) {paths}; no workaround passed")
    return "quantized kernels failed the audit:\n" + "\n".join(lines)


def apply_workarounds(model: nn.Module, report: AuditReport) -> list[str]:
    """Swap every layer of a patched configuration for its stand-in; returns their paths.

    Raises `ModelError` naming the layer and failing paths if any configuration was
    refused (nothing is patched then).
    """
    raise_if_refused(report)
    verdicts = {c.config: c.verdict for c in report.patched}
    patched = []
    for cfg, layers in quantized_layers(model).items():
        name = verdicts.get(cfg)
        if name is not None:
            patched += patch_config(model, cfg, layers, name)
    return patched


def patch_config(model: nn.Module, cfg: LayerConfig, layers, name: str) -> list[str]:
    """Swap each of one configuration's `layers` for its `name` stand-in; their paths."""
    swaps = []
    for path, layer in layers:
        stand_in = workarounds.build(name, layer, cfg.kind, reference_weight(layer)
                                     if name == "dequantized" else None)
        swaps.append((path, stand_in))
    level = logging.WARNING if name == "dequantized" else logging.INFO
    log.log(level, "workaround %s on %d layers [%s]%s", name, len(layers), cfg.label(),
            " — DEQUANTIZED to float32: slower and larger" if name == "dequantized" else "")
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return [p for p, _ in swaps]


def audit_and_patch(model: nn.Module, **kwargs) -> AuditReport:
    report = audit_model(model, **kwargs)
    apply_workarounds(model, report)
    return report
