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
from mlx_lm.models.cache import make_prompt_cache

from server.sampling import SamplingParams, sample
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
    # lockstep extensions, not yet acted on here (see server/protocol.py).
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


def forward(model, cache: list, tokens: list[int]) -> mx.array:
    """Logits for every position of `tokens`, appending them to `cache`."""
    return model(mx.array(tokens)[None], cache=cache)[0]


def prefill(
    model, cache: list, tokens: list[int], step: Forward = forward, chunk: int = PREFILL_CHUNK
) -> Iterator[None]:
    """Fill `cache` with `tokens` in chunks, yielding after each so others can run."""
    for start in range(0, len(tokens), chunk):
        step(model, cache, tokens[start : start + chunk])
        mx.eval([c.state for c in cache])
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


def generate(loaded, request: GenerationRequest, step: Forward = forward) -> Iterator[Delta | None]:
    """Run `request` on `loaded` (a models.load.LoadedModel), one unit of work per step."""
    prompt = list(request.prompt_tokens)
    limit = min(request.max_tokens, loaded.context_length - len(prompt))
    if limit < 1:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in the context")

    model = loaded.model
    cache = make_prompt_cache(model)
    # All but the last prompt token; decoding starts by feeding the last one.
    yield from prefill(model, cache, prompt[:-1], step)

    texts = _TokenTexts(loaded.tokenizer)
    stream = StopTextStream(IncrementalDecoder(loaded.tokenizer, prompt), list(request.stop))
    wants_logprobs = request.sampling.top_logprobs is not None
    last, generated = prompt[-1], 0

    def delta(release, finish_reason=None) -> Delta:
        return Delta(
            text=release.text,
            prompt_tokens=len(prompt),
            completion_tokens=generated,
            logprobs=release.items if wants_logprobs else [],
            text_offsets=release.offsets if wants_logprobs else [],
            finish_reason=finish_reason,
        )

    while True:
        logits = step(model, cache, [last])[-1:]
        position = len(prompt) + generated  # absolute index of the token being chosen
        chosen = sample(logits, [position], request.sampling)[0]
        generated += 1
        last = chosen.token

        if chosen.token in loaded.eos_token_ids:
            yield delta(stream.finish(), "stop")
            return
        item = None
        if wants_logprobs:
            top = [(texts(t), lp) for t, lp in chosen.top_logprobs]
            item = TokenLogprob(texts(chosen.token), chosen.logprob, top)
        release = stream.add(chosen.token, item)
        if release.stopped:
            yield delta(release, "stop")
            return
        has_output = bool(release.text or release.items)
        if generated < limit:
            yield delta(release) if has_output else None
            continue
        if has_output:
            yield delta(release)
        final = stream.finish()
        yield delta(final, "stop" if final.stopped else "length")
        return
