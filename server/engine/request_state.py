"""One request's progress: prefill its prompt in chunks, then decode rows the engine batches.

The engine asks a `RequestState` for one unit of work at a time:
- while `prefilling`, `prefill_chunk()` runs the next prompt chunk on the request's own cache
  (a pass of its own: chunks are aligned to absolute positions, kernels/invariance/prefill.py);
- then `rows()` names the tokens this request puts into the next forward pass (the last
  token, plus drafts when speculating), and `take(logits)` turns that pass's rows into
  `Delta`s: text (stop strings held back), logprobs, and a finish reason on the last one.

The prompt's last token is the first decode row, so every logits row a token is chosen from
comes from a decode pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from lockstep.kernels.batching.kv_pool import fill_prefix, is_pooled
from lockstep.kernels.invariance.layers import call_without_head
from lockstep.kernels.invariance.prefill import chunk_end, resume_at

from lockstep.server.engine.decoding import DecodePlan, Deployment
from lockstep.server.engine.logits_processors import processors_for
from lockstep.server.engine.prefix_cache import PrefixCache, copy_prefix
from lockstep.server.engine.sampling import SamplingParams
from lockstep.server.engine.stops import IncrementalDecoder, StopTextStream
from lockstep.server.engine.speculative import never
from lockstep.server.engine.token_steps import SpeculationStats, make_source

PREFILL_CHUNK = 512


@dataclass(frozen=True)
class GenerationRequest:
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    # lockstep extensions (see server/engine/decoding.py for how they are acted on).
    deterministic: bool = False
    speculative: str | None = None
    num_draft_tokens: int | None = None
    # Per-row logits processing (server/engine/logits_processors.py).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: object | None = None  # a compiled server.engine.grammar.Grammar


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
    extension: dict | None = None  # the `lockstep` response object, on the final Delta


def forward(model, cache: list, tokens: list[int]) -> mx.array:
    """Logits for every position of `tokens`, appending them to `cache`."""
    return model(mx.array(tokens)[None], cache=cache)[0]


def prompt_forward(model, cache: list, tokens: list[int]) -> None:
    """Append `tokens`' KV to `cache` without the output head: a prompt chunk's logits are
    never used, and the head (a vocab-wide matmul per row) is much of a chunk's cost."""
    call_without_head(model, mx.array(tokens)[None], cache)


