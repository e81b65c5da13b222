"""The prompt cache's disk tier: prompt KV in blocks of `BLOCK` tokens, one file each, that a
later process with the same model and guarantee finds again.

A block's key chains the namespace (the deployment's fingerprint and whether rows are
canonical: server/engine/cache/prefix_cache.py `namespace`) with every token id up to the block's
end, so a key names a whole prefix and one file never serves another model, guarantee or
history. A lookup walks a prompt's blocks from the first while their files are known, reading
and verifying each (prompt_cache_file.py): a damaged one is deleted and the walk stops there,
so that prefix is computed again.

Writes go through one writer thread with a bounded queue: the engine hands over evaluated
arrays and never waits (a full queue drops the write, counted in `dropped`). Files are written
atomically (temporary name, fsync, rename: models/cache_dir.py); the directory's bytes are
bounded by evicting the least recently used files.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from lockstep.models.cache_dir import make_dirs, write_atomic
from lockstep.server.engine.cache.prompt_cache_file import DamagedEntry, decode, encode

log = logging.getLogger("lockstep.prompt_cache")

BLOCK = 64  # tokens a file holds; divides every power-of-two prefill chunk from 64 up
SUFFIX = ".safetensors"
QUEUE_ENTRIES = 4  # prompts waiting to be written; more are dropped, never waited for


def block_keys(namespace: str, tokens: list[int], block: int = BLOCK) -> list[str]:
    """The key of each whole block of `tokens`: a hash of the namespace and every token before
    the block's end (chained, so each key costs one block's hashing)."""
    keys, prev = [], hashlib.sha256(namespace.encode()).digest()
    for end in range(block, len(tokens) + 1, block):
        prev = hashlib.sha256(prev + np.asarray(tokens[end - block:end], dtype="<i8").tobytes()).digest()
        keys.append(prev.hex())
    return keys


class DiskPromptCache:
    def __init__(self, root: str | Path, max_bytes: int, block: int = BLOCK, queue_entries: int = QUEUE_ENTRIES):
        self.root = Path(root)
        make_dirs(self.root)
        self.max_bytes = max_bytes
        self.block = block
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self.bytes = 0
        self.blocks_read = 0
        self.blocks_written = 0
        self.dropped = 0  # writes given up: the queue was full
        self.damaged = 0  # files found damaged and deleted
        self._scan()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_entries)
        self._writer = threading.Thread(target=self._write_loop, name="prompt-cache-writer", daemon=True)
        self._writer.start()

    def _scan(self) -> None:
        """The files a previous process left, oldest use first (their mtime is touched on use)."""
        found = []
        for entry in os.scandir(self.root):
            if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime_ns, entry.name[:-len(SUFFIX)], st.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self.bytes += size
        self._evict()

    def _path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    # ------------------------------------------------------------------ reading

    def lookup(self, namespace: str, tokens: list[int], layers: int):
        """The blocks of the longest prefix of `tokens` found intact: (dtype name, [[(keys,
        values)] per layer] per block), NumPy arrays; ([] if none)."""
        blocks: list = []
        dtype = None
        for key in block_keys(namespace, tokens, self.block):
            with self._lock:
                if key not in self._files:
                    break
            try:
                data = self._path(key).read_bytes()
                name, pairs = decode(data, key, layers, self.block)
                if dtype is not None and (name != dtype or pairs[0][0].shape != blocks[0][0][0].shape):
                    raise DamagedEntry("a block unlike the blocks before it")
            except (OSError, DamagedEntry) as exc:
                self._drop(key, exc)
                break
            dtype = name
            blocks.append(pairs)
            self._touch(key)
        self.blocks_read += len(blocks)
        return dtype, blocks

    def _touch(self, key: str) -> None:
        with self._lock:
            if key in self._files:
                self._files.move_to_end(key)
        try:
            os.utime(self._path(key))  # the order a restart's scan finds
        except OSError:
            pass

    def _drop(self, key: str, why: BaseException) -> None:
        if not isinstance(why, FileNotFoundError):
            self.damaged += 1
            log.warning("prompt cache: dropped %s (%s); its prefix is computed again", self._path(key), why)
        with self._lock:
            self.bytes -= self._files.pop(key, 0)
        try:
            self._path(key).unlink()
        except OSError:
            pass

    # ------------------------------------------------------------------ writing

    def submit(self, namespace: str, tokens: list[int], dtype_name: str, layers: list[tuple[np.ndarray, np.ndarray]]) -> bool:
        """Queue the whole blocks of `tokens` for writing; `layers`: (keys, values) per layer
        holding at least those positions (on axis 2), never changed afterwards. False: dropped."""
        if len(tokens) < self.block:
            return False
        try:
            self._queue.put_nowait((namespace, list(tokens), dtype_name, layers))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (at most `timeout` seconds): a stopping server
        keeps its last prompts; False if writes remain."""
        with self._queue.all_tasks_done:
            return self._queue.all_tasks_done.wait_for(lambda: not self._queue.unfinished_tasks, timeout)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                self._write(*item)
            except Exception:  # a full or read-only disk: this prompt is not kept, serving goes on
                log.warning("prompt cache: a write failed", exc_info=True)
            finally:
                self._queue.task_done()

    def _write(self, namespace: str, tokens: list[int], dtype_name: str, layers) -> None:
        for i, key in enumerate(block_keys(namespace, tokens, self.block)):
            with self._lock:
                known = key in self._files
            if known:
                self._touch(key)
                continue
            lo, hi = i * self.block, (i + 1) * self.block
            data = encode(key, dtype_name, [(k[:, :, lo:hi, :], v[:, :, lo:hi, :]) for k, v in layers])
            if len(data) > self.max_bytes:
                return
            write_atomic(self._path(key), data)
            with self._lock:
                self._files[key] = len(data)
                self.bytes += len(data)
                self.blocks_written += 1
            self._evict()

    def _evict(self) -> None:
        while True:
            with self._lock:
                if self.bytes <= self.max_bytes or not self._files:
                    return
                key, size = self._files.popitem(last=False)
                self.bytes -= size
            try:
                self._path(key).unlink()
            except OSError:
                pass

    def stats(self) -> dict:
        return {"dir": str(self.root), "bytes": self.bytes, "max_bytes": self.max_bytes, "files": len(self._files),
                "blocks_read": self.blocks_read, "blocks_written": self.blocks_written,
                "dropped": self.dropped, "damaged": self.damaged}
