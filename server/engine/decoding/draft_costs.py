"""Whether a draft model pays on this backend: its passes' measured cost against the target's.

Measured once, at startup (server/draft_assessment.py `assess_draft`), so every request's use of the
draft depends on constants of the deployment only:
- `DraftCosts.step_cost`: one draft-model pass (one proposed token) in target decode steps,
  the per-token cost adaptive speculation weighs (speculative.py AdaptiveDraftLength);
- `drafting_refusal`: why drafting cannot pay even at a high acceptance (then the deployment
  does not draft from it);
- `DraftCosts.prefill_tokens`: the draft prompt chunk that fits a time budget, so one draft
  prefill chunk never holds the engine long (request_state.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

# Acceptance a draft made from the target itself (its quantized copy) reaches on text it
# agrees with: if drafting does not pay even at this, it does not pay for any request.
ASSUMED_ACCEPTANCE = 0.9
# Seconds one engine step may spend on one request's draft prefill: other requests' passes
# wait behind it.
DRAFT_PREFILL_BUDGET_S = 0.2


@dataclass(frozen=True)
class DraftCosts:
    """Seconds of one target decode pass, one draft decode pass and one draft prompt token."""

    target_step_s: float
    draft_step_s: float
    draft_prefill_token_s: float

    @property
    def step_cost(self) -> float:
        """One draft-model pass in target decode passes."""
        return self.draft_step_s / self.target_step_s

    def prefill_tokens(self, budget_s: float = DRAFT_PREFILL_BUDGET_S) -> int:
        """Draft prompt tokens one chunk may hold within `budget_s` (at least one)."""
        return max(1, int(budget_s / max(self.draft_prefill_token_s, 1e-9)))

    def describe(self) -> dict:
        return {"target_step_ms": round(self.target_step_s * 1e3, 2),
                "draft_step_ms": round(self.draft_step_s * 1e3, 2),
                "draft_prefill_ms_per_token": round(self.draft_prefill_token_s * 1e3, 3),
                "draft_step_cost": round(self.step_cost, 3)}


def _timed(clock: Callable[[], float], fn) -> float:
    start = clock()
    fn()
    return clock() - start


def measure_draft_costs(target, draft, *, context: int = 16, repeats: int = 3,
                        clock: Callable[[], float] = time.perf_counter) -> DraftCosts:
    """Both models' one-token decode pass after `context` cached tokens (best of `repeats`,
    after a warm-up), as a drafter runs them (plain model calls on plain caches), and the
    draft's prefill per token: its prompt chunk of `context` - 1 tokens after a one-token
    warm-up, timed once (with the head, which a prompt chunk skips: an upper bound), since a
    slow draft's prefill is what the measurement must not spend long on."""
    prompt = mx.array([list(range(1, context + 1))])

    def measure(model) -> tuple[float, float]:
        cache = make_prompt_cache(model)
        mx.eval(model(prompt[:, :1], cache=cache))
        prefill = _timed(clock, lambda: mx.eval(model(prompt[:, 1:], cache=cache))) / (context - 1)
        best = float("inf")
        for i in range(repeats + 1):
            seconds = _timed(clock, lambda: int(mx.argmax(model(mx.array([[2]]), cache=cache)[0, -1]).item()))
            if i:  # the first one warms up
                best = min(best, seconds)
        return best, prefill

    (target_step, _), (draft_step, draft_prefill) = measure(target), measure(draft)
    return DraftCosts(target_step, draft_step, draft_prefill)


def expected_speedup(step_cost: float, k_max: int, pass_costs: Sequence[float] | None,
                     acceptance: float = ASSUMED_ACCEPTANCE) -> tuple[int, float]:
    """(the best k >= 1, its tokens per unit time relative to plain decoding) for drafts
    accepted with probability `acceptance` each, by the cost model adaptive speculation uses."""
    from lockstep.server.engine.decoding.speculative import AdaptiveDraftLength

    policy = AdaptiveDraftLength(k_max, pass_costs, step_cost)
    p = min(acceptance, 0.999)
    best, best_value, expected = 0, 0.0, 1.0
    for k in range(1, policy.k_max + 1):
        expected += p ** k
        value = expected / policy.cost(k)
        if value > best_value:
            best, best_value = k, value
    return best, best_value


def drafting_refusal(name: str, costs: DraftCosts, k_max: int, pass_costs: Sequence[float] | None) -> str:
    """Why drafting from `name` does not pay on this backend ("" when it may)."""
    k, speedup = expected_speedup(costs.step_cost, k_max, pass_costs)
    if speedup > 1.0:
        return ""
    return (f"drafting from {name} does not pay on this backend: one of its passes costs "
            f"{costs.step_cost:.2f} target passes ({costs.draft_step_s * 1e3:.1f} ms against "
            f"{costs.target_step_s * 1e3:.1f} ms), so even at {ASSUMED_ACCEPTANCE:.0%} acceptance no k up to "
            f"{k_max} decodes faster than plain decoding (the best, k = {k}, reaches {speedup:.2f}x its speed)")
