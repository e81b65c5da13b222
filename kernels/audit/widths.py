"""Which call widths (rows of one quantized-layer call) the kernel audit has covered so far.

The audit runs in stages ordered by what serving takes first (kernels/audit/patch.py):
- FIRST: what a first plain answer needs at the least — one-row calls (decode, a prompt one
  token a step) and every embedding lookup (a prompt's tokens, any count);
- WIDE: prompt chunks of at least `WIDE_ROWS` rows (MLX's tiled quantized matmul: the "tiled"
  and "prompt" probes);
- NARROW: calls of 2..WIDE_ROWS - 1 rows (the "short" probes): decode passes of several
  requests, short prompt chunks, speculative verification.
`serve` audits FIRST before it serves, and the stages `deferred_stages` names on the engine
thread afterwards; until then the scheduler runs no call of an unaudited width (`AuditedRows`:
prompt chunks cut to audited widths, decode passes split into them).
"""
from __future__ import annotations

import threading

FIRST, WIDE, NARROW = "first answer", "wide", "narrow"
STAGES = (FIRST, WIDE, NARROW)
WIDE_ROWS = 33  # the audit's tiled and prompt probes: every call of at least this many rows

# Per stage, the call widths it covers: (lowest, highest or None for unbounded).
STAGE_ROWS = {FIRST: ((1, 1),), WIDE: ((WIDE_ROWS, None),), NARROW: ((2, WIDE_ROWS - 1),)}


def stage_of(path: str, rows: int) -> str:
    """The stage that probes `path` at `rows` rows (kernels/audit/probes.py's paths)."""
    if path.startswith("lookup") or rows == 1:
        return FIRST
    return WIDE if rows >= WIDE_ROWS else NARROW


def deferred_stages(backend: str) -> tuple[str, ...]:
    """The stages `serve` audits after it starts serving on `backend`. On CUDA, MLX compiles each
    tile size of its quantized matmul the first time it runs (half a minute each on an empty
    kernel cache), so the wide calls wait too, their kernels compiled meanwhile in child
    processes (kernels/audit/compile_ahead.py); elsewhere they are cheap to audit first."""
    return (WIDE, NARROW) if backend == "cuda" else (NARROW,)


def row_ranges(stages) -> list[list[int | None]]:
    """The widths `stages` cover as sorted, merged [lowest, highest] ranges (None: unbounded)."""
    spans = sorted(span for stage in stages for span in STAGE_ROWS[stage])
    merged: list[list[int | None]] = []
    for low, high in spans:
        if merged and merged[-1][1] is not None and low <= merged[-1][1] + 1:
            last = merged[-1]
            last[1] = None if high is None else max(last[1], high)
        else:
            merged.append([low, high])
    return merged


class AuditedRows:
    """The widths audited so far, read by the engine's scheduler and /health; stages are added
    from the engine thread as the audit finishes them. `completed` is set once all are."""

    def __init__(self, stages=STAGES):
        self._lock = threading.Lock()
        self._stages = frozenset(stages)
        self.completed = threading.Event()
        if self.complete:
            self.completed.set()

    @property
    def complete(self) -> bool:
        return self._stages >= set(STAGES)

    @property
    def stages(self) -> frozenset:
        return self._stages

    def add(self, stage: str) -> None:
        if stage not in STAGES:
            raise ValueError(f"audit stages are {STAGES}")
        with self._lock:
            self._stages = self._stages | {stage}
        if self.complete:
            self.completed.set()

    def allows(self, rows: int) -> bool:
        """Whether a call of `rows` rows has been audited."""
        return any(low <= rows and (high is None or rows <= high) for low, high in row_ranges(self._stages))

    def widest(self, rows: int) -> int:
        """The widest audited width of at most `rows` (one row is always audited)."""
        best = 1
        for low, high in row_ranges(self._stages):
            if low <= rows:
                best = max(best, rows if high is None else min(rows, high))
        return best

    def split(self, rows: int) -> list[int]:
        """`rows` rows as calls of audited widths, widest first."""
        parts = []
        while rows > 0:
            width = self.widest(rows)
            parts.append(width)
            rows -= width
        return parts

    def describe(self) -> dict:
        """For /health and /v1/models: the audited widths ([lowest, highest]; null: unbounded)."""
        return {"audited_rows": row_ranges(self._stages), "audit_complete": self.complete}
