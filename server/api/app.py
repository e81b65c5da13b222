"""FastAPI routes: /v1/chat/completions, /v1/completions, /v1/models, /health.

A route turns its request into a `GenerationRequest` (prompt tokens, limits, sampling),
submits it to the engine and turns the engine's `Delta`s into OpenAI JSON, either one
response or server-sent events (`data: {...}` ... `data: [DONE]`).

The `model` field must name the served model (its `name`) or the alias "default".
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from importlib import metadata
from typing import AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.api import protocol as p
from server.api.access_log import AccessLog
from server.api.auth import APIKeyAuth
from server.api.disconnect import unless_disconnected
from server.api.drain import Drain, DrainMiddleware
from server.engine import Engine, GenerationError, QueueFull, ShuttingDown, TooLargeForMemory
from server.api.limits import BodySizeLimit, Limits, max_tokens_too_large, prompt_too_long, queue_full
from server.api.metrics import Metrics
from server.api.request_record import RecordRequests, current, track
from server.api.errors import APIError, context_length_exceeded, install_error_handlers, model_not_found
from server.engine.decoding import DecodePlan, RequestRejected, plan_request
from server.engine.generate import Delta, GenerationRequest
from server.engine.sampling import GREEDY_BELOW, SamplingParams

MODEL_ALIAS = "default"
SHUTTING_DOWN = "the server is shutting down; this request was cut off"

log = logging.getLogger("lockstep.app")


def _cut_error(exc: GenerationError) -> APIError:
    """The error a request that failed on the engine gets (503 when the server cut it off)."""
    if isinstance(exc, ShuttingDown):
        record = current()
        log.warning("request %s cut off: %s", record.request_id if record else "?", exc)
        return APIError(503, str(exc), type="server_error", code="server_shutting_down")
    return APIError(500, str(exc), type="server_error")


def _fingerprint(loaded) -> str:
    recipe = f"{loaded.name}|{loaded.weights}|mlx {metadata.version('mlx')}"
    return "fp_" + hashlib.sha256(recipe.encode()).hexdigest()[:10]


def _sse(payload: p.Response) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def _usage(last: Delta) -> p.Usage:
    return p.Usage(
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        total_tokens=last.prompt_tokens + last.completion_tokens,
    )


def _chat_logprobs(delta: Delta) -> p.ChatLogprobs:
    def top(token: str, logprob: float) -> p.TopLogprob:
        return p.TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    return p.ChatLogprobs(
        content=[
            p.ChatTokenLogprob(
                token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()),
                top_logprobs=[top(t, v) for t, v in lp.top],
            )
            for lp in delta.logprobs
        ]
    )


def _completion_logprobs(delta: Delta) -> p.CompletionLogprobs:
    return p.CompletionLogprobs(
        tokens=[lp.token for lp in delta.logprobs],
        token_logprobs=[lp.logprob for lp in delta.logprobs],
        top_logprobs=[dict(lp.top) for lp in delta.logprobs],
        text_offset=list(delta.text_offsets),
    )


def _merge(deltas: list[Delta]) -> Delta:
    last = deltas[-1]
    return Delta(
        text="".join(d.text for d in deltas),
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        logprobs=[lp for d in deltas for lp in d.logprobs],
        text_offsets=[o for d in deltas for o in d.text_offsets],
        finish_reason=last.finish_reason,
        extension=last.extension,
    )


class Routes:
    """Request handling for one served model."""

    def __init__(self, engine: Engine, fingerprint: str, limits: Limits = Limits(), log_prompts: bool = False):
        self.engine = engine
        self.loaded = engine.loaded
        self.fingerprint = fingerprint
        self.limits = limits
        self.log_prompts = log_prompts
        self.created = int(time.time())

    # ------------------------------------------------------------ request -> generation

    def _check_model(self, model: str) -> None:
        if model not in (self.loaded.name, MODEL_ALIAS):
            raise model_not_found(model)

    def _chat_tokens(self, body: p.ChatCompletionRequest) -> list[int]:
        # Chat templates know system/user/assistant; "developer" is OpenAI's new "system".
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in body.messages
        ]
        return list(self.loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def _completion_tokens(self, body: p.CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self.loaded.tokenizer.encode(prompt))
        vocab = len(self.loaded.tokenizer)
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)

    async def _submit(self, body: p.SamplingRequest, tokenize: Callable, param: str):
        self._check_model(body.model)
        # Tokenizing is CPU work: keep it off the event loop (MLX work is on the engine).
        try:
            prompt = await asyncio.to_thread(tokenize, body)
        except APIError:
            raise
        except Exception as exc:  # e.g. the chat template rejects the message sequence
            raise APIError(400, f"could not build the prompt: {exc}", param=param) from exc
        context = self.loaded.context_length
        if not prompt:
            raise APIError(400, "the prompt is empty", param=param)
        if len(prompt) >= context:
            raise context_length_exceeded(len(prompt), context, param)
        if self.limits.max_prompt_tokens is not None and len(prompt) > self.limits.max_prompt_tokens:
            raise prompt_too_long(len(prompt), self.limits.max_prompt_tokens, param)
        requested = body.token_limit()
        if requested is not None and requested > self.limits.max_tokens:
            cap_param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            raise max_tokens_too_large(requested, self.limits.max_tokens, cap_param)
        plan = self._plan(body)
        sampling = SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
            top_logprobs=body.logprobs_count(),
            **({} if body.seed is None else {"seed": body.seed}),
        )
        request = GenerationRequest(
            prompt_tokens=prompt,
            max_tokens=requested or min(self.limits.max_tokens, context - len(prompt)),
            sampling=sampling,
            stop=tuple(body.stop_list()),
            deterministic=body.deterministic,
            speculative=body.speculative,
            num_draft_tokens=body.num_draft_tokens,
        )
        record = current()
        if self.log_prompts and record is not None:
            record.prompt = body.messages if isinstance(body, p.ChatCompletionRequest) else body.prompt
        try:
            return track(self.engine.submit(request, plan))
        except QueueFull as exc:
            raise queue_full(self.limits.max_queue) from exc
        except TooLargeForMemory as exc:
            raise APIError(400, str(exc), param="max_tokens", code="kv_budget_exceeded") from exc
        except GenerationError as exc:
            raise APIError(503, str(exc), type="server_error") from exc

    def _plan(self, body: p.SamplingRequest) -> DecodePlan:
        if body.deterministic and body.temperature >= GREEDY_BELOW and body.seed is None:
            raise APIError(400, "deterministic sampling with temperature > 0 needs a seed", param="seed")
        try:
            return plan_request(self.engine.deployment, deterministic=body.deterministic,
                                speculative=body.speculative, num_draft_tokens=body.num_draft_tokens)
        except RequestRejected as exc:
            raise APIError(400, str(exc), param=exc.param) from exc

    async def _collect(self, handle) -> Delta:
        try:
            return _merge([delta async for delta in handle])
        except GenerationError as exc:
            raise _cut_error(exc) from exc
        finally:
            handle.cancel()  # frees the slot if this handler is cancelled mid-way

    async def _collect_unless_disconnected(self, handle, receive) -> Delta:
        if receive is None:
            return await self._collect(handle)
        return await unless_disconnected(self._collect(handle), receive)

    async def _stream(self, handle, chunks: AsyncIterator[p.Response]) -> AsyncIterator[str]:
        """SSE framing for `chunks` (made from `handle`'s deltas), ending in [DONE]."""
        try:
            async for chunk in chunks:
                yield _sse(chunk)
        except GenerationError as exc:  # headers are sent: report it as an event
            yield _sse(p.ErrorResponse(error=_cut_error(exc).body))
        finally:
            handle.cancel()  # the client went away (or we are done): free the slot
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------- endpoints

    async def chat(self, body: p.ChatCompletionRequest, receive=None):
        handle = await self._submit(body, self._chat_tokens, "messages")
        common = {"id": p.new_id("chatcmpl"), "model": self.loaded.name, "system_fingerprint": self.fingerprint}

        def logprobs(d: Delta) -> p.ChatLogprobs | None:
            return _chat_logprobs(d) if body.logprobs else None

        if not body.stream:
            d = await self._collect_unless_disconnected(handle, receive)
            choice = p.ChatChoice(
                message=p.AssistantMessage(content=d.text), finish_reason=d.finish_reason, logprobs=logprobs(d)
            )
            return JSONResponse(p.ChatCompletion(**common, choices=[choice], usage=_usage(d),
                                                 lockstep=d.extension).model_dump())

        async def chunks() -> AsyncIterator[p.ChatCompletionChunk]:
            role = "assistant"  # sent once, in the first chunk
            async for d in handle:
                if d.text or d.logprobs or role:
                    choice = p.ChatChunkChoice(delta=p.ChatDelta(role=role, content=d.text), logprobs=logprobs(d))
                    yield p.ChatCompletionChunk(**common, choices=[choice])
                    role = None
                if d.finish_reason is not None:
                    finish = p.ChatChunkChoice(delta=p.ChatDelta(), finish_reason=d.finish_reason)
                    yield p.ChatCompletionChunk(**common, choices=[finish], lockstep=d.extension)
                    if body.include_usage():
                        yield p.ChatCompletionChunk(**common, choices=[], usage=_usage(d))

        return StreamingResponse(self._stream(handle, chunks()), media_type="text/event-stream")

    async def completions(self, body: p.CompletionRequest, receive=None):
        handle = await self._submit(body, self._completion_tokens, "prompt")
        common = {"id": p.new_id("cmpl"), "model": self.loaded.name, "system_fingerprint": self.fingerprint}

        def choice(d: Delta) -> p.CompletionChoice:
            logprobs = _completion_logprobs(d) if body.logprobs is not None else None
            return p.CompletionChoice(text=d.text, finish_reason=d.finish_reason, logprobs=logprobs)

        if not body.stream:
            d = await self._collect_unless_disconnected(handle, receive)
            return JSONResponse(p.TextCompletion(**common, choices=[choice(d)], usage=_usage(d),
                                                 lockstep=d.extension).model_dump())

        async def chunks() -> AsyncIterator[p.TextCompletion]:
            async for d in handle:
                yield p.TextCompletion(**common, choices=[choice(d)], lockstep=d.extension)
                if d.finish_reason is not None and body.include_usage():
                    yield p.TextCompletion(**common, choices=[], usage=_usage(d))

        return StreamingResponse(self._stream(handle, chunks()), media_type="text/event-stream")

    def models(self, extras: dict | None) -> p.ModelList:
        info = {"weights": self.loaded.weights, "context_length": self.loaded.context_length,
                "batching": self.engine.describe()}
        card = p.ModelCard(
            id=self.loaded.name,
            created=self.created,
            lockstep={**info, **(extras or {})},
        )
        return p.ModelList(data=[card])


def create_app(
    engine: Engine,
    *,
    model_extras: dict | None = None,
    fingerprint: str | None = None,
    api_keys: Sequence[str] = (),
    limits: Limits = Limits(),
    log_prompts: bool = False,
) -> FastAPI:
    """The HTTP app for `engine`'s model. `model_extras` is added to its /v1/models entry.

    `api_keys` (empty: auth off) guard /v1 and /metrics; `limits` caps bodies, tokens and
    the queue; prompts appear in the access log only with `log_prompts`.
    """
    routes = Routes(engine, fingerprint or _fingerprint(engine.loaded), limits, log_prompts)
    app = FastAPI(title="lockstep", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.drain = Drain()
    metrics = Metrics()
    metrics.watch_engine(engine)
    engine.max_waiting = limits.max_queue
    app.state.drain.on_cut.append(lambda: engine.cut_off(SHUTTING_DOWN))
    install_error_handlers(app)
    # Added innermost first: record (log, metrics) -> drain -> auth -> body size -> routes.
    app.add_middleware(BodySizeLimit, limit=limits.max_body_bytes)
    app.add_middleware(APIKeyAuth, keys=list(api_keys))
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    app.add_middleware(RecordRequests, sinks=[AccessLog(log_prompts), metrics])

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        return await routes.chat(body, request.receive)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request):
        return await routes.completions(body, request.receive)

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse(routes.models(model_extras).model_dump())

    @app.head("/health", include_in_schema=False)  # load balancers often probe with HEAD
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.loaded.name, **engine.counts()}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    metrics.endpoints = {route.path for route in app.routes}
    return app
