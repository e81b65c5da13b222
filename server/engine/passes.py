"""Which requests' rows share a forward pass: the scheduler's determinism rule, on its own.

- A pass that holds a deterministic row has at most L rows (the batch-invariant limit), so
  every layer runs the canonical forms proven bit-identical to M = 1 (kernels/invariance/selftest.py
  and kernels/batching/ragged.py prove every width up to L). Rows of other requests may fill it up
  to L: canonical rows do not depend on their neighbours.
- Passes of non-deterministic rows only may be wider (up to `max_rows`) and run native.
- A request's rows are never split across passes, and requests keep their order (the
  caller rotates it between steps, so every request gets to go first in turn).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# Requests decoding at once, and rows in one pass of non-deterministic rows (`lockstep serve`
# --max-active / --max-batch-rows). Here, not in the engine, so the CLI can show them
# without importing MLX before `--cpu-blas` may re-exec the process.
DEFAULT_MAX_ACTIVE = 16
DEFAULT_MAX_BATCH_ROWS = 32


@dataclass(frozen=True)
class Demand(Generic[T]):
    owner: T  # whatever the caller uses to find the request again
    rows: int
    deterministic: bool


def compose_passes(demands: list[Demand[T]], limit: int, max_rows: int) -> list[list[Demand[T]]]:
    """Group `demands` into passes obeying the rule above. Raises ValueError when one
    deterministic demand alone is wider than `limit` (the decode plan prevents that)."""
    if max_rows < 1:
        raise ValueError("max_rows must be >= 1")
    passes: list[list[Demand[T]]] = []
    deterministic = [d for d in demands if d.deterministic]
    free = [d for d in demands if not d.deterministic]

    def close(group: list[Demand[T]], used: int) -> None:
        # Top the deterministic pass up with free rows that fit within L.
        for d in list(free):
            if used + d.rows <= limit:
                group.append(d)
                used += d.rows
                free.remove(d)
        passes.append(group)

    current: list[Demand[T]] = []
    used = 0
    for d in deterministic:
        if d.rows > limit:
            raise ValueError(f"a deterministic request brings {d.rows} rows; the limit is {limit}")
        if used + d.rows > limit:
            close(current, used)
            current, used = [], 0
        current.append(d)
        used += d.rows
    if current:
        close(current, used)
    current, used = [], 0
    for d in free:
        if current and used + d.rows > max_rows:
            passes.append(current)
            current, used = [], 0
        current.append(d)
        used += d.rows
    if current:
        passes.append(current)
    return passes
