"""Drafters: where a speculative step's drafts come from.

A drafter proposes up to k tokens to follow a context (`propose(context, k, cancelled)`):
prompt lookup (the context's own recurring text), a request's prediction (OpenAI's Predicted
Outputs) or a draft model (a smaller model, or the target's first layers). `cheap` says
whether proposing costs a forward pass; the cheap ones also report the evidence of their
match (`match`, `match_class`), which the speculation policy (speculative.py) keeps
acceptance by. A drafter only proposes: the target verifies every draft, so what it drafts
changes how many passes a text takes, never the text.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache


def never() -> bool:
    """The `cancelled` of a request nobody can cancel (tools, tests)."""
    return False


class PromptLookupDrafter:
    """Drafts what followed the most recent earlier occurrence of the context's longest
    recurring suffix (prompt and generated text alike): suffixes of `max_ngram` tokens down
    to `min_ngram` are tried, longest first; no recurrence, no drafts.

    One right-to-left scan over the earlier positions holding the last token measures how far
    each match extends backwards, so a proposal costs O(context) Python steps (a small share
    of a decode step; `lockstep bench` reports it).
    """

    name = "prompt_lookup"
    cheap = True  # proposing costs no forward pass: acceptance can be tracked for free

    def __init__(self, max_ngram: int = 8, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def match(self, context: Sequence[int]) -> tuple[int, int]:
        """(end, n): the longest suffix of length n (<= max_ngram) that also ends at an earlier
        position `end` (exclusive), the most recent one among equally long; (0, 0) when none
        reaches min_ngram."""
        n_ctx = len(context)
        if n_ctx < 2:
            return 0, 0
        last = context[-1]
        best_end, best_n = 0, 0
        for end in range(n_ctx - 1, 0, -1):  # candidate match ends at context[end - 1]
            if context[end - 1] != last:
                continue
            n = 1
            limit = min(self.max_ngram, end)
            while n < limit and context[end - 1 - n] == context[n_ctx - 1 - n]:
                n += 1
            if n > best_n:  # strictly longer: ties keep the more recent (found first)
                best_end, best_n = end, n
                if n == self.max_ngram:
                    break
        return (best_end, best_n) if best_n >= self.min_ngram else (0, 0)

    def propose(self, context: Sequence[int], k: int, cancelled: Callable[[], bool] = never) -> list[int]:
        if k < 1:
            return []
        end, n = self.match(context)
        return list(context[end:end + k]) if n else []

    @staticmethod
    def match_class(n: int) -> int:
        """Evidence class of a match of n tokens, for acceptance kept per class."""
        return 0 if n <= 1 else 1 if n <= 3 else 2


class PredictionIndex:
    """Where every n-gram of a prediction (n = 1..max_ngram) ends, so re-aligning the output
    with the prediction looks at a few positions, not every occurrence of its last token (a
    prediction of one phrase repeated holds thousands).

    Each n-gram gets a dense rank: level 1 ranks the tokens, level n the pairs (its first
    token, the rank of the (n - 1)-gram after it). Per level, the end positions are grouped by
    rank and sorted, so the match nearest a given position is a binary search away.
    """

    def __init__(self, prediction: Sequence[int], max_ngram: int):
        tokens = np.asarray(prediction, dtype=np.int64)
        size = len(tokens)
        self.levels: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (keys, offsets, ends)
        rank = None
        for n in range(1, min(max_ngram, size) + 1):
            ends = np.arange(n - 1, size)
            # rank[j] is the rank of the (n - 1)-gram ending at n - 2 + j: drop the first
            key = tokens if n == 1 else (tokens[:size - n + 1] << 32) | rank[1:]
            keys, rank = np.unique(key, return_inverse=True)
            rank = rank.reshape(-1)
            order = np.argsort(rank, kind="stable")  # stable: ends ascend within a rank
            offsets = np.concatenate(([0], np.cumsum(np.bincount(rank, minlength=len(keys)))))
            self.levels.append((keys, offsets, ends[order]))

    def ranks(self, suffix: Sequence[int]) -> list[int]:
        """Ranks of suffix's last 1, 2, ... tokens as n-grams of the prediction, as long as they
        occur in it."""
        found: list[int] = []
        for n, (keys, _, _) in enumerate(self.levels, start=1):
            if n > len(suffix):
                break
            token = int(suffix[-n])
            if not 0 <= token < 1 << 31:
                break  # no token id of the prediction
            key = token if n == 1 else (token << 32) | found[-1]
            j = int(np.searchsorted(keys, key))
            if j == len(keys) or int(keys[j]) != key:
                break
            found.append(j)
        return found

    def ends(self, n: int, rank: int) -> np.ndarray:
        """Sorted end positions of the n-gram of this rank."""
        _, offsets, ends = self.levels[n - 1]
        return ends[offsets[rank]:offsets[rank + 1]]


@functools.lru_cache(maxsize=8)
def prediction_index(prediction: tuple[int, ...], max_ngram: int) -> PredictionIndex:
    """The index of a prediction, built once for all choices of a request (n > 1)."""
    return PredictionIndex(prediction, max_ngram)


class PredictionDrafter:
    """Drafts the client's predicted answer (OpenAI's Predicted Outputs): the next k tokens of
    the prediction from where the output agrees with it.

    The output is followed along the prediction token by token; at the first disagreement
    the alignment is lost, and found again from the output's longest recent suffix (up to
    `max_ngram` tokens) that occurs in the prediction, as prompt lookup matches over the
    prompt. Among equally long matches the nearest one at or after the point of divergence
    wins (an edit moves the output forward through the prediction), else the nearest one
    before it. A one-token match counts only within `window` tokens after the divergence
    (the token after a small edit), since common tokens recur everywhere. No alignment, or
    the prediction used up: no drafts. Proposing runs no model (`cheap`).

    Re-alignment goes through a `PredictionIndex`: at most two positions per suffix length
    are examined (`examined` counts them), however long the prediction and however often
    its phrases recur.
    """

    name = "prediction"
    cheap = True

    def __init__(self, prediction: Sequence[int], start: int, max_ngram: int = 8, window: int = 8):
        self.prediction = tuple(prediction)
        self.start = start  # context[start:] is the output (the context begins with the prompt)
        self.max_ngram, self.window = max_ngram, window
        self.index = prediction_index(self.prediction, max_ngram)
        self.examined = 0  # prediction positions re-alignment has looked at, in all
        self._seen = 0  # output tokens followed so far
        self._next: int | None = 0  # prediction index the next output token should match; None: lost
        self._run = 0  # output tokens agreeing with the prediction in a row, up to now
        self._lost_at = 0  # prediction index where the alignment was last lost

    def _follow(self, context: Sequence[int]) -> None:
        size = len(self.prediction)
        for pos in range(self.start + self._seen, len(context)):
            token = context[pos]
            if self._next is not None and self._next < size and self.prediction[self._next] == token:
                self._next += 1
                self._run += 1
            else:
                if self._next is not None:
                    self._lost_at = self._next
                self._next, self._run = None, 0
        self._seen = len(context) - self.start
        if self._next is None:
            self._next, self._run = self._realign(context[max(self.start, len(context) - self.max_ngram):])

    def _realign(self, suffix: Sequence[int]) -> tuple[int | None, int]:
        """(prediction index after the best match of `suffix` (the output's last tokens), its
        length), or (None, 0). The longest match wins; among equally long ones the nearest at
        or after the divergence, else the nearest before it; a one-token match only forward,
        within `window`."""
        last = len(self.prediction) - 1  # a match ending here leaves nothing to draft
        ranks = self.index.ranks(suffix)
        for n in range(len(ranks), 0, -1):
            ends = self.index.ends(n, ranks[n - 1])
            j = int(np.searchsorted(ends, self._lost_at))  # ends[j:] end at or after the divergence
            if j < len(ends):
                self.examined += 1
                i = int(ends[j])
                if i < last and (n > 1 or i + 1 - self._lost_at <= self.window):
                    return i + 1, n
            if n > 1:
                j = int(np.searchsorted(ends, min(self._lost_at, last)))  # ends[:j] end before both
                if j > 0:
                    self.examined += 1
                    return int(ends[j - 1]) + 1, n
        return None, 0

    def match(self, context: Sequence[int]) -> tuple[int, int]:
        """(prediction index drafting starts at, agreeing run length), for acceptance kept per
        evidence class (`match_class`); (0, 0) when not aligned."""
        self._follow(context)
        return (self._next, self._run) if self._next is not None else (0, 0)

    def propose(self, context: Sequence[int], k: int, cancelled: Callable[[], bool] = never) -> list[int]:
        self._follow(context)
        if k < 1 or self._next is None:
            return []
        return list(self.prediction[self._next:self._next + k])

    match_class = staticmethod(PromptLookupDrafter.match_class)


class DraftModelDrafter:
    """Greedy drafts from a smaller (e.g. quantized) model with its own KV cache.

    The draft cache is kept in step with the accepted context by trimming back to the
    common prefix, so rejected drafts never leak into later proposals.
    """

    name = "draft"
    cheap = False  # every draft is a forward pass of the draft model

    def __init__(self, model):
        self.model = model
        self.cache = make_prompt_cache(model)
        self.tokens: list[int] = []  # tokens whose KV is in self.cache

    @property
    def prefilled(self) -> int:
        """Tokens whose KV is in the draft cache."""
        return len(self.tokens)

    def pending(self, prompt_tokens: int) -> int:
        """Prompt tokens still to prefill (the model runner feeds them in chunks, like the
        target's; a whole prompt in one call would hold the engine for all of it)."""
        return max(0, prompt_tokens - len(self.tokens))

    def advance(self, tokens: list[int]) -> None:
        """`tokens` were fed into the draft cache by the model runner."""
        self.tokens.extend(tokens)

    def _feed(self, tokens: list[int]) -> mx.array:
        logits = self.model(mx.array(tokens)[None], cache=self.cache)[0, -1]
        self.tokens.extend(tokens)
        return logits

    def propose(self, context: Sequence[int], k: int, cancelled: Callable[[], bool] = never) -> list[int]:
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


class EarlyExitModel:
    """The target's first `exit_layer` layers, its final norm and its own head: a draft
    model sharing the target's weights and tokenizer (self-speculation), with caches of its
    own (`make_prompt_cache` sees only these layers). Llama-shaped models only (an
    `embed_tokens`, `layers`, `norm` body, no sliding-window layers)."""

    def __init__(self, target, exit_layer: int):
        body = getattr(target, "model", None)
        layers = getattr(body, "layers", None)
        if body is None or layers is None or not all(hasattr(body, a) for a in ("embed_tokens", "norm")):
            raise ValueError("self-speculation needs a llama-shaped model (model.embed_tokens, layers, norm)")
        if getattr(body, "swa_idx", None) is not None:
            raise ValueError("self-speculation does not support sliding-window layers")
        if not 1 <= exit_layer < len(layers):
            raise ValueError(f"the exit layer must be in 1..{len(layers) - 1} (the target has {len(layers)} layers)")
        self.target, self.body, self.exit_layer = target, body, exit_layer
        self.layers = list(layers[:exit_layer])

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        from mlx_lm.models.base import create_attention_mask

        h = self.body.embed_tokens(inputs)
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        h = self.body.norm(h)
        args = getattr(self.target, "args", None)
        if getattr(args, "tie_word_embeddings", False) or not hasattr(self.target, "lm_head"):
            return self.body.embed_tokens.as_linear(h)
        return self.target.lm_head(h)


def draft_tokenizer_problem(target_tokenizer, draft_tokenizer) -> str | None:
    """Why a draft model's tokenizer cannot draft for the target (None when it can): the
    target verifies draft token ids as its own, so both must map ids to the same strings."""
    def vocab(tokenizer):
        get = getattr(tokenizer, "get_vocab", None)
        return get() if callable(get) else None

    target_vocab, draft_vocab = vocab(target_tokenizer), vocab(draft_tokenizer)
    if target_vocab is None or draft_vocab is None:
        return "cannot read the vocabulary of the draft or target tokenizer to compare them"
    if target_vocab != draft_vocab:
        only_target = len(set(target_vocab.items()) - set(draft_vocab.items()))
        return (f"the draft model's tokenizer differs from the target's (vocabularies of "
                f"{len(draft_vocab)} and {len(target_vocab)} tokens, {only_target} of the target's "
                f"token ids map differently): drafts would be verified as the wrong tokens")
    return None
