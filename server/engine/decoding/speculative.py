"""Speculative decoding: a drafter proposes k tokens, the target verifies them in one pass.

The emitted token at every position is chosen from the *target's* logits for that
position by the same position-keyed sampler plain decoding uses ("sample and compare").
So when the target gives bit-identical logits for a row in a block and alone (the
batch-invariant mode), speculative output equals plain output token for token; the
drafter only changes how many forward passes that takes.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Sequence


def never() -> bool:
    """The `cancelled` of a request nobody can cancel (tools, tests)."""
    return False


import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache


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
