"""Per-request changes to a logits row before sampling: penalties, logit_bias, a grammar mask.

Each works on one (vocab,) row at a time and depends only on the request's own tokens so
far, never on which rows shared the forward pass: a constrained or penalised deterministic
request stays bit-identical alone, batched or speculative. In speculative verification row
i sees the context extended by the i drafts before it (exactly the tokens accepted if row i
is reached), and the grammar advances only with tokens actually chosen, so a draft the
grammar forbids is simply never sampled and so rejected.

As OpenAI defines them:
- frequency_penalty: subtract penalty × (times the token was generated so far);
- presence_penalty: subtract penalty once if the token was generated at all;
- logit_bias: add the bias for that token id (-100 bans it, 100 all but forces it).
Only completion tokens count for penalties, not the prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.presence or self.frequency)

    def apply(self, row: mx.array, generated: list[int]) -> mx.array:
        if not generated:
            return row
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        ids, counts = ids[ids < row.shape[-1]], counts[ids < row.shape[-1]]
        penalty = np.zeros(row.shape[-1], dtype=np.float32)
        penalty[ids] = self.frequency * counts + self.presence
        return row.astype(mx.float32) - mx.array(penalty)


class LogitBias:
    def __init__(self, bias: dict[int, float], vocab: int):
        dense = np.zeros(vocab, dtype=np.float32)
        for token, value in bias.items():
            if 0 <= token < vocab:
                dense[token] = value
        self._bias = mx.array(dense)

    def apply(self, row: mx.array) -> mx.array:
        return row.astype(mx.float32) + self._bias


class LogitsProcessors:
    """The request's processors in OpenAI's order (bias and penalties, then the grammar mask).

    `process(row, context)` for the row whose token follows `context` (prompt + generated);
    `accept(token)` once that token is chosen; `finished` when the grammar admits nothing more.
    """

    def __init__(self, prompt_length: int, penalties: Penalties = Penalties(),
                 bias: LogitBias | None = None, matcher=None):
        self.prompt_length = prompt_length
        self.penalties, self.bias, self.matcher = penalties, bias, matcher

    def process(self, row: mx.array, context: list[int]) -> mx.array:
        if self.bias is not None:
            row = self.bias.apply(row)
        if self.penalties:
            row = self.penalties.apply(row, context[self.prompt_length:])
        if self.matcher is not None:
            row = apply_mask(row, self.matcher.allowed())
        return row

    def accept(self, token: int) -> None:
        if self.matcher is not None:
            self.matcher.consume(token)

    @property
    def finished(self) -> bool:
        return self.matcher is not None and self.matcher.finished


def logits_width(loaded) -> int:
    """The model's vocabulary as its logits see it (may exceed the tokenizer's)."""
    args = getattr(loaded.model, "args", None)
    return int(getattr(args, "vocab_size", 0) or len(loaded.tokenizer))


def processors_for(request, loaded) -> LogitsProcessors | None:
    """The processors a GenerationRequest asks for, or None (the fast path: plain sampling)."""
    penalties = Penalties(request.presence_penalty, request.frequency_penalty)
    bias = LogitBias(dict(request.logit_bias), logits_width(loaded)) if request.logit_bias else None
    matcher = request.grammar.matcher() if request.grammar is not None else None
    if not penalties and bias is None and matcher is None:
        return None
    return LogitsProcessors(len(request.prompt_tokens), penalties, bias, matcher)


def apply_mask(logits_row: mx.array, allowed: mx.array) -> mx.array:
    """`logits_row` (vocab,) with -inf where `allowed` is False; keeps the dtype."""
    return mx.where(allowed, logits_row, mx.array(-mx.inf, dtype=logits_row.dtype))
