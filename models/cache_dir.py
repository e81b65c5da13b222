"""lockstep's on-disk cache: where it is, where to go when it cannot be written, durable writes.

The cache root is platformdirs' user cache dir (on Linux `$XDG_CACHE_HOME/lockstep`, else
`~/.cache/lockstep`): the CPU BLAS shim (`cpu_blas/`) and GGUF imports (`models/`) live there.
A root that is not a directory, is read-only or is full must not end a start: the caller says
in one line which directory and what is wrong (`reason`) and builds under `fallback_root()`.

Files are written to a temporary name beside the target, fsynced, then renamed, and the
directory fsynced: a crash or a full disk leaves the old file or none, never a torn one
that every later start would trip over.
"""
from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path


def user_root() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("lockstep"))


def fallback_root() -> Path:
    """A private per-user directory under the system temp dir (`$TMPDIR`), for a start whose
    cache root cannot be written. Raises OSError where it cannot be had either."""
    root = Path(tempfile.gettempdir()) / f"lockstep-cache-{os.getuid()}"
    try:
        root.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = root.lstat()
    # Someone else's directory (or one others may write) could hold a planted shim we would preload.
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(errno.EPERM, "not a private directory of this user", str(root))
    return root


def make_dirs(path: Path) -> None:
    """mkdir -p; a file in the way is "Not a directory" (mkdir says "File exists")."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path)) from None


def reason(exc: BaseException) -> str:
    """What is wrong, in a few words: "Read-only file system", "No space left on device"."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def fsync_path(path: Path) -> None:
    """Flush a file or a directory (a rename's entry) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """`data` to `path`: a temporary file beside it, fsynced, renamed into place. Raises OSError."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp is not None:
            os.unlink(tmp)
    fsync_path(path.parent)
