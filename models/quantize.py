"""Quantize a model with mlx-lm's own quantizer (affine, mxfp4, mxfp8, nvfp4).

Two entry points: `quantize_model_in_memory` (for `lockstep serve --quantize MODE`) and
`convert` (for `lockstep convert`, writes an mlx-lm model directory).

What this adds over `mlx_lm.utils.quantize_model`:
- impossible mode/bits/group-size combinations are refused up front with one message;
- every layer mlx-lm silently leaves dense (its predicate skips a weight whose last
  dim does not divide the group size) is reported, in the log and the result;
- nvfp4 weights whose element count is not a multiple of 32 are left dense and
  reported too: MLX 0.32's CPU `mx.quantize` raises a reshape error on them, and
  mlx-lm's loader would hit the same error rebuilding the layer;
- float parameters are cast to float32 first on CPU, so affine scales/biases and the
  whole forward pass are float32 (half precision is much slower on MLX's CPU backend:
  docs/QUANTIZATION.md).
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from tqdm import tqdm

log = logging.getLogger(__name__)

# Same defaults as mlx.nn.quantize / mlx_lm.utils.quantize_model: (group_size, bits).
MODE_DEFAULTS = {
    "affine": (64, 4),
    "mxfp4": (32, 4),
    "mxfp8": (32, 8),
    "nvfp4": (16, 4),
}
# What mx.quantize accepts in MLX 0.32 (probed on every bits x group size).
SUPPORTED_BITS = {"affine": (2, 3, 4, 5, 6, 8), "mxfp4": (4,), "mxfp8": (8,), "nvfp4": (4,)}
SUPPORTED_GROUPS = {"affine": (32, 64, 128), "mxfp4": (32,), "mxfp8": (32,), "nvfp4": (16,)}
Q_MODES = tuple(MODE_DEFAULTS)

# Files of a model dir that are not weights and travel unchanged to a converted dir.
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "tokenizer.model", "chat_template.jinja", "chat_template.json",
               "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json")


@dataclass(frozen=True)
class QuantSpec:
    mode: str
    bits: int
    group_size: int

    def label(self) -> str:
        return f"{self.mode} {self.bits}-bit g{self.group_size}"


@dataclass(frozen=True)
class DenseLayer:
    """A layer quantization left dense, and why."""
    path: str
    shape: tuple[int, ...]
    reason: str


@dataclass
class QuantizeResult:
    model: nn.Module
    config: dict
    spec: QuantSpec
    quantized: list[str] = field(default_factory=list)
    dense: list[DenseLayer] = field(default_factory=list)
    bits_per_weight: float = 0.0
    dst: Path | None = None
    size_bytes: int = 0


def resolve_spec(mode: str, bits: int | None = None, group_size: int | None = None) -> QuantSpec:
    """Fill in mode defaults; `ValueError` naming the bad combination otherwise."""
    if mode not in MODE_DEFAULTS:
        raise ValueError(f"unknown quantization mode {mode!r}; choose one of {', '.join(Q_MODES)}")
    default_group, default_bits = MODE_DEFAULTS[mode]
    bits = default_bits if bits is None else int(bits)
    group_size = default_group if group_size is None else int(group_size)
    if bits not in SUPPORTED_BITS[mode]:
        raise ValueError(f"{mode} cannot store {bits}-bit weights; "
                         f"{mode} supports bits {_alternatives(SUPPORTED_BITS[mode])}")
    if group_size not in SUPPORTED_GROUPS[mode]:
        raise ValueError(f"{mode} does not support group size {group_size}; "
                         f"{mode} supports group size {_alternatives(SUPPORTED_GROUPS[mode])}")
    return QuantSpec(mode, bits, group_size)


def _alternatives(values: tuple[int, ...]) -> str:
    return " or ".join(str(v) for v in values)


def is_quantized_module(module: nn.Module) -> bool:
    return "scales" in module and isinstance(module.get("weight"), mx.array) \
        and module["weight"].dtype == mx.uint32


def _dense_reason(module: nn.Module, spec: QuantSpec) -> str | None:
    """Why this quantizable layer cannot be quantized with `spec` (None: it can)."""
    shape = module.weight.shape
    if shape[-1] % spec.group_size:
        return (f"input dim {shape[-1]} is not a multiple of the group size "
                f"{spec.group_size}")
    if spec.mode == "nvfp4" and module.weight.size % 32:
        return (f"{module.weight.size} weights is not a multiple of 32, which MLX's "
                f"CPU nvfp4 quantize cannot reshape")
    return None


def plan_dense_layers(model: nn.Module, spec: QuantSpec) -> list[DenseLayer]:
    """Every layer with a `to_quantized` that `spec` must leave dense, with the reason."""
    dense = []
    for path, module in model.named_modules():
        if not hasattr(module, "to_quantized") or is_quantized_module(module):
            continue
        reason = _dense_reason(module, spec)
        if reason is not None:
            dense.append(DenseLayer(path, tuple(module.weight.shape), reason))
    return sorted(dense, key=lambda d: d.path)


def cast_float_params(model: nn.Module, dtype=mx.float32) -> None:
    """Cast every floating-point parameter (norms, affine scales/biases) to `dtype`."""
    def cast(a):
        if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating) and a.dtype != dtype:
            return a.astype(dtype)
        return a
    model.update(tree_map(cast, model.parameters()))


def on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def _dequantize_existing(model: nn.Module, config: dict) -> dict:
    from mlx_lm.utils import dequantize_model

    if not any(is_quantized_module(m) for _, m in model.named_modules()):
        return config
    log.warning("model is already quantized; dequantizing it before re-quantizing "
                "(quantization errors add up — prefer a float source)")
    dequantize_model(model)
    config = dict(config)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    return config


def quantize_model_in_memory(
    model: nn.Module,
    config: dict | None,
    q_mode: str,
    bits: int | None = None,
    group_size: int | None = None,
    *,
    float32: bool | None = None,
    progress: bool = True,
) -> QuantizeResult:
    """Quantize `model` in place with mlx-lm's quantizer; returns what was done.

    `config` is the model's config.json dict (None: only the returned config lacks
    it). float32=None means "on the CPU backend": cast float parameters to float32.
    """
    from mlx_lm.utils import compute_bits_per_weight, quantize_model

    spec = resolve_spec(q_mode, bits, group_size)
    config = _dequantize_existing(model, dict(config or {}))
    if float32 if float32 is not None else on_cpu():
        cast_float_params(model, mx.float32)

    dense = plan_dense_layers(model, spec)
    dense_paths = {d.path for d in dense}
    own_predicate = getattr(model, "quant_predicate", None)

    def predicate(path, module):
        # mlx-lm only calls this for layers it would quantize; it skips ones whose last
        # dim does not divide the group size itself. Keep the model's own predicate.
        if path in dense_paths:
            return False
        return own_predicate(path, module) if own_predicate is not None else True

    model, config = quantize_model(model, config, spec.group_size, spec.bits,
                                   mode=spec.mode, quant_predicate=predicate)
    quantized = [p for p, m in model.named_modules() if is_quantized_module(m)]
    for path, module in tqdm(model.named_modules(), desc=f"quantizing ({spec.label()})",
                             disable=not progress, unit="module"):
        mx.eval(module.parameters())
    for d in dense:
        log.warning("LEFT DENSE (not %s): %s %s — %s", spec.label(), d.path, d.shape, d.reason)
    if dense:
        log.warning("%d of %d quantizable layers left dense", len(dense), len(dense) + len(quantized))
    return QuantizeResult(model=model, config=config, spec=spec, quantized=sorted(quantized),
                          dense=dense, bits_per_weight=compute_bits_per_weight(model))


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def convert(
    src: str | Path,
    dst: str | Path,
    q_mode: str,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    *,
    progress: bool = True,
) -> QuantizeResult:
    """Quantize `src` (mlx-lm/HF dir, `.gguf`, or `default`) into the mlx-lm dir `dst`."""
    from mlx_lm.utils import load_model as mlx_load_model, save_config, save_model

    from lockstep.models.errors import ModelError
    from lockstep.models.resolve import resolve_model

    resolve_spec(q_mode, q_bits, q_group_size)  # refuse bad flags before any work
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ModelError(f"{dst}: destination exists and is not empty")
    src_dir = Path(resolve_model(str(src), "float32"))
    try:
        model, config = mlx_load_model(src_dir, lazy=True)
    except (FileNotFoundError, ValueError) as exc:
        raise ModelError(f"{src_dir}: cannot load as an mlx-lm model: {exc}") from exc
    result = quantize_model_in_memory(model, config, q_mode, q_bits, q_group_size,
                                      progress=progress)
    save_model(dst, result.model)
    save_config(dict(result.config), dst / "config.json")
    for name in _SIDE_FILES:
        if (src_dir / name).is_file():
            shutil.copy2(src_dir / name, dst / name)
    _write_dense_note(dst, result)
    result.dst = dst
    result.size_bytes = dir_size(dst)
    log.info("wrote %s: %s, %.2f bits/weight, %.1f MB on disk, %d layers left dense",
             dst, result.spec.label(), result.bits_per_weight, result.size_bytes / 1e6,
             len(result.dense))
    return result


def _write_dense_note(dst: Path, result: QuantizeResult) -> None:
    # A record next to the weights, so a later reader sees what stayed dense and why.
    note = {
        "quantization": result.spec.label(),
        "bits_per_weight": round(result.bits_per_weight, 3),
        "left_dense": [{"path": d.path, "shape": list(d.shape), "reason": d.reason}
                       for d in result.dense],
    }
    (dst / "lockstep_quantization.json").write_text(json.dumps(note, indent=2))

