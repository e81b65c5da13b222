"""One request's progress: prefill its prompt in chunks, then decode rows the engine batches.

A `RequestState` holds a request's progress; it runs no forward pass itself (the model
runner does, server/engine/runner/model_runner.py):
- while `prefilling`, `next_prefill()` names the next prompt chunk (aligned to absolute
  positions, kernels/invariance/prefill.py) and the cache it goes to: the target's, then,
  with a draft model, the draft's (chunked the same way, and no wider than its measured cost
  allows within a time budget, server/engine/decoding/draft_costs.py, so a long prompt never holds the
  engine for more than a chunk); `chunk_written()` records it;
- then `draft_length(room)` says how many drafts its next pass may verify (the scheduler
  asks; the model runner drafts, runs and samples), and `advance(sampled)` turns the tokens
  that pass chose (step_data.SampledTokens) into `Delta`s: text (stop strings held back),
  logprobs, and a finish reason on the last one.

The prompt's last token is the first decode row, so every logits row a token is chosen from
comes from a decode pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from lockstep.kernels.batching.kv_pool import fill_prefix, is_pooled
from lockstep.kernels.invariance.prefill import chunk_end, exact_length, resume_at, whole_chunks_are_canonical

from lockstep.server.engine.guarantee.decode_plan import PLAIN, DecodePlan, Determinism

from lockstep.server.engine.guarantee.deployment import PREFILL_CHUNK, Deployment
from lockstep.server.engine.decoding.logits_processors import processors_for
from lockstep.server.engine.cache.prefix_cache import PrefixCache, copy_prefix, namespace
from lockstep.server.engine.decoding.sampling import SamplingParams
from lockstep.server.engine.guarantee.receipt import Receipt
from lockstep.server.engine.decoding.request_report import RequestReport
from lockstep.server.engine.decoding.stops import IncrementalDecoder, StopTextStream
from lockstep.server.engine.decoding.drafters import never
from lockstep.server.engine.runner.step_data import SampledTokens
from lockstep.server.engine.decoding.token_steps import DecodeInputs, Speculation, SpeculationStats, make_source


@dataclass(frozen=True)
class GenerationRequest:
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    # Determinism and speculation are the request's DecodePlan (server/engine/guarantee/decode_plan.py).
    # Per-row logits processing (server/engine/decoding/logits_processors.py).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: object | None = None  # a compiled server.engine.structured.grammar.Grammar
    # Predicted Outputs: the client's draft of the answer as token ids, drafted from when the
    # plan's method is "prediction" (server/engine/decoding/drafters.py PredictionDrafter).
    prediction: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]  # the most likely alternatives, most likely first


@dataclass
class Delta:
    """New output for one request since its previous Delta."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # start of each token in the output
    finish_reason: str | None = None
    report: RequestReport | None = None  # what the request reports (the `lockstep` object), on the final Delta
    stop_sequence: str | None = None  # the stop string that ended the output, on the final Delta
    token_ids: tuple[int, ...] | None = None  # every chosen token id, on the final Delta
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class _TokenTexts:
    """Token id -> text, memoised (logprobs ask for the same alternatives repeatedly)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self._tokenizer.decode([token])
        return self._texts[token]


@dataclass(frozen=True)
class PrefillStep:
    """The next prompt chunk of a request: `tokens` go into `cache` of `model` ("target" or
    "draft"); `follow`: nothing to run, the request copies its leader's prompt KV."""

    model: str
    cache: list | None
    tokens: list[int]
    follow: bool = False


