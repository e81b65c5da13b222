"""The verdict cache in a directory that cannot be written: one line, and the start goes on."""
import errno
import os
import tempfile
from pathlib import Path

import pytest

from lockstep.kernels import verdict_cache
from lockstep.kernels.verdict_cache import VerdictCache


@pytest.fixture
def first_failure_unsaid(monkeypatch):
    monkeypatch.setattr(verdict_cache, "_write_failure_said", False, raising=False)


def _refusing_writes_under(root: Path, code: int, monkeypatch) -> None:
    """A double for a read-only or full file system under `root` (root may write anywhere)."""
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).is_relative_to(root):
            raise OSError(code, os.strerror(code), str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


@pytest.mark.parametrize("problem, what", [("not a directory", "Not a directory"),
                                           ("read-only", "Read-only file system"),
                                           ("full", "No space left on device")])
def test_an_unwritable_verdict_dir_is_one_line(tmp_path, problem, what, first_failure_unsaid, monkeypatch, caplog):
    root = tmp_path / "verdicts"
    if problem == "not a directory":
        root.write_text("a file where the cache directory should be")
    else:
        _refusing_writes_under(root, errno.EROFS if problem == "read-only" else errno.ENOSPC, monkeypatch)
    with caplog.at_level("WARNING", logger="lockstep.kernels.verdict_cache"):
        for namespace in ("audit", "selftest"):
            cache = VerdictCache(namespace, root=root)
            for n in range(3):
                assert cache.get({"n": n}) is None
                cache.put({"n": n}, {"ok": True})
    (record,) = caplog.records
    assert record.getMessage().startswith(f"could not write cache file {root / 'audit'}/")
    assert f": {what}; startup verdicts are not kept" in record.getMessage()


def test_a_writable_verdict_dir_keeps_verdicts(tmp_path):
    cache = VerdictCache("audit", root=tmp_path)
    cache.put({"n": 1}, {"ok": True})
    assert cache.get({"n": 1}) == {"ok": True}
