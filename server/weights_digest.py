"""The weights digest: sha256 over a model directory's config and weight files, hashed once per
set of files rather than once per start.

Hashing reads every weight byte, half of a restart for a large model. The digest is kept in
the verdict cache dir (kernels/verdict_cache.py, `LOCKSTEP_VERDICT_CACHE_DIR`), one JSON file
per model directory, beside the identity of each file it covers: name, size, mtime_ns,
ctime_ns, inode and device (where the platform has no inode, `st_ino` is its file index or 0,
and the rest still separates a changed file). A file whose identity differs from the stored
one (rewritten, replaced, touched) means the directory is hashed again. A file modified within
`RACY_NS` of the hashing is not trusted to its timestamps (a second write in the same clock
tick keeps the mtime), so such a digest is not stored; the identity stored is the one taken
before hashing, so a file changed while being hashed is hashed again at the next start. An
entry that cannot be read or parsed is ignored with a warning and rewritten; writes are
atomic (verdict_cache.write_file).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable

from lockstep.kernels import verdict_cache

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the stored layout or the digest's definition changes
NAMESPACE = "weights"
RACY_NS = 2_000_000_000  # coarser than any file system's timestamp granularity (FAT: 2 s)
_HEX64 = re.compile(r"[0-9a-f]{64}")


def digested_files(root: Path) -> list[Path]:
    """The files the digest covers, in the order they are hashed."""
    return [p for p in sorted(root.glob("*.safetensors")) + [root / "config.json"] if p.is_file()]


def content_digest(files: list[Path]) -> str:
    """sha256 over each file's name then its bytes: the value fingerprints and proofs are keyed by."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def file_identity(path: Path) -> list:
    st = path.stat()  # follows links: a Hugging Face snapshot's files are links to its blobs
    return [path.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _entry_path(root: Path) -> Path:
    name = hashlib.sha256(str(root).encode()).hexdigest()[:32]
    return verdict_cache.default_root() / NAMESPACE / f"{name}.json"


def _stored_digest(entry: Path, root: Path, identity: list) -> str | None:
    data = verdict_cache.read_file(entry, "weights digest")
    if data is None:
        return None
    try:
        stored = json.loads(data.decode("utf-8"))
        digest = stored["sha256"]
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ValueError("sha256 is not 64 hex digits")
        if stored["format"] != FORMAT or stored["dir"] != str(root):
            return None  # another layout, or another directory's entry under a colliding name
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring corrupt weights digest %s: %s", entry, exc)
        return None
    if stored.get("files") != identity:
        log.info("weight files in %s changed since their digest was stored: hashing them again", root)
        return None
    return digest


@lru_cache(maxsize=8)
def weights_digest(model_dir: str) -> str:
    """sha256 over the model directory's config and weight files: from the cache while no
    file's identity changed, else read (once per process either way)."""
    root = Path(model_dir).resolve()
    files = digested_files(root)
    identity = [file_identity(p) for p in files]
    entry = _entry_path(root)
    digest = _stored_digest(entry, root, identity)
    if digest is not None:
        return digest
    started = time.time_ns()
    digest = content_digest(files)
    racy = any(started - mtime_ns < RACY_NS for _, _, mtime_ns, *_ in identity)
    if not racy:  # identity was taken before hashing: a write during it is a changed identity
        record = {"format": FORMAT, "dir": str(root), "files": identity, "sha256": digest}
        verdict_cache.write_file(entry, json.dumps(record, indent=1).encode(), "weights digest")
    return digest


def weights_digest_soon(model_dir: str) -> Callable[[], str]:
    """Start `weights_digest(model_dir)` on a thread of its own (its reads and hashing overlap the
    caller's next work, e.g. the kernel audit); returns what waits for it and gives the digest,
    or raises the thread's error."""
    done: dict = {}

    def work() -> None:
        try:
            done["digest"] = weights_digest(model_dir)
        except Exception as exc:  # raised by the result, in the caller's thread
            done["error"] = exc
    thread = threading.Thread(target=work, name="weights-digest", daemon=True)
    thread.start()

    def result() -> str:
        thread.join()
        if "error" in done:
            raise done["error"]
        return done["digest"]
    return result
