"""Where decoded tokens come from: one per forward pass, or several per speculative pass.

A token source works in steps, so the engine can put the rows of many requests into one
forward pass. The request's policy: `draft_length(room)` says how many drafts this pass may
verify (the scheduler asks it) and `record(tokens, drafts)` learns from what the pass gave
(the scheduler's update). The model runner's mechanics: `propose(k)` asks the drafter,
the runner runs [last token, *drafts] against the request's own cache, and `verify(logits,
drafts)` chooses the tokens (sample and compare; rejected drafts' KV trimmed). `rows()` and
`take(logits)` are the same four in order, for a source run solo. Both sources choose every
token the same way: `sample` on a (1, vocab) row of the target's logits at its absolute
position. With batch-invariant kernels a row's logits do not depend on how many rows shared
its forward pass, so both give identical tokens, alone or batched.

`drive` runs a source solo, one pass per step through a model runner's `forward_rows` (the
pass the engine's runner makes for one request), for callers without an engine (verify,
bench, tests).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx

from lockstep.server.engine.decoding.sampling import (PendingSample, RowSampling, Sampled, SamplingParams, sample,
                                                      sample_pending)
from lockstep.server.engine.decoding.drafters import DraftModelDrafter, PredictionDrafter, PromptLookupDrafter, never
from lockstep.server.engine.decoding.speculative import AdaptiveDraftLength, DraftBackoff, accept_drafts, agreeing_prefix


@dataclass(frozen=True)
class Step:
    """One decoded token and the target logits row it was chosen from: row `index` of `rows`
    (sliced when read: most steps never read it, and a slice is a graph node)."""

    sampled: Sampled
    rows: mx.array
    index: int = 0

    @property
    def logits(self) -> mx.array:
        return self.rows[self.index]


@dataclass
class SpeculationStats:
    drafted: int = 0
    accepted: int = 0
    passes: int = 0  # target forward passes during decode
    draft_seconds: float = 0.0  # spent proposing drafts (reported, never decides anything)

    @property
    def mean_k(self) -> float:
        """Drafts verified per target pass."""
        return self.drafted / self.passes if self.passes else 0.0


def _unbounded() -> int:
    return 1 << 62


def fast_argmax(params: SamplingParams) -> bool:
    """Greedy without logprobs needs only each row's argmax, exact whatever the row count:
    the engine computes it for a whole pass in one device round trip."""
    return params.greedy and params.top_logprobs is None


def choose_row(row: mx.array, context: list[int], params: SamplingParams, processors=None) -> Sampled:
    """The token following `context`, from the target's logits `row` (vocab,): the request's
    logits processors (if any) see the row first and then the chosen token."""
    if processors is None:
        return sample(row[None], [len(context)], params)[0]
    chosen = sample(processors.process(row, context)[None], [len(context)], params, model_logits=row[None])[0]
    processors.accept(chosen.token)
    return chosen


class PlainSource:
    """One token per forward pass. `context` is the whole sequence so far (extended here).
    `processors` (server/engine/decoding/logits_processors.py) change each row before sampling."""

    def __init__(self, cache: list, context: list[int], params: SamplingParams, stats: SpeculationStats,
                 processors=None):
        self.cache, self.context, self.params, self.stats = cache, context, params, stats
        self.processors = processors

    def draft_length(self, room: int | None = None) -> int:
        return 0

    def propose(self, k: int) -> list[int]:
        return []

    def rows(self, room: int | None = None) -> list[int]:
        return [self.context[-1]]

    def presample(self, logits: mx.array, ahead: int = 0) -> PendingSample | None:
        """The sampling `take` would do for `logits`, built lazily so the engine can compute
        it together with other requests' (None: nothing to build: greedy, or processors).
        `ahead`: for a row that many tokens past the one `take` chooses next."""
        if not self.presamples:
            return None
        return sample_pending(logits, [len(self.context) + ahead], self.params)

    @property
    def presamples(self) -> bool:
        """Whether `presample` builds anything (else the pass's argmax or `verify` chooses)."""
        return not fast_argmax(self.params) and self.processors is None

    def row_sampling(self, ahead: int = 0) -> RowSampling | None:
        """What `presample` of its one row builds, for a pass to build it with other rows' in
        one batch (None: it builds nothing)."""
        return RowSampling(self.params, len(self.context) + ahead) if self.presamples else None

    @property
    def chooses_on_device(self) -> bool:
        """Whether `take` chooses from arrays alone (the pass's argmax, or `presample`'s),
        so the token is known on the device before it reaches the host."""
        return self.processors is None

    def decodes_ahead(self) -> bool:
        """Whether its next row may be built before this pass's token reaches the host
        (server/engine/runner/decode_ahead.py): one row a pass, its token chosen on the device."""
        return self.chooses_on_device

    @staticmethod
    def chosen(argmax: mx.array, pending: PendingSample | None) -> mx.array:
        """The token `take(logits, argmax, pending)` chooses, as a (1,) array (a
        `chooses_on_device` source): `argmax` is the row's argmax."""
        return argmax if pending is None else pending.tokens

    def verify(self, logits: mx.array, drafts: list[int], argmax: list[int] | None = None,
               pending: PendingSample | None = None) -> list[Step]:
        """The token chosen from `logits` (1, vocab) for rows(); `argmax` its row argmax, when
        already computed; `pending` what `presample(logits)` built."""
        if argmax is not None and fast_argmax(self.params) and self.processors is None:
            chosen = Sampled(argmax[0])
        elif pending is not None:
            chosen = pending.result()[0]
        else:
            chosen = choose_row(logits[0], self.context, self.params, self.processors)
        return [Step(chosen, logits)]

    def record(self, tokens: list[int], drafts: list[int]) -> None:
        self.stats.passes += 1
        self.context.extend(tokens)

    def take(self, logits: mx.array, argmax: list[int] | None = None,
             pending: PendingSample | None = None) -> list[Step]:
        """`verify` then `record`, for a source run solo."""
        steps = self.verify(logits, [], argmax, pending)
        self.record([s.sampled.token for s in steps], [])
        return steps


class SpeculativeSource:
    """Up to k + 1 tokens per forward pass: drafts verified by the target (sample and compare).

    Each pass drafts at most `remaining() - 1` tokens (a pass emits up to k + 1), so no work
    is spent past the request's limit; drafting stops early when `cancelled()` turns true.

    With an `adaptive` policy (AdaptiveDraftLength) k is chosen each step from this request's
    acceptance so far, with `k` its upper bound; without one, a cheap drafter backs off
    (DraftBackoff: no drafts verified after a miss). A cheap drafter (prompt lookup, a
    prediction) still proposes while k = 0, and those shadow drafts are compared with the
    tokens that follow, so acceptance keeps being learnt at no cost; an expensive one probes
    now and then.
    `rows(room)` drafts at most room - 1 tokens: the engine's way to say the pass is full.
    """

    def __init__(self, cache: list, context: list[int], params: SamplingParams, drafter, k: int,
                 stats: SpeculationStats, remaining: Callable[[], int] = _unbounded,
                 cancelled: Callable[[], bool] = never, adaptive: AdaptiveDraftLength | None = None,
                 processors=None, backoff: bool = False):
        self.cache, self.context, self.params = cache, context, params
        self.processors = processors
        self.drafter, self.k, self.stats = drafter, k, stats
        self.remaining, self.cancelled = remaining, cancelled
        self.adaptive = adaptive
        # no adaptive policy: a cheap drafter still stops verifying drafts that fail
        self.backoff = (DraftBackoff(k) if backoff and adaptive is None and getattr(drafter, "cheap", False)
                        else None)
        self.drafts: list[int] = []
        self._probed = False
        self._kind = 0  # evidence class of this step's drafts (AdaptiveDraftLength)
        self._shadow: tuple[int, list[int], int] | None = None  # (position, drafts, class) awaiting tokens
        self._guessing = True  # a cheap drafter's last proposal (real or shadow) had drafts

    def _propose(self, k: int) -> list[int]:
        start = time.perf_counter()
        drafts = self.drafter.propose(self.context, k, self.cancelled)
        self.stats.draft_seconds += time.perf_counter() - start
        return drafts

    def _match_class(self) -> int:
        """Prompt lookup: acceptance is kept per length of the matched suffix."""
        match = getattr(self.drafter, "match", None)
        if match is None:
            return 0
        start = time.perf_counter()
        kind = self.drafter.match_class(match(self.context)[1])
        self.stats.draft_seconds += time.perf_counter() - start
        return kind

    def draft_length(self, room: int | None = None) -> int:
        """Drafts this pass may verify: the policy's k, within what the request may still emit
        and the `room` the pass has left (rows, this request's first one included)."""
        cheap = getattr(self.drafter, "cheap", False)
        if self.backoff is not None:
            k_now = min(self.k, self.backoff.choose())
        elif self.adaptive is None:
            k_now = self.k
        else:
            self._kind = self._match_class()
            k_now = min(self.k, self.adaptive.choose(probe=not cheap, kind=self._kind))
            self._probed = not cheap and k_now > 0 and self.adaptive.best_k(self._kind) == 0
        k_now = min(k_now, self.remaining() - 1)
        if room is not None:
            k_now = min(k_now, room - 1)
        return max(0, k_now)

    def propose(self, k: int) -> list[int]:
        """Up to `k` drafts from the drafter (fewer where it has no guess)."""
        if k <= 0:
            return []
        drafts = self._propose(k)
        self._guessing = bool(drafts)
        return drafts

    # A pass that verifies no drafts has one row, sampled as a plain source samples it (so it
    # joins the pass's sampling batches, and a row may be decoded ahead on its token).
    presamples = PlainSource.presamples
    row_sampling = PlainSource.row_sampling
    chooses_on_device = PlainSource.chooses_on_device
    chosen = staticmethod(PlainSource.chosen)

    def presample(self, logits: mx.array, ahead: int = 0) -> PendingSample | None:
        """A one-row pass's sampling as a plain source builds it; None for a pass with drafts
        (`verify` samples those rows itself)."""
        return PlainSource.presample(self, logits, ahead) if logits.shape[0] == 1 else None

    def resting(self) -> bool:
        """Whether it verifies no drafts next step, as the evidence stands: a cheap drafter
        backed off after a miss, or had no guess when last asked (no n-gram of the context in
        the prompt, a prediction used up or out of line), or k = 0. (Its shadow draft may
        bring drafting back with the token now in flight; a row built ahead then verifies
        none, one step late.) A drafter without a shadow (fixed k) rests only at k = 0: a
        shadow is what would tell it has a guess again."""
        if self._shadows and not self._guessing:
            return True
        if self.backoff is not None:
            return self.backoff.choose() == 0
        return self.adaptive is None and self.k == 0

    def decodes_ahead(self) -> bool:
        """Whether its next row may be built before this pass's token reaches the host: while
        it rests, it decodes as a plain request does (its drafts cost it passes decoded ahead
        otherwise, issue 54)."""
        return self.chooses_on_device and self.resting()

    def rows(self, room: int | None = None) -> list[int]:
        self.drafts = self.propose(self.draft_length(room))
        return [self.context[-1], *self.drafts]

    @property
    def _shadows(self) -> bool:
        """Whether it proposes shadow drafts: a cheap drafter whose k policy learns (the
        back-off or adaptive k)."""
        return (self.adaptive is not None or self.backoff is not None) and getattr(self.drafter, "cheap", False)

    def _propose_shadow(self, drafts: list[int]) -> None:
        """A cheap drafter's guess where this pass verified none, scored once the tokens it
        guessed are known (acceptance keeps being learnt while k = 0)."""
        shadow_k = min(self.k, self.remaining() - 1)  # no guess past the answer's end can be scored
        if self._shadows and not drafts and self._shadow is None and shadow_k > 0:
            shadow = self._propose(shadow_k)
            self._guessing = bool(shadow)
            if shadow:
                self._shadow = (len(self.context), shadow, self._kind)

    def _settle_shadow(self) -> None:
        """Score the pending shadow drafts once the tokens they guessed are known."""
        position, drafts, kind = self._shadow
        actual = self.context[position:position + len(drafts)]
        agreed = agreeing_prefix(drafts, actual)
        if self.adaptive is None:  # the back-off resumes on the first token's agreement
            if actual:
                self.backoff.record_shadow(agreed > 0)
                self._shadow = None
        elif agreed < len(actual) or len(actual) == len(drafts):
            self.adaptive.record(len(drafts), agreed, kind=kind)
            self._shadow = None

    def verify(self, logits: mx.array, drafts: list[int], argmax: list[int] | None = None,
               pending: PendingSample | None = None) -> list[Step]:
        """The tokens chosen from `logits` (1 + len(drafts), vocab) for [last token, *drafts]:
        the agreeing drafts, then the target's own; rejected drafts' KV rows are trimmed from
        the cache. `pending`: what `presample` built for a pass without drafts."""
        if pending is not None and not drafts:
            return [Step(pending.result()[0], logits)]
        base = len(self.context)
        use_argmax = argmax is not None and fast_argmax(self.params) and self.processors is None
        picked: list[Step] = []

        def choose(row, i):
            if use_argmax:
                chosen = Sampled(argmax[i])
            elif self.processors is None:
                chosen = sample(row[None], [base + i], self.params)[0]
            else:  # row i follows the context and the i drafts accepted before it
                chosen = choose_row(row, self.context + [s.sampled.token for s in picked],
                                    self.params, self.processors)
            picked.append(Step(chosen, logits, i))
            return chosen.token

        accept_drafts(logits, self.cache, drafts, choose)
        return picked

    def record(self, tokens: list[int], drafts: list[int]) -> None:
        """The pass verified `drafts` and chose `tokens` (the accepted drafts, then the target's own)."""
        self._propose_shadow(drafts)
        drafted, accepted = len(drafts), len(tokens) - 1
        self.stats.passes += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self.context.extend(tokens)
        if self.adaptive is not None:
            self.adaptive.record(drafted, accepted, self._probed, self._kind)
        elif self.backoff is not None:
            self.backoff.record(drafted, accepted)
        if self._shadow is not None:
            self._settle_shadow()

    def take(self, logits: mx.array, argmax: list[int] | None = None) -> list[Step]:
        """`verify` then `record` for rows(), for a source run solo."""
        steps = self.verify(logits, self.drafts, argmax)
        self.record([s.sampled.token for s in steps], self.drafts)
        return steps


def draft_cost_estimate(target, draft) -> float:
    """A draft-model pass's cost in target passes, by depth (decode of small models is bound
    by per-layer launches, not arithmetic)."""
    def depth(model) -> int:
        layers = getattr(model, "layers", None) or getattr(getattr(model, "model", None), "layers", None)
        return len(layers) if layers else 1

    return depth(draft) / depth(target) if target is not None else 1.0


@dataclass(frozen=True)
class DecodeInputs:
    """What one request decodes from: its cache, its tokens so far (extended as it decodes),
    its sampling and logits processors (server/engine/decoding/logits_processors.py), how
    many tokens it may still emit (`remaining()`) and whether its client left (`cancelled()`)."""

    cache: list
    context: list[int]
    params: SamplingParams
    processors: object | None = None
    remaining: Callable[[], int] = _unbounded
    cancelled: Callable[[], bool] = never


@dataclass(frozen=True)
class Speculation:
    """How a request drafts: its speculative `method` ("none", "draft", "prompt_lookup",
    "prediction": drafts from `prediction`, the client's predicted answer as token ids) and k;
    with `adaptive`, k is chosen per step up to `k` (AdaptiveDraftLength, weighing
    `pass_costs`, the deployment's per-width pass costs, and `draft_cost`, a draft-model pass
    in target passes as measured at startup; None: estimated from the depths of `target` and
    `draft_model`); without, a cheap drafter backs off after a miss where `backoff` (the
    server's default, `Deployment.draft_backoff`; tools such as `lockstep verify` and `bench`
    keep fixed k, so every pass width they check or time is exercised)."""

    method: str = "none"
    k: int = 0
    adaptive: bool = False
    backoff: bool = False
    prediction: tuple[int, ...] = ()
    draft_model: object | None = None
    target: object | None = None
    pass_costs: object | None = None
    draft_cost: float | None = None


NO_SPECULATION = Speculation()


def make_source(inputs: DecodeInputs, stats: SpeculationStats, speculation: Speculation = NO_SPECULATION):
    """The two-phase source decoding `inputs` as `speculation` says."""
    cache, context, params = inputs.cache, inputs.context, inputs.params
    method = speculation.method
    if method == "none":
        return PlainSource(cache, context, params, stats, inputs.processors)
    if method == "draft":
        drafter = DraftModelDrafter(speculation.draft_model)
    elif method == "prediction":
        drafter = PredictionDrafter(speculation.prediction, start=len(context))
    else:
        drafter = PromptLookupDrafter()
    policy = None
    if speculation.adaptive:
        draft_cost = speculation.draft_cost
        if method != "draft":
            draft_cost = 0.0
        elif draft_cost is None:
            draft_cost = draft_cost_estimate(speculation.target, speculation.draft_model)
        policy = AdaptiveDraftLength(speculation.k, speculation.pass_costs, draft_cost)
    return SpeculativeSource(cache, context, params, drafter, speculation.k, stats, inputs.remaining,
                             inputs.cancelled, policy, inputs.processors, speculation.backoff)


def drive(source, runner, cache) -> Iterator[list[Step]]:
    """Run `source` solo: each pass is `runner.forward_rows(cache, rows)` (a ModelRunner's
    pass for one request, server/engine/runner/model_runner.py)."""
    while True:
        rows = source.rows()
        if source_cancelled(source):
            return
        logits = runner.forward_rows(cache, rows)
        argmax = mx.argmax(logits, axis=-1).tolist() if fast_argmax(source.params) else None
        yield source.take(logits, argmax)


def source_cancelled(source) -> bool:
    cancelled = getattr(source, "cancelled", None)
    return bool(cancelled and cancelled())


def token_source(runner, cache, context: list[int], params: SamplingParams,
                 stats: SpeculationStats, method: str = "none", k: int = 0, draft_model=None,
                 remaining: Callable[[], int] = _unbounded, cancelled: Callable[[], bool] = never):
    """A generator of token batches for `method` with k drafts, one solo pass per batch.

    `remaining()` is how many tokens the request may still emit; `cancelled()` whether its
    client is gone (checked between draft passes, so one step never runs k passes for nobody).
    """
    source = make_source(DecodeInputs(cache, context, params, remaining=remaining, cancelled=cancelled), stats,
                         Speculation(method, k, draft_model=draft_model))
    return drive(source, runner, cache)

