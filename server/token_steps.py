"""Where decoded tokens come from: one per forward pass, or several per speculative pass.

Both sources choose every token the same way: `sample` on a (1, vocab) row of the
target's logits at its absolute position. With batch-invariant kernels a row's logits do
not depend on how many rows shared its forward pass, so both give identical tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx

from server.sampling import Sampled, SamplingParams, sample
from server.speculative import DraftModelDrafter, PromptLookupDrafter, verify_step


@dataclass(frozen=True)
class Step:
    """One decoded token and the target logits row it was chosen from."""

    sampled: Sampled
    logits: mx.array


@dataclass
class SpeculationStats:
    drafted: int = 0
    accepted: int = 0
    passes: int = 0  # target forward passes during decode


def plain_tokens(step, model, cache, context: list[int], params: SamplingParams,
                 stats: SpeculationStats) -> Iterator[list[Step]]:
    """One token per forward pass. `context` is the whole sequence so far (extended here)."""
    while True:
        logits = step(model, cache, [context[-1]])[-1:]
        stats.passes += 1
        chosen = sample(logits, [len(context)], params)[0]
        context.append(chosen.token)
        yield [Step(chosen, logits[0])]


def _unbounded() -> int:
    return 1 << 62


def _never() -> bool:
    return False


def speculative_tokens(step, model, cache, context: list[int], params: SamplingParams,
                       drafter, k: int, stats: SpeculationStats,
                       remaining: Callable[[], int] = _unbounded,
                       cancelled: Callable[[], bool] = _never) -> Iterator[list[Step]]:
    """Up to k + 1 tokens per forward pass: drafts verified by the target (sample and compare).

    Each pass drafts at most `remaining() - 1` tokens (a pass emits up to k + 1), so no work
    is spent past the request's limit; it ends early when `cancelled()` turns true.
    """
    # Greedy without logprobs needs only argmax, which is exact whatever the row count: one
    # device round trip per pass instead of one per row.
    batch_argmax = params.greedy and params.top_logprobs is None
    while True:
        k_now = min(k, remaining() - 1)
        drafts = drafter.propose(context, k_now, cancelled) if k_now > 0 else []
        if cancelled():
            return
        base = len(context)
        picked: list[Step] = []
        argmaxes: list[int] = []

        def choose(row, i, rows_argmax=argmaxes):
            if batch_argmax:
                chosen = Sampled(rows_argmax[i])
            else:
                chosen = sample(row[None], [base + i], params)[0]
            picked.append(Step(chosen, row))
            return chosen.token

        def forward(tokens):
            rows = step(model, cache, tokens)
            if batch_argmax:
                argmaxes.extend(mx.argmax(rows, axis=-1).tolist())
            return rows

        verified = verify_step(forward, cache, context[-1], drafts, choose)
        stats.passes += 1
        stats.drafted += verified.drafted
        stats.accepted += verified.accepted
        context.extend(verified.tokens)
        yield picked


def token_source(step, model, cache, context: list[int], params: SamplingParams,
                 stats: SpeculationStats, method: str = "none", k: int = 0, draft_model=None,
                 remaining: Callable[[], int] = _unbounded, cancelled: Callable[[], bool] = _never):
    """The source for a speculative `method` ("none", "draft", "prompt_lookup") with k drafts.

    `remaining()` is how many tokens the request may still emit; `cancelled()` whether its
    client is gone (checked between draft passes, so one step never runs k passes for nobody).
    """
    if method == "none":
        return plain_tokens(step, model, cache, context, params, stats)
    drafter = DraftModelDrafter(draft_model) if method == "draft" else PromptLookupDrafter()
    return speculative_tokens(step, model, cache, context, params, drafter, k, stats, remaining, cancelled)
