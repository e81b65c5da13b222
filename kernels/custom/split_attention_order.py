"""NumPy model of split_attention.cu's order of work (the specification of the kernel).

`pass_schedule(length, slots)` is which keys each warp takes, pass by pass and slot by slot
in load order; `attention_row` runs one (head, row) through it with the kernel's score
butterflies, online-softmax updates, slot sums and warp combination, in float32. The CPU
tests check the schedule covers every key once, in an order fixed by the length alone, and
that the updates compute softmax attention.
"""
from __future__ import annotations

import numpy as np

LOADS = 8   # split_attention.cu's SPLIT_LOADS
WARPS = 16  # split_attention.cu's SPLIT_WARPS (split_attention.WARPS)


def lanes_per_key(dim: int, itemsize: int) -> int:
    """Lanes that read one key: 16 bytes each."""
    return dim * itemsize // 16


def pass_schedule(length: int, slots: int, loads: int = LOADS, warps: int = WARPS) -> list[list[list[list[int]]]]:
    """For each warp, its passes in the order it runs them; for each pass, each slot's keys
    in load order (load i of slot s is key pass * slots * loads + i * slots + s)."""
    per_pass = slots * loads
    passes = -(-length // per_pass)
    return [[[[j for j in (p * per_pass + i * slots + s for i in range(loads)) if j < length]
              for s in range(slots)]
             for p in range(w, passes, warps)]
            for w in range(warps)]


def _butterfly(values: list) -> np.ndarray:
    """What lane 0 holds after an xor butterfly over `values` (one per lane group, offsets
    halving from len / 2 to 1)."""
    v = list(values)
    off = len(v) // 2
    while off:
        v = [v[i] + v[i ^ off] for i in range(len(v))]
        off //= 2
    return v[0]


def attention_row(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float, itemsize: int = 2,
                  loads: int = LOADS, warps: int = WARPS) -> np.ndarray:
    """softmax(scale * keys @ q) @ values for one query, computed as the kernel orders it
    (itemsize: bytes of the KV element type, which sets how many lanes read a key)."""
    q, keys, values = (np.asarray(a, np.float32) for a in (q, keys, values))
    dim = q.shape[0]
    lanes = lanes_per_key(dim, itemsize)
    per_lane = dim // lanes
    slots = 32 // lanes
    scale = np.float32(scale)

    def score(j: int) -> np.float32:
        pieces = [np.float32(0)] * lanes
        for c in range(lanes):
            for d in range(c * per_lane, (c + 1) * per_lane):
                pieces[c] = np.float32(pieces[c] + q[d] * keys[j, d])
        return np.float32(_butterfly(pieces) * scale)

    states = []
    for passes in pass_schedule(len(keys), slots, loads, warps):
        m, l = np.float32(-np.inf), np.float32(0)
        acc = np.zeros((slots, dim), np.float32)
        for in_slots in passes:
            s = {j: score(j) for slot_keys in in_slots for j in slot_keys}
            m_new = max(m, max(s.values()))
            corr = np.float32(np.exp(m - m_new))
            p = {j: np.float32(np.exp(s[j] - m_new)) for j in s}
            sums = [np.float32(sum((p[j] for j in slot_keys), np.float32(0))) for slot_keys in in_slots]
            l = np.float32(l * corr + _butterfly(sums))
            acc = acc * corr
            for slot, slot_keys in enumerate(in_slots):
                for j in slot_keys:
                    acc[slot] = acc[slot] + p[j] * values[j]
            m = m_new
        states.append((m, l, _butterfly(list(acc))))
    m_all = max(m for m, _, _ in states)
    total, out = np.float32(0), np.zeros(dim, np.float32)
    for m, l, acc in states:
        if l > 0:
            f = np.float32(np.exp(m - m_all))
            out, total = out + acc * f, total + l * f
    return out / total
