"""Load a model spec into memory: mlx-lm module + tokenizer + the facts the server needs."""
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockstep.models.embedded import MODEL_NAME as EMBEDDED_NAME
from lockstep.models.errors import ModelError
from lockstep.models.resolve import DEFAULT_SPEC, gguf_source, resolve_model, resolve_weights

log = logging.getLogger(__name__)

FALLBACK_CONTEXT_LENGTH = 2048  # only when neither config nor tokenizer states one


@dataclass
class LoadedModel:
    model: Any  # mlx.nn.Module from mlx-lm
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    path: Path
    name: str  # id served in /v1/models
    context_length: int
    eos_token_ids: set[int] = field(default_factory=set)
    load_seconds: float = 0.0
    weights: str = ""


def _served_name(spec: str, path: Path) -> str:
    return served_name(spec)


def served_name(spec: str) -> str:
    """The id a model spec is served as, known before it loads."""
    if spec == DEFAULT_SPEC:
        return EMBEDDED_NAME
    source = Path(spec).expanduser()
    return source.stem if source.is_file() else source.resolve().name


def _context_length(config: dict, tokenizer) -> int:
    for cfg in (config, config.get("text_config") or {}):
        if cfg.get("max_position_embeddings"):
            return int(cfg["max_position_embeddings"])
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10_000_000:  # HF uses a huge sentinel for "unset"
        return limit
    log.warning("no context length in config or tokenizer; assuming %d", FALLBACK_CONTEXT_LENGTH)
    return FALLBACK_CONTEXT_LENGTH


def quantization_label(quant: dict) -> str:
    """An mlx-lm `quantization` entry in words: "affine 4-bit g64"; the mx/nv float formats
    name their bit count already ("nvfp4 g16")."""
    mode = quant.get("mode", "affine")
    bits, group = quant.get("bits"), quant.get("group_size")
    label = mode if mode[-1:].isdigit() or bits is None else f"{mode} {bits}-bit"
    return f"{label} g{group}" if group else label


def _weights_label(config: dict) -> str:
    if "lockstep" in config:  # our GGUF import records its format
        return config["lockstep"]["weights"]
    quant = config.get("quantization")
    if quant:
        return quantization_label(quant)
    return config.get("torch_dtype") or config.get("dtype") or "as stored"


def _load_dir(path: Path):
    from mlx_lm.utils import load  # heavy import; keep `models` cheap to import

    try:
        return load(str(path), return_config=True)
    except Exception as exc:  # mlx-lm raises FileNotFoundError/ValueError/KeyError variously
        raise ModelError(f"{path}: mlx-lm could not load this model ({type(exc).__name__}: {exc})") from exc


def load_model(spec: str = DEFAULT_SPEC, weights: str = "auto") -> LoadedModel:
    """Resolve `spec` (see `resolve_model`) and load it with mlx-lm.

    A GGUF import that does not load (damaged in the cache in a way `resolve_model` did not
    see) is imported again from its GGUF, once; a second failure names the directory."""
    start = time.perf_counter()
    fmt = resolve_weights(weights)
    path = resolve_model(spec, fmt)
    try:
        model, tokenizer, config = _load_dir(path)
    except ModelError as exc:
        source = gguf_source(spec)
        if source is None:
            raise
        log.warning("%s; re-importing it from %s", exc, source)
        path = resolve_model(spec, fmt, reimport=True)
        try:
            model, tokenizer, config = _load_dir(path)
        except ModelError as again:
            raise ModelError(f"{again} (imported from {source} again just now; delete {path} "
                             "to rule out the cache)") from again
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=path,
        name=_served_name(spec, path),
        context_length=_context_length(config, tokenizer),
        eos_token_ids=set(tokenizer.eos_token_ids),
        load_seconds=time.perf_counter() - start,
        weights=_weights_label(config),
    )
    log.info(
        "loaded model %s (%s weights, context %d) from %s in %.2fs",
        loaded.name, loaded.weights, loaded.context_length, path, loaded.load_seconds,
    )
    return loaded
