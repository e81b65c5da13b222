"""Startup verdicts kept per machine: kernel-audit results and self-test proofs.

A restart on the same machine should not redo minutes of probing whose answer cannot have
changed. A verdict is stored under the user cache dir (platformdirs, like the model
import cache; `LOCKSTEP_VERDICT_CACHE_DIR` moves these verdicts, and only them, elsewhere)
in one JSON file per key. The key names everything the verdict depends on: MLX version, backend, device name and
architecture, CPU BLAS, the verdict code's own source (`code_version`), the identity of
the MLX functions probed (so a test double that wraps them never meets a real verdict),
plus what the caller adds (layer configuration; weights digest, strategy and L).

A file that cannot be read, parsed or whose stored key differs from the one asked for
is ignored with a warning; writes go to a temporary file renamed into place, so readers
never see half a verdict; a failed write is a warning too, said once per process (a cache
directory that is a file, read-only or full fails every write alike). The cache never crashes
a start.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from lockstep.models import cache_dir

log = logging.getLogger(__name__)

ROOT_ENV = "LOCKSTEP_VERDICT_CACHE_DIR"
FORMAT = 1  # bump when the stored layout changes


def default_root() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get(ROOT_ENV) or user_cache_dir("lockstep"))


@lru_cache(maxsize=None)
def _source_digest(paths: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).name.encode() + b"\0" + Path(path).read_bytes())
    return digest.hexdigest()[:16]


def files_version(*paths) -> str:
    """Digest of the given files' contents (kernel sources and their loaders)."""
    return _source_digest(tuple(sorted(str(p) for p in paths)))


def code_version(*modules) -> str:
    """Digest of the given modules' source files: any edit to them is a new version."""
    return files_version(*(m.__file__ for m in modules))


def function_identity(fn) -> str:
    """`module.qualname` of a function: the real MLX op, or whatever wraps it now."""
    return f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', repr(fn))}"


def environment() -> dict:
    """What a verdict about kernels depends on, beyond the code: MLX, backend, device, BLAS."""
    from lockstep.kernels import cpu_blas
    from lockstep.kernels.backend_kind import backend_kind

    try:
        info = mx.device_info()
    except Exception:  # an MLX without device_info: the backend still separates verdicts
        info = {}
    return {
        "mlx": mx.__version__,
        "backend": backend_kind(),
        "device": str(info.get("device_name", "")),
        "architecture": str(info.get("architecture", platform.machine())),
        "blas": cpu_blas.describe(),
    }


def read_file(path: Path, what: str) -> bytes | None:
    """A cache file's bytes; None when missing or unreadable (`what` names it in the warning)."""
    try:
        return path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # a file in the directory's place: see write_file
        return None
    except OSError as exc:
        log.warning("ignoring unreadable %s %s: %s", what, path, exc)
        return None


_write_failure_said = False


def write_file(path: Path, data: bytes, what: str) -> None:
    """`data` to `path` atomically (a temporary file beside it, then a rename); a failure is a
    warning naming `what`, never an error: a cache that cannot be written is only slower."""
    global _write_failure_said
    tmp = None
    try:
        cache_dir.make_dirs(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=path.stem[:32], suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        if not _write_failure_said:
            _write_failure_said = True
            log.warning("could not write %s %s: %s; startup verdicts are not kept, so the next start "
                        "works them out again", what, path, cache_dir.reason(exc))
        else:
            log.debug("could not write %s %s: %s", what, path, exc)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


class VerdictCache:
    """JSON verdicts in `root/namespace/<digest of key>.json`."""

    def __init__(self, namespace: str, root: Path | None = None):
        self.dir = (default_root() if root is None else Path(root)) / namespace

    def _file(self, key: dict) -> tuple[Path, str]:
        blob = json.dumps({"format": FORMAT, **key}, sort_keys=True, default=str)
        return self.dir / (hashlib.sha256(blob.encode()).hexdigest()[:32] + ".json"), blob

    def path(self, key: dict) -> Path:
        """The file `key`'s verdict is kept in (for messages)."""
        return self._file(key)[0]

    def get(self, key: dict) -> dict | None:
        """The stored value for `key`, or None (missing, unreadable or not this key)."""
        path, blob = self._file(key)
        data = read_file(path, "cache file")
        if data is None:
            return None
        try:
            stored = json.loads(data.decode("utf-8"))
            if json.dumps(stored["key"], sort_keys=True, default=str) != blob:
                raise ValueError("stored key differs from the one asked for")
            value = stored["value"]
            if not isinstance(value, dict):
                raise ValueError("value is not an object")
            return value
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring corrupt cache file %s: %s", path, exc)
            return None

    def put(self, key: dict, value: dict) -> None:
        path, blob = self._file(key)
        record = json.dumps({"key": json.loads(blob), "value": value}, indent=1, default=str)
        write_file(path, record.encode(), "cache file")
