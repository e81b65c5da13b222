"""NumPy model of pooled_attention.cu's order of work (the specification of the kernel).

`tile_schedule(length)` is which keys each warp takes, in order; `attention_row` runs one
(head, row) through that schedule with the kernel's online-softmax updates and its warp
combination, in float32. The CPU tests check the schedule covers every key once, in an order
fixed by the length alone, and that the updates compute softmax attention.
"""
from __future__ import annotations

import numpy as np

TILE = 32
WARPS = 8  # attention.ATT_WARPS


def tile_schedule(length: int, warps: int = WARPS) -> list[list[range]]:
    """For each warp, its tiles (key ranges) in the order it runs them."""
    tiles = -(-length // TILE)
    return [[range(t * TILE, min(length, t * TILE + TILE)) for t in range(w, tiles, warps)]
            for w in range(warps)]


def attention_row(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float,
                  warps: int = WARPS) -> np.ndarray:
    """softmax(scale * keys @ q) @ values for one query, computed as the kernel orders it."""
    q, keys, values = (np.asarray(a, np.float32) for a in (q, keys, values))
    states = []
    for tiles in tile_schedule(len(keys), warps):
        m, l, acc = np.float32(-np.inf), np.float32(0), np.zeros(q.shape, np.float32)
        for tile in tiles:
            s = np.array([np.dot(q, keys[j]) for j in tile], np.float32) * np.float32(scale)
            m_new = max(m, s.max())
            p = np.exp(s - m_new).astype(np.float32)
            corr = np.float32(np.exp(m - m_new))
            l = l * corr + p.sum(dtype=np.float32)
            acc = acc * corr
            for i, j in enumerate(tile):
                acc = acc + p[i] * values[j]
            m = m_new
        states.append((m, l, acc))
    m_all = max(m for m, _, _ in states)
    total, out = np.float32(0), np.zeros(q.shape, np.float32)
    for m, l, acc in states:
        if l > 0:
            f = np.float32(np.exp(m - m_all))
            out, total = out + acc * f, total + l * f
    return out / total
