"""Load-time audit of a model's quantized kernels, and the patches that route around faults.

    report = audit_model(model)          # probe every distinct quantized-layer config
    apply_workarounds(model, report)     # swap in stand-ins; ModelError if any refused
    print(format_table(report)); summary(report)  # for the CLI and GET /v1/models

Each distinct configuration (kind, shape, mode, bits, group size, dtype, bias) is
probed once, on the first layer that has it, on every path the model will take
(`audit_probes`). A configuration with a failing path (wrong values or an exception)
tries the workarounds in order (`audit_workarounds.WORKAROUNDS`), each probed again on
every path; the first that passes everywhere is the verdict. If none does, the model
is refused, naming the layer and the path.
"""
from __future__ import annotations

import logging
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from kernels import audit_workarounds
from kernels.audit_probes import describe, layer_kind, probe, reference_weight
from kernels.audit_report import (OK, REFUSED, AuditReport, ConfigResult, LayerConfig,
                                  format_table, summary)

__all__ = ["audit_model", "apply_workarounds", "audit_and_patch", "format_table", "summary",
           "AuditReport"]

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


def backend_name() -> str:
    device = mx.default_device()
    return f"mlx {mx.__version__} {device.type.name if hasattr(device.type, 'name') else device}"


def _audit_config(cfg: LayerConfig, layers, seed: int, prompt_rows: int) -> ConfigResult:
    path0, layer = layers[0]
    dense = reference_weight(layer)
    result = ConfigResult(cfg, [p for p, _ in layers], probe(layer, cfg, dense, seed, prompt_rows))
    if not result.failing:
        return result
    for name in audit_workarounds.WORKAROUNDS:
        stand_in = audit_workarounds.build(name, layer, cfg.kind, dense)
        if stand_in is None:
            continue
        attempt = probe(stand_in, cfg, dense, seed + 1, prompt_rows)
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


def audit_model(model: nn.Module, *, seed: int = 0,
                prompt_rows: int = DEFAULT_PROMPT_ROWS) -> AuditReport:
    """Probe every distinct quantized-layer configuration of `model` (see module doc)."""
    start = time.perf_counter()
    configs = [_audit_config(cfg, layers, seed, prompt_rows)
               for cfg, layers in quantized_layers(model).items()]
    report = AuditReport(backend=backend_name(), configs=configs,
                         seconds=time.perf_counter() - start)
    log.info("kernel audit: %d configurations in %.1fs, %d patched, %d refused",
             len(configs), report.seconds, len(report.patched), len(report.refused))
    return report


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
    from models.errors import ModelError

    if report.refused:
        raise ModelError(_refusal(report))
    verdicts = {c.config: c.verdict for c in report.patched}
    swaps = []
    for cfg, layers in quantized_layers(model).items():
        name = verdicts.get(cfg)
        if name is None:
            continue
        for path, layer in layers:
            stand_in = audit_workarounds.build(name, layer, cfg.kind, reference_weight(layer)
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