class RequestState:
    def __init__(self, loaded, request: GenerationRequest, *, plan: DecodePlan | None = None,
                 deployment: Deployment | None = None, prefix_cache: PrefixCache | None = None,
                 cancelled: Callable[[], bool] = never,
                 prefill_from: "RequestState | None" = None, cache: list | None = None):
        self.loaded = loaded
        self.request = request
        self.cancelled = cancelled  # whether its client left (the runner drops it from a pass drafted meanwhile)
        self.plan = plan or PLAIN
        self.deployment = deployment
        self.prefix_cache = prefix_cache
        self.prompt = list(request.prompt_tokens)
        self.max_new_tokens = min(request.max_tokens, loaded.context_length - len(self.prompt))
        if self.max_new_tokens < 1:
            raise ValueError(f"prompt of {len(self.prompt)} tokens leaves no room in the context")
        self.generated = 0
        self.token_ids: list[int] = []  # chosen so far (the final Delta carries them: records, replay)
        self.finished = False
        self._ahead_context = None  # the context length whose next row was built ahead
        self.stats = SpeculationStats()
        self.report = RequestReport.planned(plan, deployment) if plan and deployment else None
        self.receipt = Receipt(request, self.prompt, self.plan, deployment) if self.report is not None else None
        self.determinism = self.plan.determinism
        self._canonical_chunk = canonical_chunk = deployment.prefill_chunk if deployment else PREFILL_CHUNK
        plain_chunk = deployment.plain_prefill_chunk if deployment else 0
        # A long plain prompt may go in smaller chunks (it then holds the engine less per
        # step); its KV then is not canonical, which the prefix cache keeps apart. A prompt
        # within one small chunk keeps the canonical grid (and where a cached prefix resumes).
        plain = self.determinism == Determinism.NONE
        small = plain and 0 < plain_chunk < len(self.prompt) - 1
        self._chunk = min(canonical_chunk, plain_chunk) if small else canonical_chunk
        # Where plain prompts' chunks run native forms (Deployment.plain_prompt_native), so does its KV.
        self.native_prompt = plain and bool(deployment and deployment.plain_prompt_native)
        # Rows (of a call) whose bits do not depend on the call's width, as its prompt runs them:
        # none in native forms (a chunk's last, narrower call may run another kernel).
        self._canonical_rows = deployment.guarantee.canonical_rows if deployment and not self.native_prompt else 0
        # The fewest rows of a chunk where a prompt may be cut anywhere (0: on the grid alone).
        self._split_rows = deployment.guarantee.prefill_split_rows if deployment and not self.native_prompt else 0
        # A plain prompt goes in whole chunks, without the grid's narrow ones below a chunk (they
        # cost a cold prompt steps and only pay back where bits must match a cold run), so its KV
        # is canonical only where whole chunks are the canonical ones.
        self._halving = not plain
        self._canonical_kv = (self._chunk == canonical_chunk and not self.native_prompt
                              and (not plain or whole_chunks_are_canonical(self._chunk, self._canonical_rows,
                                                                           self._split_rows)))
        # Set by the scheduler while the kernel audit is partial: the target's next chunk holds
        # at most this many tokens (a width audited); KV so written is never stored for reuse.
        self.chunk_limit: int | None = None

        model = loaded.model
        self._namespace = namespace(deployment)
        # A plain request may start from any cached KV (canonical or not: its bits are not
        # guaranteed); a deterministic one from canonical positions alone. On disk, plain
        # requests keep what they prefilled under a namespace of their own; the canonical one
        # gets only KV any prompt sharing it computes the same.
        self._disk_namespace = (f"{self._namespace}/plain" if plain and self._namespace is not None
                                else self._namespace)
        fresh = cache if cache is not None else make_prompt_cache(model)
        # A pool range given by the engine copies a hit's KV in: the entry's arrays will do.
        hit = (prefix_cache.find(self.prompt[:-1], self._namespace, layers=len(fresh),
                                 canonical_only=not plain, disk_namespace=self._disk_namespace,
                                 private=cache is None)
               if prefix_cache else None)
        found = hit.cache if hit else None
        if cache is not None:  # given by the engine: a range of its KV pool (kernels/batching/kv_pool.py)
            self.cache = cache
            if found:
                fill_prefix(self.cache, found, hit.length)
        else:
            self.cache = found or fresh
        # Choices of one request (n > 1) share the prompt: a follower copies its leader's
        # prompt KV once that is prefilled (exactly what its own prefill would compute).
        self._leader = prefill_from if (found is None and prefill_from is not None
                                        and PrefixCache.storable(self.cache)) else None
        self.closed = False  # set by the engine when it drops this request
        self._prefilled_alone = True  # every prompt chunk so far ran in a pass of its own
        # All but the last prompt token are prefilled; decoding starts by feeding the last one.
        # A plain request resumes where its hit ends; a deterministic one at the last grid point
        # before it that ends one of its chunks (unless rows are canonical, or the prompt may be
        # cut anywhere: kernels/invariance/prefill.py), so a hit gives its cold bits.
        # A hit of its own prompt's whole cold prefill leaves it nothing to prefill.
        done = hit.length if hit else 0
        self._prefill_pos = (done if plain or (hit and hit.whole)
                             else resume_at(done, self._chunk, self._canonical_rows, len(self.prompt) - 1,
                                            self._split_rows))
        if self._prefill_pos < done:
            trim_prompt_cache(self.cache, done - self._prefill_pos)
        self.cached_tokens = self._prefill_pos if found else 0
        # How far this request's KV is what a cold prefill in canonical chunks writes (None: as
        # far as a cold prefill's is, `exact_length`): the memory tier's mark, and the canonical
        # disk namespace's bound.
        start = self._prefill_pos
        from_cache = hit.canonical_length if hit else 0
        self._canonical_length = (None if self._canonical_kv and self._resumes_on_grid(start) and from_cache >= start
                                  else min(from_cache, start))

        self._texts = _TokenTexts(loaded.tokenizer)
        self._stream = StopTextStream(IncrementalDecoder(loaded.tokenizer, self.prompt), list(request.stop))
        self._wants_logprobs = request.sampling.top_logprobs is not None
        self.processors = processors_for(request, loaded)
        draft_model = deployment.draft_model if deployment else None
        speculation = Speculation(
            self.plan.method, self.plan.num_draft_tokens, adaptive=self.plan.adaptive,
            backoff=deployment.draft_backoff if deployment else True, prediction=request.prediction,
            draft_model=draft_model, target=model, pass_costs=deployment.pass_costs if deployment else None,
            draft_cost=deployment.draft_step_cost if deployment else None)
        inputs = DecodeInputs(self.cache, list(self.prompt), request.sampling, self.processors,
                              remaining=lambda: self.max_new_tokens - self.generated, cancelled=cancelled)
        self.source = make_source(inputs, self.stats, speculation)
        # A draft model's own cache is prefilled chunk by chunk after the target's.
        self._drafter = getattr(self.source, "drafter", None) if self.plan.method == "draft" else None
        # Its chunks are bounded by their measured cost too (a draft may prefill far slower than
        # the target): one never holds the engine for more than the time budget.
        bound = deployment.draft_prefill_tokens if deployment else 0
        self._draft_chunk = min(self._chunk, bound) if bound > 0 else self._chunk

    # ---------------------------------------------------------------------- prefill

    def _resumes_on_grid(self, pos: int) -> bool:
        """A prefill resuming at `pos` computes each later chunk as a cold prefill does: `pos`
        is a chunk boundary, or every row of a chunk gets its solo bits (prefill.py's rule: no rewind)."""
        return resume_at(pos, self._chunk, self._canonical_rows, len(self.prompt) - 1, self._split_rows) == pos

    @property
    def prefilling(self) -> bool:
        return self._target_prefilling or self._draft_pending() > 0

    @property
    def _target_prefilling(self) -> bool:
        return self._prefill_pos < len(self.prompt) - 1

    def _draft_pending(self) -> int:
        return self._drafter.pending(len(self.prompt) - 1) if self._drafter is not None else 0

    @property
    def long_plain_prompt(self) -> bool:
        """A plain request with more than one plain chunk of its target prompt still to go."""
        return (self.determinism == "none" and self._chunk < self._canonical_chunk
                and len(self.prompt) - 1 - self._prefill_pos > self._chunk)

    def steps_to_yield(self, plain_chunk: int) -> int:
        """Steps this request's next target chunk leaves to decoding requests first, where
        plain prompts go in `plain_chunk`-token chunks: a canonical chunk wider than that keeps
        its shape (its bits depend on it) and waits as many steps as the plain chunks it spans
        would, so decoding requests beside it get the share they get beside a plain prompt."""
        if plain_chunk <= 0 or self._chunk < self._canonical_chunk or not self._target_prefilling:
            return 0
        tokens = self.next_chunk_tokens()
        return tokens // plain_chunk if tokens > plain_chunk else 0

    def next_chunk_tokens(self) -> int:
        """Tokens the next prompt chunk holds (none while a leader prefills for this one)."""
        if self._target_prefilling:
            if self._leader is not None:
                return 0
            return self._chunk_stop() - self._prefill_pos
        return min(self._draft_pending(), self._draft_chunk)

    def _aligned_stop(self) -> int:
        return chunk_end(self._prefill_pos, len(self.prompt) - 1, self._chunk, halving=self._halving,
                         split_rows=self._split_rows)

    def _chunk_stop(self) -> int:
        """Where the next target chunk ends: its aligned end, or sooner under `chunk_limit`."""
        stop = self._aligned_stop()
        return stop if self.chunk_limit is None else min(stop, self._prefill_pos + self.chunk_limit)

    def _follow_leader(self) -> None:
        """Copy the leader's prompt KV once it is there; go alone if the leader was dropped."""
        leader = self._leader
        if leader._target_prefilling and not leader.closed:
            return
        self._leader = None
        if not leader._target_prefilling and not leader.closed:  # a closed leader's KV may be given back
            length = len(self.prompt) - 1
            if is_pooled(self.cache):
                fill_prefix(self.cache, leader.cache, length)
            else:
                self.cache[:] = copy_prefix(leader.cache, length)  # in place: the source holds this list
            self._prefill_pos = length

    @property
    def shares_prefill(self) -> bool:
        """Its next prompt chunk may share a pass with other requests' chunks: a target chunk
        with no leader, of a request with no determinism to keep, or of a deterministic one
        (rows shared with others) whose chunk is at least as wide as the deployment proved
        keeps its KV in shared passes (a chunk of at most L rows runs canonical forms alone,
        natively in a shared pass)."""
        if not self._target_prefilling or self._leader is not None:
            return False
        if self.determinism == Determinism.NONE:
            return True
        rows = self.deployment.guarantee.shared_prefill_rows if self.deployment is not None else 0
        return self.determinism == Determinism.SHARED and rows > 0 and self.next_chunk_tokens() >= rows

    def next_chunk(self) -> list[int]:
        """The next target prompt chunk's tokens."""
        return self.prompt[self._prefill_pos:self._chunk_stop()]

    def next_prefill(self) -> PrefillStep:
        """What the next prompt chunk is (the model runner runs it, then `chunk_written`)."""
        if self._target_prefilling:
            if self._leader is not None:
                self._follow_leader()  # a copy, no model work
                return PrefillStep("target", self.cache, [], follow=True)
            return PrefillStep("target", self.cache, self.next_chunk())
        start = self._drafter.prefilled
        return PrefillStep("draft", self._drafter.cache, self.prompt[start:start + self._draft_chunk])

    def chunk_written(self, tokens: int, *, alone: bool, model: str = "target") -> None:
        """The next `tokens` prompt tokens are in the cache. Only KV prefilled alone, or in a
        shared pass proven to keep it (`alone` then too), goes to the prefix cache: other
        shared passes' bits depend on their neighbours, and a deterministic request may later
        start from the entry."""
        if model == "draft":
            self._drafter.advance(self.prompt[self._drafter.prefilled:self._drafter.prefilled + tokens])
            return
        if tokens < self._aligned_stop() - self._prefill_pos:
            alone = False  # a cut chunk: not the KV an aligned prefill writes
        self._prefill_pos += tokens
        if not self._target_prefilling and self.prefix_cache and alone and self._prefilled_alone:
            prefilled = len(self.prompt) - 1
            # A cold prefill's KV is what every longer prompt computes up to its last chunk's start
            canonical = (exact_length(prefilled, self._chunk, self._canonical_rows, self._split_rows)
                         if self._canonical_length is None
                         else min(prefilled, self._canonical_length))
            on_disk = prefilled if self._disk_namespace != self._namespace else canonical
            self.prefix_cache.store(self.prompt[:-1], self.cache, self._namespace,
                                    canonical_length=canonical, disk_namespace=self._disk_namespace,
                                    exact_length=on_disk, whole=self._canonical_length is None)
        self._prefilled_alone = self._prefilled_alone and alone

    # ----------------------------------------------------------------------- decode

    @property
    def last_token(self) -> int:
        """The token its next decode pass starts from (the prompt's last, then the last chosen)."""
        return self.source.context[-1]

    def draft_length(self, room: int | None = None) -> int:
        """Drafts its next decode pass may verify (its policy's k), within `room` rows (this
        request's own included) when the scheduler says the pass is nearly full; none where
        its row of that pass was built ahead (`row_built_ahead`: one row, no drafts)."""
        if self._ahead_context == len(self.source.context):
            return 0
        return self.source.draft_length(room)

    def row_built_ahead(self) -> None:
        """The model runner built its next row ahead, on the token of the pass now running:
        the pass after this one verifies no drafts, so it can take that row over."""
        self._ahead_context = len(self.source.context) + 1

    def presample(self, logits: mx.array, ahead: int = 0):
        """Sampling for the pass's rows built lazily, for the engine to compute together with
        other requests' (a server.engine.decoding.sampling.PendingSample), or None. `ahead`: for the
        row after the next one (`decodes_ahead`)."""
        presample = getattr(self.source, "presample", None)
        return presample(logits, ahead) if presample is not None else None

    @property
    def presamples(self) -> bool:
        """Whether `presample` builds anything (its rows need slicing from the pass)."""
        return getattr(self.source, "presamples", False)

    def row_sampling(self, ahead: int = 0):
        """What its one-row `presample` builds, for a pass to build with others' (a
        sampling.RowSampling; None: it samples alone). A deterministic row joins only batches of
        the widths the deployment proved keep its bits (`sampling.block_widths` of
        `Guarantee.sampling_rows`), and none before that proof has run."""
        row_sampling = getattr(self.source, "row_sampling", None)
        row = row_sampling(ahead) if row_sampling is not None else None
        if row is None or self.determinism == Determinism.NONE:
            return row
        proven = self.deployment.guarantee.sampling_rows if self.deployment is not None else 0
        return replace(row, batch_rows=proven) if proven >= 2 else None

    def prove_sampling(self, rows: int) -> None:
        """The batched-sampling proof gave `rows` after this request was admitted: where its rows
        may share passes, they join sampling batches of its widths from now on."""
        if self.deployment is not None and self.deployment.guarantee.shared_passes:
            self.deployment = replace(self.deployment, guarantee=replace(self.deployment.guarantee, sampling_rows=rows))

    def decodes_ahead(self) -> bool:
        """Whether this request's next row may run before the token of the pass now running
        reaches the host (server/engine/runner/decode_ahead.py): one token a pass, chosen on the
        device (a plain source; a drafting one while its drafter rests)."""
        decodes_ahead = getattr(self.source, "decodes_ahead", None)
        return decodes_ahead is not None and decodes_ahead() and not self.finished

    @property
    def at_last_token(self) -> bool:
        """The pass now running chooses this request's last token (max_tokens): no row follows."""
        return self.generated + 1 >= self.max_new_tokens

    def next_input(self, argmax: mx.array, pending) -> mx.array:
        """The token this pass chooses, as a (1,) array: the next row's input (`decodes_ahead`)."""
        return self.source.chosen(argmax, pending)

    def advance(self, sampled: SampledTokens) -> list[Delta]:
        """The tokens its pass chose -> Deltas to send (the last one may finish)."""
        deltas: list[Delta] = []
        pending = None  # releases of this pass not yet sent, merged into one Delta
        self.source.record(sampled.tokens, sampled.drafts)
        for chosen in sampled.chosen:
            self.generated += 1
            self.token_ids.append(chosen.token)
            if self.receipt is not None:
                self.receipt.add(chosen.token, chosen.logprob)
            if chosen.token in self.loaded.eos_token_ids:
                if pending is not None:
                    deltas.append(self._delta(pending))
                return self._finish(deltas, self._stream.finish(), "stop")
            item = None
            if self._wants_logprobs:
                top = [(self._texts(t), lp) for t, lp in chosen.top_logprobs]
                item = TokenLogprob(self._texts(chosen.token), chosen.logprob, top)
            release = self._stream.add(chosen.token, item)
            if release.stopped:
                if pending is not None:
                    deltas.append(self._delta(pending))
                return self._finish(deltas, release, "stop")
            pending = release if pending is None else pending.merged(release)
            if self.processors is not None and self.processors.finished:  # the grammar is complete
                deltas.append(self._delta(pending))
                return self._finish(deltas, self._stream.finish(), "stop")
            if self.generated >= self.max_new_tokens:
                if pending.text or pending.items:
                    deltas.append(self._delta(pending))
                final = self._stream.finish()
                return self._finish(deltas, final, "stop" if final.stopped else "length")
        if pending is not None and (pending.text or pending.items):
            deltas.append(self._delta(pending))
        return deltas

    def _finish(self, deltas: list[Delta], release, reason: str) -> list[Delta]:
        self.finished = True
        deltas.append(self._delta(release, reason))
        return deltas

    def _delta(self, release, finish_reason=None) -> Delta:
        report = None
        if finish_reason is not None and self.report is not None:
            report = self.report.finished(drafted=self.stats.drafted, accepted=self.stats.accepted,
                                          passes=self.stats.passes, receipt=self.receipt.as_dict())
        return Delta(
            text=release.text,
            prompt_tokens=len(self.prompt),
            completion_tokens=self.generated,
            logprobs=release.items if self._wants_logprobs else [],
            text_offsets=release.offsets if self._wants_logprobs else [],
            finish_reason=finish_reason,
            report=report,
            stop_sequence=self._stream.matched if finish_reason is not None else None,
            token_ids=tuple(self.token_ids) if finish_reason is not None else None,
            cached_tokens=self.cached_tokens,
        )
