"""Speculative decoding's policy: how many drafts to verify, and which of them to keep.

A drafter (drafters.py) proposes k tokens, the target verifies them in one pass. The emitted
token at every position is chosen from the *target's* logits for that position by the same
position-keyed sampler plain decoding uses ("sample and compare", `accept_drafts`). So when
the target gives bit-identical logits for a row in a block and alone (the batch-invariant
mode), speculative output equals plain output token for token; the drafter only changes how
many forward passes that takes. How many drafts a step verifies: `DraftBackoff` (cheap
drafters, by default) or `AdaptiveDraftLength` (acceptance against the measured cost of a
pass, `measure_pass_costs`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache


@dataclass
class VerifiedStep:
    tokens: list[int]            # emitted tokens, in order (accepted drafts + one from the target)
    logits: list[mx.array]       # the target's logits row each token was chosen from
    drafted: int
    accepted: int


def accept_drafts(
    rows: mx.array,
    cache: list,
    drafts: list[int],
    choose: Callable[[mx.array, int], int],
) -> VerifiedStep:
    """Keep the agreeing prefix of `drafts`, given the target's logits `rows` for
    [last_token, *drafts] (already appended to `cache`).

    `choose(logits_row, i)` picks the token for the i-th row (the caller maps i to the
    absolute position for position-keyed sampling). KV rows of rejected drafts are trimmed,
    so the cache ends holding exactly the accepted context.
    """
    tokens: list[int] = []
    chosen_rows: list[mx.array] = []
    for i in range(len(drafts) + 1):
        token = choose(rows[i], i)
        tokens.append(token)
        chosen_rows.append(rows[i])
        if i == len(drafts) or token != drafts[i]:
            break
    accepted = len(tokens) - 1
    rejected_rows = len(drafts) - accepted
    if rejected_rows:
        trim_prompt_cache(cache, rejected_rows)
    return VerifiedStep(tokens, chosen_rows, len(drafts), accepted)


class AdaptiveDraftLength:
    """Chooses each step's k from the request's own acceptance history and the cost of a
    verification pass, so speculation is turned off where drafts do not pay.

    Acceptance is modelled per draft position: a draft is accepted with probability p given
    that the ones before it were (estimated from decayed counts, with a weak prior), so k
    drafts emit (1 - p^(k+1)) / (1 - p) tokens in expectation. Their pass costs
    `pass_costs[k] / pass_costs[0]` decode steps plus k draft-model passes of
    `draft_cost` each. k is the one in 0..k_max with the most expected tokens per unit cost
    (ties go to the smaller k; k = 0 yields exactly one token per step).

    Determinism rule (docs/DETERMINISM.md): the inputs are this request's own drafted and
    accepted counts and constants of the deployment (the cost table, k_max), never the batch
    or the clock, so the same request makes the same choices wherever it runs.
    """

    DECAY = 0.9  # weight of older evidence per verification: acceptance drifts along a text
    # p = 0.3 before any evidence: sceptical, so a class of drafts is tried only where passes
    # are cheap, or once its shadow drafts (free for prompt lookup) or probes show it pays
    # (with p = 0.5 every new class drafted k = 7 once on the H200, where 2..8 rows cost ~2).
    PRIOR_ACCEPTED, PRIOR_TRIALS = 0.6, 2.0
    PROBE_EVERY = 16  # steps at k = 0 before an expensive drafter tries one draft again

    def __init__(self, k_max: int, pass_costs: Sequence[float] | None = None, draft_cost: float = 0.0):
        self.k_max = max(0, k_max)
        # pass_costs[w - 1] is the cost of a pass of w rows; none measured: cost grows
        # linearly with the rows (the CPU's case: a k + 1-row pass costs k + 1 steps)
        costs = list(pass_costs) if pass_costs else [float(w) for w in range(1, self.k_max + 2)]
        self.costs = [c / costs[0] for c in costs]
        self.draft_cost = draft_cost
        # per evidence class (prompt lookup: how long the matched suffix was), since a long
        # match predicts far better than a one-token one; (accepted, trials), decayed
        self.counts: dict[int, list[float]] = {}
        self._idle_steps = 0  # consecutive steps at k = 0 (for probing)
        self._probe_every = self.PROBE_EVERY

    def cost(self, k: int) -> float:
        """Cost of one step with k drafts, in decode steps of one row."""
        width = k + 1
        if width <= len(self.costs):
            verify = self.costs[width - 1]
        else:  # beyond the table: extend its last slope
            last = self.costs[-1]
            slope = last - self.costs[-2] if len(self.costs) > 1 else 1.0
            verify = last + slope * (width - len(self.costs))
        return verify + k * self.draft_cost

    def acceptance(self, kind: int = 0) -> float:
        accepted, trials = self.counts.get(kind, (self.PRIOR_ACCEPTED, self.PRIOR_TRIALS))
        return accepted / trials

    def best_k(self, kind: int = 0) -> int:
        p = min(self.acceptance(kind), 0.999)
        best, best_value, expected = 0, 1.0 / self.cost(0), 1.0
        for k in range(1, self.k_max + 1):
            expected += p ** k
            value = expected / self.cost(k)
            if value > best_value * (1 + 1e-9):
                best, best_value = k, value
        return best

    def choose(self, probe: bool = False, kind: int = 0) -> int:
        """k for the next step, drafts being of evidence class `kind`. With `probe` (an
        expensive drafter, whose acceptance is only learnt by drafting), a run of k = 0 steps
        is broken by one k = 1 step every PROBE_EVERY steps, the interval doubling after each
        probe that fails."""
        k = self.best_k(kind)
        if k == 0 and probe and self.k_max > 0:
            self._idle_steps += 1
            if self._idle_steps >= self._probe_every:
                self._idle_steps = 0
                return 1
        elif k > 0:
            self._idle_steps = 0
        return k

    def record(self, drafted: int, accepted: int, probed: bool = False, kind: int = 0) -> None:
        """One verification (or a shadow comparison) of `drafted` drafts of class `kind`,
        `accepted` of them."""
        if drafted < 1:
            return
        trials = accepted + (1 if accepted < drafted else 0)  # stops at the first rejection
        counts = self.counts.setdefault(kind, [self.PRIOR_ACCEPTED, self.PRIOR_TRIALS])
        counts[0] = counts[0] * self.DECAY + accepted
        counts[1] = counts[1] * self.DECAY + trials
        if probed:
            self._probe_every = self.PROBE_EVERY if accepted else self._probe_every * 2


class DraftBackoff:
    """The default k policy of a cheap drafter (prompt lookup, a prediction) without adaptive
    speculation: verify drafts only while this request's own drafts are being accepted.

    A verification pass of k + 1 rows can cost k + 1 one-row passes (the CPU), so a request
    whose drafts keep failing must stop paying for them, and a first guess must be cheap. It
    starts at one draft; after d verified drafts with a accepted, the next step verifies
    min(k, 2d + 1) drafts when all were accepted, a + 1 when some were, none after a miss.
    While none are verified the drafter's proposal is still compared with the token that
    follows (a shadow draft, free for a cheap drafter): the first one that agrees brings back
    one draft, and the rule above grows it again.
    Like AdaptiveDraftLength its input is the request's own tokens only, never the batch or
    the clock (docs/DETERMINISM.md), and it needs no measurement.
    """

    def __init__(self, k_max: int):
        self.k_max = max(0, k_max)
        self.k_next = min(1, self.k_max)

    def choose(self) -> int:
        return self.k_next

    def record(self, drafted: int, accepted: int) -> None:
        """One verification (or a settled shadow comparison) of `drafted` drafts, `accepted`
        of them."""
        if drafted >= 1:
            grown = 2 * drafted + 1 if accepted == drafted else accepted + 1
            self.k_next = 0 if accepted == 0 else min(self.k_max, grown)

    def record_shadow(self, agreed: bool) -> None:
        """Whether the first draft proposed while none were verified was the next token."""
        self.k_next = min(1, self.k_max) if agreed else 0


def agreeing_prefix(drafts: Sequence[int], actual: Sequence[int]) -> int:
    n = 0
    for d, a in zip(drafts, actual):
        if d != a:
            break
        n += 1
    return n


def measure_pass_costs(model, widths: int, context: int = 64, repeats: int = 3, runner=None) -> list[float]:
    """Seconds of one target pass of 1..`widths` rows after `context` cached tokens (best of
    `repeats`): the cost table adaptive speculation weighs k against. Measured once, at
    startup or by the bench; the choice of k then depends on it only as a constant.
    `runner`: passes as the engine runs them (ModelRunner.as_engine_runs: its KV pool, ragged
    passes); None: plain model calls on plain caches."""
    from lockstep.server.engine.runner.model_runner import ModelRunner

    runner = runner or ModelRunner(model, batched=False)
    base = runner.new_cache(context + widths + 1)
    mx.eval(runner.forward_rows(base, list(range(1, context + 1)))[-1])
    best = [float("inf")] * widths
    for _ in range(repeats + 1):  # the first round warms every width up; widths interleave so a
        for width in range(1, widths + 1):  # burst of other load spreads over all of them
            rows = list(range(2, width + 2))
            start = time.perf_counter()
            mx.eval(runner.forward_rows(base, rows))
            seconds = time.perf_counter() - start
            trim_prompt_cache(base, width)
            if _ > 0:
                best[width - 1] = min(best[width - 1], seconds)
    runner.release(base)
    for i in range(1, widths):  # a wider pass never costs less
        best[i] = max(best[i], best[i - 1])
    return best
