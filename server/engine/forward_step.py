"""The model work of one engine pass, apart from scheduling: which forms run, the model call
over several requests' rows, and the device round trips that turn logits into what each
request's token source reads. The engine (scheduler.py) decides who shares a pass and
handles failures; everything here runs on its worker thread.
"""
from __future__ import annotations

from contextlib import nullcontext

import mlx.core as mx

from lockstep.kernels.batching.ragged import ragged_logits, ragged_prompt_forward
from lockstep.kernels.invariance.layers import native_forms
from lockstep.server.engine.request_state import RequestState, forward


def decode_logits(model, members: list[tuple[RequestState, list[int]]], ragged: bool) -> tuple[mx.array, list[int]]:
    """One decode pass over `members`' rows (their caches advance): logits (rows, vocab) and
    every row's argmax, computed in one device round trip. Canonical forms run only where a
    request asked for determinism; a pass of other rows runs natively whatever its width
    (decode passes write no prefix-cache KV). `ragged` False: one request, its plain call."""
    forms = nullcontext() if any(state.wants_determinism for state, _ in members) else native_forms()
    with forms:
        if ragged:
            logits = ragged_logits(model, [(state.cache, rows) for state, rows in members])
        else:
            (state, rows), = members
            logits = forward(model, state.cache, rows)
    # One argmax for all rows: greedy requests need nothing else.
    argmax = mx.argmax(logits, axis=-1)
    mx.eval(logits, argmax)
    return logits, argmax.tolist()


def presample_together(states: list[RequestState], rows_of: list[mx.array]) -> list:
    """Every sampled (non-greedy) request's sampling for its logits rows, in one device round
    trip: what each `take` then reads (None for requests with nothing to build)."""
    sampled = [state.presample(rows) for state, rows in zip(states, rows_of)]
    mx.eval([x for s in sampled if s is not None for x in s.arrays])
    return sampled


def shared_prefill(model, states: list[RequestState]) -> list[int]:
    """Each request's next prompt chunk, all in one ragged pass; returns the chunks' lengths
    (the caller records them with `chunk_written(..., alone=False)`)."""
    chunks = [state.next_chunk() for state in states]
    ragged_prompt_forward(model, [(state.cache, chunk) for state, chunk in zip(states, chunks)])
    mx.eval([layer.state for state in states for layer in state.cache])
    return [len(chunk) for chunk in chunks]
