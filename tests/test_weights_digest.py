"""The weights digest is hashed once per set of files: a restart with untouched weights reads
none of their bytes, a changed file is hashed again, a damaged cache entry is ignored."""
import hashlib
import json
import os
from pathlib import Path

import pytest

from lockstep.server import weights_digest as wd
from lockstep.server.fingerprint import system_fingerprint

OLD = 1_600_000_000_000_000_000  # an mtime well outside the racy window


def _reference_digest(root: Path) -> str:
    """The digest as `weights_digest` always computed it: names and bytes, sorted shards then config."""
    digest = hashlib.sha256()
    for path in sorted(root.glob("*.safetensors")) + [root / "config.json"]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _write(path: Path, data: bytes, mtime_ns: int = OLD) -> None:
    path.write_bytes(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_VERDICT_CACHE_DIR", str(tmp_path / "verdicts"))
    root = tmp_path / "model"
    root.mkdir()
    _write(root / "config.json", b'{"model_type": "llama"}')
    _write(root / "model-00001-of-00002.safetensors", b"\x01" * 5000)
    _write(root / "model-00002-of-00002.safetensors", b"\x02" * 3000)
    (root / "tokenizer.json").write_text("{}")  # not part of the digest
    wd.weights_digest.cache_clear()
    yield root
    wd.weights_digest.cache_clear()


@pytest.fixture
def hashed(monkeypatch):
    """Which directories' bytes were read: a double around the hashing."""
    calls = []
    real = wd.content_digest

    def counting(files):
        calls.append([p.name for p in files])
        return real(files)

    monkeypatch.setattr(wd, "content_digest", counting)
    return calls


def _restart(model_dir: Path) -> str:
    wd.weights_digest.cache_clear()  # what a new process starts with
    return wd.weights_digest(str(model_dir))


def _fingerprint(model_dir: Path) -> str:
    return system_fingerprint(model_dir, transform="none", strategy="s", limit=8, blas="reference",
                              prefill_chunk=8)


def _entry(model_dir: Path) -> Path:
    (entry,) = (Path(os.environ["LOCKSTEP_VERDICT_CACHE_DIR"]) / wd.NAMESPACE).glob("*.json")
    return entry


def test_an_untouched_restart_reads_no_weight_bytes(model_dir, hashed):
    first = _restart(model_dir)
    assert len(hashed) == 1
    assert _restart(model_dir) == first
    assert _restart(model_dir) == first
    assert len(hashed) == 1  # both restarts answered from the stored digest


def test_the_digest_is_the_one_it_always_was(model_dir, hashed):
    reference = _reference_digest(model_dir)
    assert _restart(model_dir) == reference  # hashed
    assert _restart(model_dir) == reference  # stored
    assert len(hashed) == 1


def test_a_changed_weight_file_changes_the_fingerprint(model_dir, hashed):
    before = _fingerprint(model_dir)
    _write(model_dir / "model-00002-of-00002.safetensors", b"\x03" * 3000, OLD + 1_000_000_000)
    wd.weights_digest.cache_clear()
    after = _fingerprint(model_dir)
    assert after != before
    assert wd.weights_digest(str(model_dir)) == _reference_digest(model_dir)
    assert len(hashed) == 2


@pytest.mark.parametrize("setting, value", [
    ("transform", "q4"), ("strategy", "cpu_kernel"), ("limit", 4), ("blas", "openblas"),
    ("prefill_chunk", 128), ("topology", "tensor/2/ring"), ("kv_pool", "kernel"),
])
def test_every_setting_that_changes_output_bits_changes_the_fingerprint(model_dir, setting, value):
    # the fingerprint keys the prompt cache's disk tier and decides what replay compares
    settings = dict(transform="none", strategy="s", limit=8, blas="reference", prefill_chunk=8)
    base = system_fingerprint(model_dir, **settings)
    assert system_fingerprint(model_dir, **settings) == base  # control: the same settings, the same one
    assert system_fingerprint(model_dir, **{**settings, setting: value}) != base


@pytest.mark.parametrize("change", ["touched", "replaced", "added"])
def test_an_entry_whose_identity_no_longer_matches_is_recomputed(model_dir, hashed, change):
    digest = _restart(model_dir)
    shard = model_dir / "model-00001-of-00002.safetensors"
    if change == "touched":  # same bytes, another mtime
        os.utime(shard, ns=(OLD + 5, OLD + 5))
    elif change == "replaced":  # same bytes and mtime, another file (inode) renamed into place
        _write(model_dir / "new.tmp", shard.read_bytes())
        os.replace(model_dir / "new.tmp", shard)
    else:
        _write(model_dir / "model-extra.safetensors", b"\x04")
    again = _restart(model_dir)
    assert len(hashed) == 2
    assert again == _reference_digest(model_dir)
    assert (again == digest) == (change != "added")
    assert _restart(model_dir) == again  # the recomputed digest is stored in the old one's place
    assert len(hashed) == 2


@pytest.mark.parametrize("damage", ["not json", "truncated", "no sha256", "bad sha256", "a directory"])
def test_a_corrupted_cache_entry_is_ignored(model_dir, hashed, damage, caplog):
    digest = _restart(model_dir)
    entry = _entry(model_dir)
    text = entry.read_text()
    if damage == "not json":
        entry.write_bytes(b"\xff\x00 garbage")
    elif damage == "truncated":
        entry.write_text(text[: len(text) // 2])
    elif damage == "a directory":
        entry.unlink()
        entry.mkdir()
    else:
        record = json.loads(text)
        if damage == "no sha256":
            del record["sha256"]
        else:
            record["sha256"] = "0" * 63 + "g"
        entry.write_text(json.dumps(record))
    with caplog.at_level("WARNING"):
        assert _restart(model_dir) == digest
    assert len(hashed) == 2
    assert any("weights digest" in r.getMessage() for r in caplog.records)
    if damage != "a directory":  # rewritten whole: the next restart reads nothing again
        assert _restart(model_dir) == digest
        assert len(hashed) == 2


def test_a_forged_digest_for_the_same_files_is_what_a_restart_trusts(model_dir, hashed):
    """The stored digest is what the restart uses: proof that it really reads nothing else."""
    _restart(model_dir)
    entry = _entry(model_dir)
    record = json.loads(entry.read_text())
    record["sha256"] = "a" * 64
    entry.write_text(json.dumps(record))
    assert _restart(model_dir) == "a" * 64
    assert len(hashed) == 1


def test_files_written_within_the_racy_window_are_not_stored(model_dir, hashed):
    """A rewrite in the same clock tick keeps the mtime: a just-written file's digest is not kept."""
    shard = model_dir / "model-00001-of-00002.safetensors"
    shard.write_bytes(b"\x05" * 5000)  # mtime: now
    _restart(model_dir)
    _restart(model_dir)
    assert len(hashed) == 2
    os.utime(shard, ns=(OLD, OLD))
    _restart(model_dir)
    _restart(model_dir)
    assert len(hashed) == 3


def test_files_that_change_while_hashed_are_hashed_again(model_dir, monkeypatch):
    calls = []
    real = wd.content_digest

    def racing_writer(files):
        calls.append(1)
        digest = real(files)
        if len(calls) == 1:  # the weights change under the first hashing
            _write(model_dir / "config.json", b'{"model_type": "qwen2"}', OLD + 7)
        return digest

    monkeypatch.setattr(wd, "content_digest", racing_writer)
    _restart(model_dir)
    assert _restart(model_dir) == _reference_digest(model_dir)
    assert len(calls) == 2


def test_an_unwritable_cache_still_gives_the_digest(model_dir, monkeypatch, hashed):
    blocked = model_dir.parent / "blocked"
    blocked.write_text("a file where the cache directory should be")
    monkeypatch.setenv("LOCKSTEP_VERDICT_CACHE_DIR", str(blocked))
    assert _restart(model_dir) == _reference_digest(model_dir)
    assert _restart(model_dir) == _reference_digest(model_dir)
    assert len(hashed) == 2


def test_the_digest_soon_is_the_digest_and_an_error_of_its_thread_is_raised_by_its_result(
        model_dir, monkeypatch, tmp_path):
    assert wd.weights_digest_soon(str(model_dir))() == _reference_digest(model_dir)
    wd.weights_digest.cache_clear()
    monkeypatch.setenv("LOCKSTEP_VERDICT_CACHE_DIR", str(tmp_path / "no digest stored"))

    def unreadable(files):
        raise OSError("unreadable")
    monkeypatch.setattr(wd, "content_digest", unreadable)
    with pytest.raises(OSError, match="unreadable"):
        wd.weights_digest_soon(str(model_dir))()


def test_a_served_model_is_hashed_while_its_kernels_are_audited(tmp_path, monkeypatch):
    """`build_runtime` starts the digest when the model is loaded: the audit waits here (up to
    10 s) for the hashing to begin, which only a digest on a thread of its own does meanwhile."""
    import threading

    import lockstep.kernels.audit as audit
    from lockstep.server.runtime import Options, build_runtime
    from tests.synthetic import build_llama_dir, write_tiny_tokenizer

    monkeypatch.setenv("LOCKSTEP_VERDICT_CACHE_DIR", str(tmp_path / "verdicts"))
    path = build_llama_dir(tmp_path / "affine", q_mode="affine", hidden=256, intermediate=512, heads=4)
    write_tiny_tokenizer(path)
    hashing, overlapped = threading.Event(), []
    real_audit, real_content = audit.audit_and_patch, wd.content_digest

    def audit_and_patch(*args, **kwargs):
        overlapped.append(hashing.wait(10))
        return real_audit(*args, **kwargs)

    def content(files):
        hashing.set()
        return real_content(files)
    monkeypatch.setattr(audit, "audit_and_patch", audit_and_patch)
    monkeypatch.setattr(wd, "content_digest", content)
    wd.weights_digest.cache_clear()
    try:
        runtime = build_runtime(Options(model=str(path)))
    finally:
        wd.weights_digest.cache_clear()
    assert overlapped == [True] and runtime.deployment.model_digest == _reference_digest(path)
