"""Reuse of prompt KV between requests.

Only KV written by prompt prefill is stored (never decode-written rows), and prefill
resumes at a chunk boundary aligned to absolute positions (kernels/invariance/prefill.py), so a
request computes the same KV whether its prefix was cached or not. That holds for KV written
in canonical chunks (`--prefill-chunk`); a plain prompt's smaller chunks (on the CPU,
deployment.py `plain_prefill_chunk`) write other bits, so such entries are marked
non-canonical and given to plain requests only.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from lockstep.kernels.batching.kv_pool import is_pooled


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


class PrefixCache:
    """LRU of (prompt tokens -> KV) snapshots of plain KVCache lists or KV pool ranges (stored
    as plain KVCache copies either way), each marked whether canonical chunks wrote it."""

    def __init__(self, entries: int = 4):
        self.entries = entries
        self._store: OrderedDict[tuple, list] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def storable(cache: list) -> bool:
        return all(type(layer) is KVCache for layer in cache) or is_pooled(cache)

    def lookup(self, tokens: list[int], *, canonical_only: bool = False) -> tuple[list | None, int]:
        """A private copy of the cached KV sharing the longest prefix with `tokens`, and its
        length; `canonical_only`: among entries canonical chunks wrote (a request that writes
        canonical KV must not start from other bits)."""
        with self._lock:
            best, best_len = None, 0
            for key, (cache, canonical) in self._store.items():
                if canonical_only and not canonical:
                    continue
                n = _common_prefix(list(key), tokens)
                if n > best_len:
                    best, best_len = key, n
            if best is None:
                self.misses += 1
                return None, 0
            self._store.move_to_end(best)
            self.hits += 1
            return copy_prefix(self._store[best][0], best_len), best_len

    def store(self, tokens: list[int], cache: list, *, canonical: bool = True) -> None:
        """Keep a snapshot of `cache`, which holds exactly the KV of `tokens` (`canonical`:
        written in canonical chunks)."""
        if self.entries <= 0 or not tokens or not self.storable(cache):
            return
        key = tuple(tokens)
        with self._lock:
            held = self._store.get(key)
        if held is not None and held[1] and not canonical:
            canonical, snapshot = True, held[0]  # a canonical entry serves plain requests too: kept
        else:
            snapshot = copy_prefix(cache, len(tokens))
        with self._lock:
            self._store[key] = (snapshot, canonical)
            self._store.move_to_end(key)
            while len(self._store) > self.entries:
                self._store.popitem(last=False)
