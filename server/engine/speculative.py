"""Speculative decoding: a drafter proposes k tokens, the target verifies them in one pass.

The emitted token at every position is chosen from the *target's* logits for that
position by the same position-keyed sampler plain decoding uses ("sample and compare").
So when the target gives bit-identical logits for a row in a block and alone (the
batch-invariant mode), speculative output equals plain output token for token; the
drafter only changes how many forward passes that takes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


def _never() -> bool:
    return False

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache


class PromptLookupDrafter:
    """Drafts the continuation of the most recent earlier match of the context's tail n-gram."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def propose(self, context: Sequence[int], k: int, cancelled: Callable[[], bool] = _never) -> list[int]:
        n_ctx = len(context)
        for n in range(min(self.max_ngram, n_ctx - 1), 0, -1):
            tail = list(context[n_ctx - n:])
            # scan right to left: the most recent match predicts local repetition best
            for start in range(n_ctx - n - 1, -1, -1):
                if list(context[start:start + n]) == tail:
                    continuation = list(context[start + n:start + n + k])
                    if continuation:
                        return continuation
        return []


class DraftModelDrafter:
    """Greedy drafts from a smaller (e.g. quantized) model with its own KV cache.

    The draft cache is kept in step with the accepted context by trimming back to the
    common prefix, so rejected drafts never leak into later proposals.
    """

    name = "draft"

    def __init__(self, model):
        self.model = model
        self.cache = make_prompt_cache(model)
        self.tokens: list[int] = []  # tokens whose KV is in self.cache

    def _feed(self, tokens: list[int]) -> mx.array:
        logits = self.model(mx.array(tokens)[None], cache=self.cache)[0, -1]
        self.tokens.extend(tokens)
        return logits

    def propose(self, context: Sequence[int], k: int, cancelled: Callable[[], bool] = _never) -> list[int]:
        """Up to k greedy drafts; fewer if `cancelled()` turns true (one draft pass each)."""
        common = 0
        limit = min(len(self.tokens), len(context) - 1)  # always re-feed the last token
        while common < limit and self.tokens[common] == context[common]:
            common += 1
        if common < len(self.tokens):
            trim_prompt_cache(self.cache, len(self.tokens) - common)
            del self.tokens[common:]
        logits = self._feed(list(context[common:]))
        drafts: list[int] = []
        for i in range(k):
            token = int(mx.argmax(logits).item())
            drafts.append(token)
            if i + 1 < k:
                if cancelled():  # the client left: no more passes for nobody
                    break
                logits = self._feed([token])
        return drafts


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


def verify_step(
    forward: Callable[[list[int]], mx.array],
    cache: list,
    last_token: int,
    drafts: list[int],
    choose: Callable[[mx.array, int], int],
) -> VerifiedStep:
    """Run the target on [last_token, *drafts] (`forward(tokens)` returns (len(tokens), vocab)
    logits and appends their KV to `cache`) and keep the agreeing prefix (`accept_drafts`)."""
    return accept_drafts(forward([last_token, *drafts]), cache, drafts, choose)
