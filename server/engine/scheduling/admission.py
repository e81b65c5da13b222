"""How many requests decode at once (`--max-active`) and how many rows one decode pass may
hold (`--max-batch-rows`) when the flags do not say: the rule as a pure function.

On a GPU a decode pass costs about the same for 16 rows as for 64 (the weights are read once
per pass), so the engine admits as many requests as the KV budget holds at a typical context,
up to a cap. On the CPU a pass's cost grows with its rows: the fixed defaults stay. An
explicit flag always wins. No MLX here: the caller says which backend and how many KV tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from lockstep.server.engine.scheduling.passes import DEFAULT_MAX_ACTIVE, DEFAULT_MAX_BATCH_ROWS

# The KV one request is expected to hold (prompt + answer, in tokens) when sizing admission;
# the KV budget still gates each request by its own reservation.
TYPICAL_REQUEST_TOKENS = 4096
# The most requests sized admission allows: wider passes stop paying on one GPU and every
# width up to the pass limit is proven at startup.
MAX_SIZED_ACTIVE = 64


@dataclass(frozen=True)
class Admission:
    max_active: int
    max_batch_rows: int
    reason: str

    def describe(self) -> dict:
        return {"max_active": self.max_active, "max_batch_rows": self.max_batch_rows, "reason": self.reason}


def admission_limits(kv_tokens: int | None, *, gpu: bool, max_active: int | None = None,
                     max_batch_rows: int | None = None) -> Admission:
    """The engine's admission for a KV budget of `kv_tokens` (None: unbounded) on a GPU or not;
    `max_active` / `max_batch_rows`: the flags' values, None where not given."""
    reasons = []
    if max_active is not None:
        reasons.append("--max-active given")
    elif not gpu:
        max_active = DEFAULT_MAX_ACTIVE
        reasons.append(f"{max_active} requests on the CPU (a pass's cost grows with its rows)")
    else:
        held = MAX_SIZED_ACTIVE if kv_tokens is None else kv_tokens // TYPICAL_REQUEST_TOKENS
        max_active = min(MAX_SIZED_ACTIVE, max(DEFAULT_MAX_ACTIVE, held))
        budget = "an unbounded KV budget" if kv_tokens is None else f"a KV budget of {kv_tokens} tokens"
        reasons.append(f"{max_active} requests: {budget} holds {held} of {TYPICAL_REQUEST_TOKENS} tokens "
                       f"(kept within {DEFAULT_MAX_ACTIVE}..{MAX_SIZED_ACTIVE})")
    if max_batch_rows is not None:
        reasons.append("--max-batch-rows given")
    else:
        # on a GPU one pass takes every admitted request's row
        max_batch_rows = max(DEFAULT_MAX_BATCH_ROWS, max_active) if gpu else DEFAULT_MAX_BATCH_ROWS
        reasons.append(f"passes of up to {max_batch_rows} rows")
    return Admission(max_active, max_batch_rows, "; ".join(reasons))