class _TokenTexts:
    """Token id -> text, memoised (logprobs ask for the same alternatives repeatedly)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self._tokenizer.decode([token])
        return self._texts[token]


class RequestState:
    def __init__(self, loaded, request: GenerationRequest, *, plan: DecodePlan | None = None,
                 deployment: Deployment | None = None, prefix_cache: PrefixCache | None = None,
                 cancelled: Callable[[], bool] = never, step=forward,
                 prefill_from: "RequestState | None" = None, cache: list | None = None):
        self.loaded = loaded
        self.request = request
        self.plan = plan
        self.deployment = deployment
        self.prefix_cache = prefix_cache
        self.step = prompt_forward if step is forward else step  # runs prefill chunks
        self.prompt = list(request.prompt_tokens)
        self.limit = min(request.max_tokens, loaded.context_length - len(self.prompt))
        if self.limit < 1:
            raise ValueError(f"prompt of {len(self.prompt)} tokens leaves no room in the context")
        self.generated = 0
        self.finished = False
        self.stats = SpeculationStats()
        self.extension = plan.extension(deployment) if plan and deployment else None
        self._chunk = deployment.prefill_chunk if deployment else PREFILL_CHUNK

        model = loaded.model
        found, found_len = prefix_cache.lookup(self.prompt[:-1]) if prefix_cache else (None, 0)
        if cache is not None:  # given by the engine: a range of its KV pool (kernels/batching/kv_pool.py)
            self.cache = cache
            if found:
                fill_prefix(self.cache, found, found_len)
        else:
            self.cache = found or make_prompt_cache(model)
        # Choices of one request (n > 1) share the prompt: a follower copies its leader's
        # prompt KV once that is prefilled (exactly what its own prefill would compute).
        self._leader = prefill_from if (found is None and prefill_from is not None
                                        and PrefixCache.storable(self.cache)) else None
        self.closed = False  # set by the engine when it drops this request
        self._prefilled_alone = True  # every prompt chunk so far ran in a pass of its own
        # All but the last prompt token are prefilled; decoding starts by feeding the last one.
        done = self.cache[0].offset if self.cache else 0
        self._prefill_pos = resume_at(model, done, self._chunk)
        if self._prefill_pos < done:
            trim_prompt_cache(self.cache, done - self._prefill_pos)

        self._texts = _TokenTexts(loaded.tokenizer)
        self._stream = StopTextStream(IncrementalDecoder(loaded.tokenizer, self.prompt), list(request.stop))
        self._wants_logprobs = request.sampling.top_logprobs is not None
        self.processors = processors_for(request, loaded)
        method, k = (plan.method, plan.num_draft_tokens) if plan else ("none", 0)
        draft_model = deployment.draft_model if deployment else None
        self.source = make_source(self.cache, list(self.prompt), request.sampling, self.stats, method, k,
                                  draft_model, remaining=lambda: self.limit - self.generated,
                                  cancelled=cancelled, adaptive=bool(plan and plan.adaptive),
                                  pass_costs=deployment.pass_costs if deployment else None,
                                  target=model, processors=self.processors)

    # ---------------------------------------------------------------------- prefill

    @property
    def prefilling(self) -> bool:
        return self._prefill_pos < len(self.prompt) - 1

    def next_chunk_tokens(self) -> int:
        """Tokens the next prompt chunk holds (none while a leader prefills for this one)."""
        if self._leader is not None:
            return 0
        return chunk_end(self._prefill_pos, len(self.prompt) - 1, self._chunk) - self._prefill_pos

    def _follow_leader(self) -> None:
        """Copy the leader's prompt KV once it is there; go alone if the leader was dropped."""
        leader = self._leader
        if leader.prefilling and not leader.closed:
            return
        self._leader = None
        if not leader.prefilling and not leader.closed:  # a closed leader's KV may be given back
            length = len(self.prompt) - 1
            if is_pooled(self.cache):
                fill_prefix(self.cache, leader.cache, length)
            else:
                self.cache[:] = copy_prefix(leader.cache, length)  # in place: the source holds this list
            self._prefill_pos = length

    @property
    def shares_prefill(self) -> bool:
        """Its prompt chunks may share a pass with other requests' chunks: only a request with
        no determinism to keep (such a pass's bits depend on its neighbours) and no leader."""
        return self._leader is None and not (self.wants_determinism or self.exclusive)

    def next_chunk(self) -> list[int]:
        """The next prompt chunk's tokens."""
        return self.prompt[self._prefill_pos:chunk_end(self._prefill_pos, len(self.prompt) - 1, self._chunk)]

    def prefill_chunk(self) -> None:
        """Run the next prompt chunk on this request's cache (its own forward pass)."""
        if self._leader is not None:
            self._follow_leader()
            return
        chunk = self.next_chunk()
        self.step(self.loaded.model, self.cache, chunk)
        mx.eval([c.state for c in self.cache])
        self.chunk_written(len(chunk), alone=True)

    def chunk_written(self, tokens: int, *, alone: bool) -> None:
        """The next `tokens` prompt tokens are in the cache. Only KV prefilled in passes of
        its own goes to the prefix cache: a shared pass's bits depend on its neighbours, and
        a deterministic request may later start from the entry."""
        self._prefill_pos += tokens
        if not self.prefilling and self.prefix_cache and alone and self._prefilled_alone:
            self.prefix_cache.store(self.prompt[:-1], self.cache)
        self._prefilled_alone = self._prefilled_alone and alone

    # ----------------------------------------------------------------------- decode

    @property
    def deterministic(self) -> bool:
        """Its rows must share passes only within the proven batch-invariant limit."""
        return bool(self.plan and self.plan.deterministic and self.deployment and self.deployment.guaranteed)

    @property
    def wants_determinism(self) -> bool:
        """It asked for determinism (whether or not this deployment guarantees it): its
        passes run the installed canonical forms."""
        return bool(self.plan and self.plan.deterministic)

    @property
    def exclusive(self) -> bool:
        return bool(self.plan and self.plan.exclusive)

    def rows(self, room: int | None = None) -> list[int]:
        """Tokens for this request's rows in the next decode pass (may run a drafter); at most
        `room` of them when the engine says the pass is nearly full."""
        return self.source.rows(room)

    def presample(self, logits: mx.array):
        """Sampling for the pass's rows built lazily, for the engine to compute together with
        other requests' (a server.engine.sampling.PendingSample), or None."""
        presample = getattr(self.source, "presample", None)
        return presample(logits) if presample is not None else None

    def take(self, logits: mx.array, argmax: list[int] | None = None, sampled=None) -> list[Delta]:
        """The pass's logits rows for rows() -> Deltas to send (the last one may finish);
        `sampled`: what `presample(logits)` returned."""
        deltas: list[Delta] = []
        pending = None  # releases of this pass not yet sent, merged into one Delta
        steps = self.source.take(logits, argmax) if sampled is None else self.source.take(logits, argmax, sampled)
        for chosen in (s.sampled for s in steps):
            self.generated += 1
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
            if self.generated >= self.limit:
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
        ext = None
        if finish_reason is not None and self.extension is not None:
            ext = {**self.extension, "drafted_tokens": self.stats.drafted,
                   "accepted_tokens": self.stats.accepted, "forward_passes": self.stats.passes}
        return Delta(
            text=release.text,
            prompt_tokens=len(self.prompt),
            completion_tokens=self.generated,
            logprobs=release.items if self._wants_logprobs else [],
            text_offsets=release.offsets if self._wants_logprobs else [],
            finish_reason=finish_reason,
            extension=ext,
        )
