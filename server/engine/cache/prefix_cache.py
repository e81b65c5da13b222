"""Reuse of prompt KV between requests.

Only KV written by prompt prefill is stored (never decode-written rows). Each entry says how
many of its leading positions hold canonical KV (`canonical_length`): KV written in canonical
chunks (ending on the grid of kernels/invariance/prefill.py) from a canonical start, up to the
start of the writer's last chunk. A deterministic request starts only from those positions and
resumes at a grid point, so it computes the same KV whether its prefix was cached or not. A plain
request starts from the whole common prefix and resumes right there (its bits are not
guaranteed); what it writes after a resume mid-chunk, or in a plain prompt's smaller chunks
(on the CPU, deployment.py `plain_prefill_chunk`), is not canonical, and its entry says so
(on disk, plain requests' KV goes under a namespace of their own).
Two tiers: snapshots in memory (LRU, bounded in entries and bytes) and, optionally, blocks on
disk that outlive the process (server/engine/cache/prompt_cache_disk.py).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from lockstep.kernels.batching.kv_pool import is_pooled
from lockstep.kernels.invariance.prefill import SMALLEST_CHUNK, free_splits, rows_are_canonical


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def copy_prefix(cache: list, length: int) -> list:
    """Fresh KVCaches holding the first `length` positions, in buffers sized as a cold
    prefill leaves them (whole steps of KVCache.step), so later growth follows suit."""
    copies = []
    for layer in cache:
        fresh = KVCache()
        if length:
            size = -(-length // KVCache.step) * KVCache.step
            for name in ("keys", "values"):
                src = getattr(layer, name)
                buf = mx.zeros((*src.shape[:2], size, src.shape[3]), src.dtype)
                buf[..., :length, :] = src[..., :length, :]
                setattr(fresh, name, buf)
            fresh.offset = length
        copies.append(fresh)
    mx.eval([(c.keys, c.values) for c in copies if c.keys is not None])
    return copies


@dataclass
class PrefixHit:
    """Cached KV: `cache` holds `length` positions (a private copy, or with `find(private=False)`
    the entry's own arrays, to be read and copied from, never written), the first
    `canonical_length` of them canonical (see the module's docstring). `whole`: the entry held
    exactly these tokens and is their own cold prefill throughout (a deterministic request with
    the same prompt resumes at its end)."""

    cache: list
    length: int
    canonical_length: int
    whole: bool = False


class PrefixCache:
    """LRU of (prompt tokens -> KV) snapshots of plain KVCache lists or KV pool ranges (stored
    as plain KVCache copies either way), each with its canonical length, at
    most `entries` of them and `max_bytes` of KV, in front of an optional disk tier
    (server/engine/cache/prompt_cache_disk.py).

    Entries belong to a namespace (`namespace`: the deployment's fingerprint and whether rows
    are canonical): a lookup finds only entries of its own. The disk tier keeps, under the
    namespace, only positions whose KV any request would compute the same (`exact_length`);
    under a plain requests' namespace (`disk_namespace`), whatever they prefilled; and only
    where the deployment has a fingerprint to key them by."""

    def __init__(self, entries: int = 4, max_bytes: int | None = None, disk=None):
        self.entries = entries
        self.max_bytes = max_bytes
        self.disk = disk
        self._store: OrderedDict[tuple, tuple] = OrderedDict()  # (namespace, tokens) -> (KV, canonical length, whole)
        self._sizes: dict[tuple, int] = {}
        self.bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.disk_hits = 0

    @staticmethod
    def storable(cache: list) -> bool:
        return all(type(layer) is KVCache for layer in cache) or is_pooled(cache)

    def find(self, tokens: list[int], namespace: str | None = None, *, layers: int = 0,
             canonical_only: bool = False, disk_namespace: str | None = None,
             private: bool = True) -> PrefixHit | None:
        """The cached KV sharing the longest prefix with `tokens`, as a private copy: from
        memory, or from disk where that holds a longer prefix (`layers`: the model's, which a
        disk entry must match). `canonical_only`: only an entry's canonical positions count (a
        request that writes canonical KV must not start from other bits). `disk_namespace`:
        where the disk tier keeps this request's kind of KV (default `namespace`: canonical
        KV; plain requests' under a namespace of their own). An entry of exactly `tokens` that is
        their own cold prefill (`store(whole=True)`) counts whole. `private=False`: the entry's
        own arrays, for a caller that copies the KV into storage of its own (a KV pool range),
        which saves a copy of every layer a hit."""
        take = copy_prefix if private else (lambda cache, length: cache)
        disk_namespace = disk_namespace or namespace
        with self._lock:
            best, best_len, best_whole = None, 0, False
            for key, (_, canonical_length, whole) in self._store.items():
                if key[0] != namespace:
                    continue
                n = _common_prefix(list(key[1]), tokens)
                same = whole and n == len(key[1]) == len(tokens)
                if canonical_only and not same:
                    n = min(n, canonical_length)
                if n > best_len or (same and n == best_len):
                    best, best_len, best_whole = key, n, same
            if best is not None:
                self._store.move_to_end(best)
                snapshot, best_canonical, _ = self._store[best]
        if self.disk is not None and disk_namespace is not None and layers and len(tokens) >= best_len + self.disk.block:
            dtype, blocks = self.disk.lookup(disk_namespace, tokens, layers)
            if len(blocks) * self.disk.block > best_len:
                found = _from_blocks(dtype, blocks)
                length = len(blocks) * self.disk.block
                canonical_length = length if disk_namespace == namespace else 0
                self.disk_hits += 1
                self.hits += 1
                # concurrent and later turns find it in memory
                self._keep(namespace, tokens[:length], found, canonical_length, whole=False)
                return PrefixHit(take(found, length), length, canonical_length)
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        canonical = best_len if best_whole else min(best_canonical, best_len)
        return PrefixHit(take(snapshot, best_len), best_len, canonical, whole=best_whole)

    def store(self, tokens: list[int], cache: list, namespace: str | None = None, *, exact_length: int = 0,
              canonical_length: int | None = None, disk_namespace: str | None = None, whole: bool = False) -> None:
        """Keep a snapshot of `cache`, which holds exactly the KV of `tokens`, the first
        `canonical_length` positions canonical (default: all), and throughout a cold prefill of
        exactly `tokens` where `whole`; its first `exact_length` positions go to the disk tier
        too, under `disk_namespace` (default `namespace`)."""
        canonical_length = len(tokens) if canonical_length is None else min(canonical_length, len(tokens))
        disk_namespace = disk_namespace or namespace
        to_disk = (self.disk is not None and disk_namespace is not None
                   and exact_length >= (self.disk.block if self.disk else 0))
        if not tokens or not self.storable(cache) or (self.entries <= 0 and not to_disk):
            return
        key = (namespace, tuple(tokens))
        with self._lock:
            held = self._store.get(key)
        if held is not None and held[1:] != (canonical_length, whole) and held[1] >= canonical_length \
                and held[2] >= whole:
            return  # the held entry serves every request the new one would, and more: kept
        snapshot = copy_prefix(cache, len(tokens))
        if self.entries > 0:
            self._keep(namespace, tokens, snapshot, canonical_length, whole=whole)
        if to_disk and snapshot[0].keys is not None and snapshot[0].keys.dtype in _DISK_DTYPES:
            dtype, layers = _host_arrays(snapshot)
            self.disk.submit(disk_namespace, tokens[:exact_length], dtype, layers)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (at most `timeout` seconds) for the disk tier's queued writes; False if some remain."""
        return self.disk.flush(timeout) if self.disk is not None else True

    def _keep(self, namespace: str | None, tokens: list[int], snapshot: list, canonical_length: int, *,
              whole: bool) -> None:
        key = (namespace, tuple(tokens))
        size = sum(c.keys.nbytes + c.values.nbytes for c in snapshot if c.keys is not None)
        if self.max_bytes is not None and size > self.max_bytes:
            return
        with self._lock:
            self.bytes -= self._sizes.pop(key, 0)
            self._store[key] = (snapshot, canonical_length, whole)
            self._sizes[key] = size
            self.bytes += size
            self._store.move_to_end(key)
            while len(self._store) > self.entries or (self.max_bytes is not None and self.bytes > self.max_bytes):
                old, _ = self._store.popitem(last=False)
                self.bytes -= self._sizes.pop(old)


def namespace(deployment) -> str | None:
    """What a cached prefix's bits depend on besides its tokens: the deployment's fingerprint
    (weights, kernels, L, prefill chunk, backend...), the chunk grid or the rows a prompt may be
    cut anywhere into (kernels/invariance/prefill.py), the guarantee in force (rows proven, so
    KV written while the startup proofs ran is never read under the guarantee) and whether rows
    are canonical now. None where the deployment has no fingerprint (nothing to key a disk
    entry by; the memory tier still serves its own process)."""
    if deployment is None or not deployment.fingerprint:
        return None
    chunk, guarantee = deployment.prefill_chunk, deployment.guarantee
    guaranteed = guarantee.call_rows if guarantee.guaranteed else 0
    return (f"{deployment.fingerprint}/chunk={chunk}/smallest={SMALLEST_CHUNK}"
            f"/splits={free_splits(guarantee.prefill_split_rows, chunk)}/guaranteed={guaranteed}"
            f"/canonical={int(rows_are_canonical(guarantee.canonical_rows, chunk))}")


_DISK_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16"}  # KV of other types stays in memory


def _host_arrays(snapshot: list) -> tuple[str, list]:
    """The snapshot's buffers as NumPy views (no copy; bfloat16 as its 16 bits), for the writer thread."""
    dtype = snapshot[0].keys.dtype
    name = _DISK_DTYPES[dtype]
    arrays = [(c.keys, c.values) for c in snapshot]
    if dtype == mx.bfloat16:
        arrays = [(k.view(mx.uint16), v.view(mx.uint16)) for k, v in arrays]
        mx.eval(arrays)
    return name, [(np.asarray(k), np.asarray(v)) for k, v in arrays]


def _from_blocks(dtype: str, blocks: list) -> list:
    """KVCaches holding the blocks end to end (buffers sized as a cold prefill leaves them)."""
    length = sum(b[0][0].shape[2] for b in blocks)
    size = -(-length // KVCache.step) * KVCache.step
    caches = []
    for i in range(len(blocks[0])):
        fresh = KVCache()
        for j, name in enumerate(("keys", "values")):
            parts = [b[i][j] for b in blocks]
            buf = np.zeros((*parts[0].shape[:2], size, parts[0].shape[3]), parts[0].dtype)
            buf[:, :, :length, :] = np.concatenate(parts, axis=2)
            arr = mx.array(buf)
            setattr(fresh, name, arr.view(mx.bfloat16) if dtype == "BF16" else arr)
        fresh.offset = length
        caches.append(fresh)
    mx.eval([(c.keys, c.values) for c in caches])
    return caches
