"""What passes between the scheduler and the model runner in one engine step.

As in vLLM v1: the scheduler says what runs (`SchedulerOutput`: which requests, how many
rows each, whether it drafts), the model runner drafts, runs and samples it
(`ModelRunnerOutput`: each request's chosen tokens), and the scheduler updates its requests
from the result. Members are the scheduler's slots: anything with a `.state` (a RequestState).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from lockstep.server.engine.guarantee.decode_plan import Determinism


@dataclass(frozen=True)
class Sampled:
    """One chosen token, with its logprob and top alternatives when asked."""

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class DecodeRows:
    """One request's part of a scheduled decode pass: its last token, then up to `k` drafts
    the runner asks its drafter for (0: it does not draft this step)."""

    slot: object
    token: int
    k: int = 0

    @property
    def rows(self) -> int:
        """Rows at most (a drafter may propose fewer than k)."""
        return 1 + self.k


@dataclass
class ScheduledPass:
    """A decode pass as the scheduler composed it: the requests and their rows at most."""

    members: list[DecodeRows]

    @property
    def rows(self) -> int:
        return sum(member.rows for member in self.members)

    @property
    def canonical(self) -> bool:
        return any(m.slot.state.determinism != Determinism.NONE for m in self.members)


@dataclass
class DecodePass:
    """One forward pass over several requests' rows as it runs, drafts in (each request's
    rows end to end)."""

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
    passes: list[ScheduledPass] = field(default_factory=list)
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
class SampledTokens:
    """What one request's rows of a pass gave: the tokens chosen in order (its accepted drafts,
    then the target's own) and the drafts that were verified."""

    chosen: list[Sampled]
    drafts: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [c.token for c in self.chosen]

    @property
    def accepted(self) -> int:
        return len(self.chosen) - 1


@dataclass
class PassOutput:
    """A scheduled decode pass that ran: its rows, and per member (in the ScheduledPass's order)
    its SampledTokens, the Exception its drafting or sampling raised, or None where its client
    left while the pass was drafted (it did not run). `seconds`: its time on the engine thread
    (drafting, running, sampling; a pass decoded ahead also builds the next one meanwhile), the
    step its requests wait for."""

    rows: int
    members: list
    seconds: float = 0.0

    @property
    def requests(self) -> int:
        return sum(isinstance(m, SampledTokens) for m in self.members)


@dataclass
class ModelRunnerOutput:
    """Aligned with the SchedulerOutput it answers; an exception where that work failed."""

    prefill_alone: list = field(default_factory=list)  # PrefillResult | Exception
    prefill_shared: list[int] | Exception = field(default_factory=list)  # tokens per member
    passes: list = field(default_factory=list)  # PassOutput | Exception

    @property
    def failed(self) -> bool:
        """Whether any of its work, or any pass member's, ended in an exception."""
        members = [m for done in self.passes if isinstance(done, PassOutput) for m in done.members]
        return any(isinstance(x, Exception) for x in [*self.prefill_alone, self.prefill_shared, *self.passes, *members])
