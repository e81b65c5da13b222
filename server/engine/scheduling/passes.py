"""Which requests' rows share a forward pass: the scheduler's determinism rule, on its own.

Each demand carries its request's plan's determinism (server/engine/guarantee/decode_plan.py):
- "alone": its rows get a pass of their own;
- "shared": a pass that holds such a row has at most `shared_rows` rows (the widest pass the
  ragged proof covered: L bounds one kernel call, and wider calls run in blocks of at most L,
  kernels/invariance/layers.py), so every row keeps the bits of its single-row call. Rows of
  other requests may fill it: canonical rows do not depend on their neighbours.
- Passes of non-deterministic rows only may be wider (up to `max_rows`) and run native.
- A request's rows are never split across passes, and requests keep their order (the
  caller rotates it between steps, so every request gets to go first in turn).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from lockstep.server.engine.guarantee.decode_plan import Determinism

T = TypeVar("T")

# Requests decoding at once, and rows in one pass of non-deterministic rows (`lockstep serve`
# --max-active / --max-batch-rows). Here, not in the engine, so the CLI can show them
# without importing MLX before `--cpu-blas` may re-exec the process.
DEFAULT_MAX_ACTIVE = 16
DEFAULT_MAX_BATCH_ROWS = 32


def default_active_per_request(max_active: int) -> int:
    """Choices of one request (n) decoding at once, when --max-active-per-request is not
    given: three quarters of the slots, so one request never takes them all."""
    return max(1, max_active - max_active // 4)


@dataclass(frozen=True)
class Demand(Generic[T]):
    owner: T  # whatever the caller uses to find the request again
    rows: int
    determinism: Determinism


def compose_passes(demands: list[Demand[T]], shared_rows: int, max_rows: int) -> list[list[Demand[T]]]:
    """Group `demands` into passes obeying the rule above. Raises ValueError when one
    deterministic demand alone is wider than `shared_rows` (the decode plan prevents that)."""
    if max_rows < 1:
        raise ValueError("max_rows must be >= 1")
    passes: list[list[Demand[T]]] = [[d] for d in demands if d.determinism == Determinism.ALONE]
    deterministic = [d for d in demands if d.determinism == Determinism.SHARED]
    free = [d for d in demands if d.determinism == Determinism.NONE]

    def close(group: list[Demand[T]], used: int) -> None:
        # Top the deterministic pass up with free rows that fit within L.
        for d in list(free):
            if used + d.rows <= shared_rows:
                group.append(d)
                used += d.rows
                free.remove(d)
        passes.append(group)

    current: list[Demand[T]] = []
    used = 0
    for d in deterministic:
        if d.rows > shared_rows:
            raise ValueError(f"a deterministic request brings {d.rows} rows; at most {shared_rows} may share a pass")
        if used + d.rows > shared_rows:
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
