"""Byte-level messages between ranks, carried by mlx.distributed collectives themselves.

No side channel: a broadcast is an `all_sum` of a uint8 buffer to which every rank but the
root contributes zeros (summing zeros is exact). A fixed-size first frame carries the length
and, for most engine iterations, the whole payload, so an iteration costs one collective.

`ordered_all_sum` is the reduction tensor-parallel layers use on batch-invariant rows: every
rank gathers all partial sums and adds them in rank order, so an element's sum never
depends on how a backend chunks a buffer of M rows (a ring reduce-scatter starts each chunk
at a different rank; with 3+ ranks the order of the additions, and so the bits, would follow
the chunk an element falls in, which moves with M).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

FRAME = 4096  # bytes in the first frame: an 8-byte length, then the start of the payload
_HEADER = 8


def _sum_bytes(group, buffer: np.ndarray) -> np.ndarray:
    out = mx.distributed.all_sum(mx.array(buffer), group=group)
    mx.eval(out)
    return np.array(out, copy=False)


def broadcast_bytes(group, payload: bytes | None, root: int = 0) -> bytes:
    """`payload` of the root on every rank (others pass None). Blocks until all ranks call it."""
    is_root = group.rank() == root
    if is_root and payload is None:
        raise ValueError("the root must give a payload")
    first = np.zeros(FRAME, dtype=np.uint8)
    if is_root:
        first[:_HEADER] = np.frombuffer(len(payload).to_bytes(_HEADER, "little"), dtype=np.uint8)
        head = payload[:FRAME - _HEADER]
        first[_HEADER:_HEADER + len(head)] = np.frombuffer(head, dtype=np.uint8)
    first = _sum_bytes(group, first)
    length = int.from_bytes(first[:_HEADER].tobytes(), "little")
    data = first[_HEADER:_HEADER + length].tobytes()
    rest = length - len(data)
    if rest > 0:  # a long iteration (many new requests): one more collective for the tail
        tail = np.zeros(rest, dtype=np.uint8)
        if is_root:
            tail[:] = np.frombuffer(payload[len(data):], dtype=np.uint8)
        data += _sum_bytes(group, tail).tobytes()
    return data


def gather_bytes(group, blob: bytes, size: int = FRAME) -> list[bytes]:
    """Every rank's `blob` (at most `size - 8` bytes), in rank order, on every rank."""
    if len(blob) > size - _HEADER:
        raise ValueError(f"{len(blob)} bytes do not fit a {size}-byte gather frame")
    frame = np.zeros(size, dtype=np.uint8)
    frame[:_HEADER] = np.frombuffer(len(blob).to_bytes(_HEADER, "little"), dtype=np.uint8)
    frame[_HEADER:_HEADER + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    out = mx.distributed.all_gather(mx.array(frame), group=group)
    mx.eval(out)
    frames = np.array(out, copy=False).reshape(group.size(), size)
    blobs = []
    for f in frames:
        n = int.from_bytes(f[:_HEADER].tobytes(), "little")
        blobs.append(f[_HEADER:_HEADER + n].tobytes())
    return blobs


def ordered_all_sum(x: mx.array, group) -> mx.array:
    """Sum of `x` over the group, added in rank order ((x0 + x1) + x2 ...), the same bits on
    every rank and for every row count."""
    n = group.size()
    if n == 1:
        return x
    parts = mx.distributed.all_gather(x[None], group=group)  # (n, *x.shape)
    total = parts[0]
    for r in range(1, n):
        total = total + parts[r]
    return total
