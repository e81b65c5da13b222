"""One request run solo: prefill its prompt, then decode pass by pass (no engine needed).

`generate()` is a generator stepping a `RequestState` (server/engine/request_state.py) one unit of
work at a time, each decode pass holding only this request's rows; it yields `None` after
work that produced nothing to send and a `Delta` otherwise (the last has a finish reason).
The engine batches the same states across requests; verify, bench and tests use this.
`prefill()` is the aligned chunked prefill on its own.
"""
from __future__ import annotations

from typing import Callable, Iterator

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from lockstep.kernels.invariance.prefill import chunk_end, resume_at

from lockstep.server.engine.decoding import DecodePlan, Deployment
from lockstep.server.engine.prefix_cache import PrefixCache
from lockstep.server.engine.request_state import (PREFILL_CHUNK, Delta, GenerationRequest, RequestState,  # noqa: F401
                                  TokenLogprob, forward)
from lockstep.server.engine.speculative import never
from lockstep.server.engine.token_steps import fast_argmax

# forward(model, cache, tokens) -> logits of shape (len(tokens), vocab)
Forward = Callable[[object, list, list[int]], mx.array]


def prefill(
    model, cache: list, tokens: list[int], step: Forward = forward, chunk: int = PREFILL_CHUNK
) -> Iterator[None]:
    """Feed `tokens` past what `cache` holds, in chunks aligned to absolute positions.

    Chunk boundaries sit at multiples of `chunk` from position 0, so a prefix reused from
    the prefix cache ends with the same KV as a cold prefill (kernels/invariance/prefill.py); a cached
    prefix ending mid-chunk is rewound to the chunk start unless rows are canonical.
    Yields after each chunk.
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


def generate(loaded, request: GenerationRequest, step: Forward = forward, *,
             plan: DecodePlan | None = None, deployment: Deployment | None = None,
             prefix_cache: PrefixCache | None = None,
             cancelled: Callable[[], bool] = never) -> Iterator[Delta | None]:
    """Run `request` on `loaded` (a models.load.LoadedModel), one unit of work per step.

    `cancelled()` is checked inside steps that could run long (a draft model's k passes).
    """
    state = RequestState(loaded, request, plan=plan, deployment=deployment, prefix_cache=prefix_cache,
                         cancelled=cancelled, step=step)
    while state.prefilling:
        state.prefill_chunk()
        yield None
    while True:
        rows = state.rows()
        if cancelled():
            return
        logits = step(loaded.model, state.cache, rows)
        argmax = mx.argmax(logits, axis=-1).tolist() if fast_argmax(request.sampling) else None
        deltas = state.take(logits, argmax)
        if not deltas:
            yield None
        yield from deltas
        if state.finished:
            return
