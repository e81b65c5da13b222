"""Load a model spec into memory: mlx-lm module + tokenizer + the facts the server needs."""
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockstep.models.embedded import MODEL_NAME as EMBEDDED_NAME
from lockstep.models.errors import ModelError
from lockstep.models.resolve import DEFAULT_SPEC, resolve_model, resolve_weights

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


def _weights_label(config: dict) -> str:
    if "lockstep" in config:  # our GGUF import records its format
        return config["lockstep"]["weights"]
    quant = config.get("quantization")
    if quant:
        return f"{quant.get('mode', 'affine')}{quant.get('bits', '')}"
    return config.get("torch_dtype") or config.get("dtype") or "as stored"


def load_model(spec: str = DEFAULT_SPEC, weights: str = "auto") -> LoadedModel:
    """Resolve `spec` (see `resolve_model`) and load it with mlx-lm."""
    from mlx_lm.utils import load  # heavy import; keep `models` cheap to import

    start = time.perf_counter()
    fmt = resolve_weights(weights)
    path = resolve_model(spec, fmt)
    try:
        model, tokenizer, config = load(str(path), return_config=True)
    except Exception as exc:  # mlx-lm raises FileNotFoundError/ValueError/KeyError variously
        raise ModelError(f"{path}: mlx-lm could not load this model ({type(exc).__name__}: {exc})") from exc
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
