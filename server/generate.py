"""One request's token loop: prefill the prompt, then decode token by token.

`generate()` is a generator the engine steps one unit of work at a time (one prefill chunk
or one decoded token), so several requests can be interleaved on one thread. It yields
`None` after work that produced nothing to send, and a `Delta` otherwise; the last
`Delta` has a `finish_reason`.

The two model steps are separate functions, `prefill()` and `forward()`, so other
execution strategies (speculative decoding, batch-invariant kernels) can replace them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from kernels.prefill import chunk_end, resume_at

from server.decoding import DecodePlan, Deployment
from server.prefix_cache import PrefixCache
from server.sampling import SamplingParams
from server.token_steps import SpeculationStats, token_source
from server.stops import IncrementalDecoder, StopTextStream

PREFILL_CHUNK = 512

# forward(model, cache, tokens) -> logits of shape (len(tokens), vocab)
Forward = Callable[[object, list, list[int]], mx.array]


@dataclass(frozen=True)
class GenerationRequest:
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    # lockstep extensions (see server/decoding.py for how they are acted on).
    deterministic: bool = False
    speculative: str | None = None
    num_draft_tokens: int | None = None


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


def prefill(
    model, cache: list, tokens: list[int], step: Forward = forward, chunk: int = PREFILL_CHUNK
) -> Iterator[None]:
    """Feed `tokens` past what `cache` holds, in chunks aligned to absolute positions.

    Chunk boundaries sit at multiples of `chunk` from position 0, so a prefix reused from
    the prefix cache ends with the same KV as a cold prefill (kernels/prefill.py); a cached
    prefix ending mid-chunk is rewound to the chunk start unless rows are canonical.
    Yields after each chunk so other requests can run.
    """
    done = cache[0].offset if cache else 0
    start = resume_at(model, done, chunk)
    if start < done:
        trim_prompt_cache(cache, done - start)
    pos = start
    while pos < len(tokens):
        end = chunk_end(pos, len(tokens), chunk)
        step(model, cache, tokens[pos:end])
        mx.eval([c.state for c in cache])
        pos = end
        yield None


class _TokenTexts:
    """Token id -> text, memoised (logprobs ask for the same alternatives repeatedly)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self._tokenizer.decode([token])
        return self._texts[token]


def _never() -> bool:
    return False


def generate(loaded, request: GenerationRequest, step: Forward = forward, *,
             plan: DecodePlan | None = None, deployment: Deployment | None = None,
             prefix_cache: PrefixCache | None = None,
             cancelled: Callable[[], bool] = _never) -> Iterator[Delta | None]:
    """Run `request` on `loaded` (a models.load.LoadedModel), one unit of work per step.

    `cancelled()` is checked inside steps that could run long (a draft model's k passes).
    """
    prompt = list(request.prompt_tokens)
    limit = min(request.max_tokens, loaded.context_length - len(prompt))
    if limit < 1:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in the context")

    model = loaded.model
    chunk = deployment.prefill_chunk if deployment else PREFILL_CHUNK
    cache, _ = prefix_cache.lookup(prompt[:-1]) if prefix_cache else (None, 0)
    cache = cache or make_prompt_cache(model)
    # All but the last prompt token; decoding starts by feeding the last one (M = 1).
    yield from prefill(model, cache, prompt[:-1], step, chunk)
    if prefix_cache:
        prefix_cache.store(prompt[:-1], cache)

    texts = _TokenTexts(loaded.tokenizer)
    stream = StopTextStream(IncrementalDecoder(loaded.tokenizer, prompt), list(request.stop))
    wants_logprobs = request.sampling.top_logprobs is not None
    stats = SpeculationStats()
    extension = plan.extension(deployment) if plan and deployment else None
    generated = 0

    def delta(release, finish_reason=None) -> Delta:
        ext = None
        if finish_reason is not None and extension is not None:
            ext = {**extension, "drafted_tokens": stats.drafted, "accepted_tokens": stats.accepted,
                   "forward_passes": stats.passes}
        return Delta(
            text=release.text,
            prompt_tokens=len(prompt),
            completion_tokens=generated,
            logprobs=release.items if wants_logprobs else [],
            text_offsets=release.offsets if wants_logprobs else [],
            finish_reason=finish_reason,
            extension=ext,
        )

    method, k = (plan.method, plan.num_draft_tokens) if plan else ("none", 0)
    draft_model = deployment.draft_model if deployment else None
    source = token_source(step, model, cache, list(prompt), request.sampling, stats, method, k,
                          draft_model, remaining=lambda: limit - generated, cancelled=cancelled)
    for batch in source:
        pending = None  # releases of this batch not yet sent, merged into one Delta
        for chosen in (s.sampled for s in batch):
            generated += 1
            if chosen.token in loaded.eos_token_ids:
                if pending is not None:
                    yield delta(pending)
                yield delta(stream.finish(), "stop")
                return
            item = None
            if wants_logprobs:
                top = [(texts(t), lp) for t, lp in chosen.top_logprobs]
                item = TokenLogprob(texts(chosen.token), chosen.logprob, top)
            release = stream.add(chosen.token, item)
            if release.stopped:
                if pending is not None:
                    yield delta(pending)
                yield delta(release, "stop")
                return
            pending = release if pending is None else pending.merged(release)
            if generated >= limit:
                if pending.text or pending.items:
                    yield delta(pending)
                final = stream.finish()
                yield delta(final, "stop" if final.stopped else "length")
                return
        yield delta(pending) if pending.text or pending.items else None
