"""One request run alone: the model runner with one request, stepped here instead of by the
engine's thread (verify, bench and tests).

`generate()` is a generator stepping a `RequestState` (server/engine/decoding/request_state.py) one
unit of work at a time through a `ModelRunner` (server/engine/runner/model_runner.py), exactly the
calls the engine's runner makes for that request; it yields `None` after work that produced
nothing to send and a `Delta` otherwise (the last has a finish reason).
"""
from __future__ import annotations

from typing import Callable, Iterator

from lockstep.server.engine.guarantee.decode_plan import DecodePlan

from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.runner.model_runner import ModelRunner
from lockstep.server.engine.cache.prefix_cache import PrefixCache
from lockstep.server.engine.decoding.request_state import Delta, GenerationRequest, RequestState
from lockstep.server.engine.decoding.drafters import never
from lockstep.server.engine.runner.step_data import DecodeRows, ScheduledPass


class _Alone:
    """The one member of a solo pass (the runner reads `.state`)."""

    def __init__(self, state: RequestState):
        self.state = state


def generate(loaded, request: GenerationRequest, *, plan: DecodePlan | None = None,
             deployment: Deployment | None = None, prefix_cache: PrefixCache | None = None,
             cancelled: Callable[[], bool] = never, runner: ModelRunner | None = None) -> Iterator[Delta | None]:
    """Run `request` on `loaded` (a models.load.LoadedModel), one unit of work per step.

    `runner`: the runner to use (default: one for a request at a time, plain model calls, on
    `deployment`). `cancelled()` is checked inside steps that could run long (a draft
    model's k passes).
    """
    runner = runner or ModelRunner(loaded.model, deployment, batched=False)
    state = RequestState(loaded, request, plan=plan, deployment=deployment, prefix_cache=prefix_cache,
                         cancelled=cancelled, cache=runner.new_cache(len(request.prompt_tokens) + request.max_tokens)
                         if runner.kv_pool is not None else None)
    try:
        while state.prefilling:
            done = runner.prefill(state)
            if not done.follow:
                state.chunk_written(done.tokens, alone=True, model=done.model)
            yield None
        alone = _Alone(state)
        while True:
            scheduled = ScheduledPass([DecodeRows(alone, state.last_token, state.draft_length())])
            sampled, = runner.run_pass(scheduled).members
            if sampled is None:  # cancelled while drafting
                return
            if isinstance(sampled, Exception):
                raise sampled
            deltas = state.advance(sampled)
            if not deltas:
                yield None
            yield from deltas
            if state.finished:
                return
    finally:
        runner.release(state.cache)
