"""lockstep's cache directory (models/cache_dir.py): its private fallback, and a server that
starts and serves when the cache directory cannot be used."""
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lockstep.models import cache_dir
from test_gguf_import import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tmpdir_(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_the_fallback_is_a_private_directory_of_this_user(tmpdir_):
    root = cache_dir.fallback_root()
    assert root == tmpdir_ / f"lockstep-cache-{os.getuid()}"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert cache_dir.fallback_root() == root  # the next start finds its builds there


@pytest.mark.parametrize("planted", ["others may write", "a link", "a file"])
def test_a_fallback_that_is_not_private_is_refused(tmpdir_, planted):
    """A shim found there would be preloaded into the server: nobody else may have put it."""
    path = tmpdir_ / f"lockstep-cache-{os.getuid()}"
    if planted == "others may write":
        path.mkdir()
        path.chmod(0o777)
    elif planted == "a link":
        (tmpdir_ / "elsewhere").mkdir(mode=0o700)
        path.symlink_to(tmpdir_ / "elsewhere")
    else:
        path.write_text("")
    with pytest.raises(OSError, match="not a private directory of this user"):
        cache_dir.fallback_root()


def test_write_atomic_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    target = tmp_path / "f"
    cache_dir.write_atomic(target, b"old")

    def no_space(fd):
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError, match="No space left on device"):
        cache_dir.write_atomic(target, b"new")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f"]


def test_serve_starts_and_serves_with_a_file_where_the_cache_directory_should_be(tmp_path):
    """The shim and the import go to the temporary directory, each said in one line."""
    from openai import OpenAI

    from lockstep.kernels import cpu_blas
    from tests.http_server import free_port, wait_for_health

    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    (tmp_path / "tmp").mkdir()
    env = {**cpu_blas.reference_env(), "XDG_CACHE_HOME": str(blocker), "TMPDIR": str(tmp_path / "tmp"),
           "LOCKSTEP_API_KEYS": ""}
    env.pop("LOCKSTEP_VERDICT_CACHE_DIR", None)  # the verdicts too under the blocked directory
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lockstep.server.cli", "serve", "--model", str(model),
                                 "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_health(proc, f"http://127.0.0.1:{port}", log_path, timeout=300)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        reply = client.completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0)
    finally:
        proc.kill()
        proc.wait()
    assert reply.usage.completion_tokens == 2
    text = log_path.read_text()
    fallback = tmp_path / "tmp" / f"lockstep-cache-{os.getuid()}"
    assert "Traceback" not in text
    said = [line.split(" ", 3)[3] for line in text.splitlines() if str(blocker) in line]
    assert said == [
        f"lockstep.kernels.cpu_blas: cache directory {blocker}/lockstep/cpu_blas: Not a directory; "
        f"building the CPU BLAS shim in {fallback}/cpu_blas instead",
        f"lockstep.models.gguf_import: cache directory unusable, {blocker}/lockstep/models: Not a directory; "
        f"importing tiny.gguf into {fallback}/models instead"]
