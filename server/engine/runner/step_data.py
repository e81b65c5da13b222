"""What passes between the scheduler and the model runner in one engine step.

As in vLLM v1: the scheduler says what runs (`SchedulerOutput`), the model runner runs it
(`ModelRunnerOutput`), and the scheduler updates its requests from the result. Members are
the scheduler's slots: anything with a `.state` (a RequestState).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from lockstep.server.engine.guarantee.decode_plan import Determinism


@dataclass
class DecodePass:
    """One forward pass over several requests' rows (each request's rows end to end)."""

    members: list  # (slot, rows: list[int])

    @property
    def rows(self) -> int:
        return sum(len(rows) for _, rows in self.members)

    @property
    def canonical(self) -> bool:
        """Canonical forms run only where a request asked for determinism; other passes run
        natively whatever their width (decode passes write no prefix-cache KV)."""
        return any(slot.state.determinism != Determinism.NONE for slot, _ in self.members)


@dataclass
class SchedulerOutput:
    prefill_alone: list = field(default_factory=list)  # slots whose next prompt chunk runs in a pass of its own
    prefill_shared: list = field(default_factory=list)  # slots whose next target chunks share one pass
    passes: list[DecodePass] = field(default_factory=list)
    # The scheduler expects the same requests to decode in one pass next step (nothing waits
    # or prefills to join them): the runner may build that pass ahead (decode_ahead.py).
    decode_ahead: bool = False

    @property
    def empty(self) -> bool:
        return not (self.prefill_alone or self.prefill_shared or self.passes)


@dataclass
class PrefillResult:
    """A prompt chunk that ran: how many tokens of which model's cache it wrote."""

    tokens: int
    model: str  # "target" | "draft"
    follow: bool = False  # no model work: copied from the leader (or still waiting for it)


@dataclass
class PassResult:
    """A decode pass's logits (rows, vocab), every row's argmax, and each member's batched
    sampling (a sampling.PendingSample, or None) with its row span."""

    logits: mx.array
    argmax: list[int]
    sampled: list
    spans: list[tuple[int, int]]


@dataclass
class ModelRunnerOutput:
    """Aligned with the SchedulerOutput it answers; an exception where that work failed."""

    prefill_alone: list = field(default_factory=list)  # PrefillResult | Exception
    prefill_shared: list[int] | Exception = field(default_factory=list)  # tokens per member
    passes: list = field(default_factory=list)  # PassResult | Exception
