"""Turn a model spec into an mlx-lm model directory.

A spec is `"default"` (the embedded SmolLM2 GGUF), a local mlx-lm / Hugging Face
directory (has config.json), or a `.gguf` file (imported into the cache).
"""
import logging
from pathlib import Path

import mlx.core as mx

from lockstep.models.embedded import embedded_gguf_path
from lockstep.models.errors import ModelError
from lockstep.models.gguf_import import WEIGHT_FORMATS, import_gguf

log = logging.getLogger(__name__)

DEFAULT_SPEC = "default"
GGUF_MAGIC = b"GGUF"

# Fastest GGUF import format per backend (README, "The CPU default"): on the CPU float32 wins
# once MLX's float32 matmuls run on OpenBLAS, while on the bundled reference BLAS float32
# loses to q4, so there q4 stays. GPU is not measured here: q4 on the assumption that less
# memory traffic wins there too.
AUTO_WEIGHTS = {"cpu-openblas": "float32", "cpu": "q4", "gpu": "q4"}


def auto_weights() -> str:
    """The weights format that runs fastest on the running backend and CPU BLAS."""
    from lockstep.models.backend import cpu_blas_in_use

    if mx.default_device().type == mx.DeviceType.gpu:
        return AUTO_WEIGHTS["gpu"]
    return AUTO_WEIGHTS["cpu-openblas" if cpu_blas_in_use() == "openblas" else "cpu"]


def resolve_weights(weights: str) -> str:
    if weights == "auto":
        return auto_weights()
    if weights not in WEIGHT_FORMATS:
        raise ModelError(f"unknown weights format {weights!r} (choose auto, {', '.join(WEIGHT_FORMATS)})")
    return weights


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def gguf_source(spec: str) -> Path | None:
    """The GGUF file `spec` is imported from (None: a directory, used as it is)."""
    if spec == DEFAULT_SPEC:
        return embedded_gguf_path()
    path = Path(spec).expanduser()
    return path if path.is_file() and _is_gguf(path) else None


def resolve_model(spec: str, weights: str = "auto", reimport: bool = False) -> Path:
    """mlx-lm directory for `spec`; `weights` picks the format a GGUF is imported in,
    `reimport` replaces a cached import (one that would not load).

    A directory is used as it is (its own config decides quantization).
    """
    fmt = resolve_weights(weights)
    if spec == DEFAULT_SPEC:
        return import_gguf(embedded_gguf_path(), fmt, reimport=reimport)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelError(
            f"{path}: no such file or directory (expected '{DEFAULT_SPEC}', "
            "an mlx-lm model directory or a .gguf file)"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path}: directory has no config.json, so it is not an mlx-lm/HF model directory")
        return path
    if not _is_gguf(path):
        raise ModelError(f"{path}: not a .gguf file or a model directory")
    return import_gguf(path, fmt, reimport=reimport)
