"""FastAPI routes: /v1/chat/completions, /v1/completions, /v1/models (and one model), /health.

A route turns its request into a `GenerationRequest` (prompt tokens, limits, sampling),
submits it to the engine and turns the engine's `Delta`s into OpenAI JSON, either one
response or server-sent events (`data: {...}` ... `data: [DONE]`).

The `model` field must name the served model (its `name`) or the alias "default".
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from importlib import metadata
from typing import AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lockstep.server.api import choices
from lockstep.server.api.chat_protocol import ChatCompletionRequest
from lockstep.server.api.completions_protocol import CompletionRequest
from lockstep.server.api.response_bodies import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                                 ChatCompletionChunk, ChatDelta, ChatLogprobs, ChatTokenLogprob,
                                                 CompletionChoice, CompletionLogprobs, ErrorResponse, ModelCard,
                                                 ModelList, ResponseBody, ResponseFunctionCall, ResponseToolCall,
                                                 TextCompletion, ToolCallDelta, TopLogprob, new_id)
from lockstep.server.api.sampling_protocol import SamplingRequest
from lockstep.server.api import sse
from lockstep.server.api.access_log import AccessLog
from lockstep.server.api.chat_prompt import chat_prompt_tokens
from lockstep.server.api.chunk_json import ChunkTemplate
from lockstep.server.api.constraints import Constraints
from lockstep.server.api.grammar_checks import GrammarChecks
from lockstep.server.api.auth import APIKeyAuth
from lockstep.server.api.disconnect import unless_disconnected
from lockstep.server.api.drain import Drain, DrainMiddleware
from lockstep.server.engine import Engine, GenerationError, QueueFull, TooLargeForMemory
from lockstep.server.api.messages import MessagesRoute
from lockstep.server.api.limits import (BodySizeLimit, Limits, max_tokens_too_large, prediction_too_long,
                                        prompt_too_long, queue_full)
from lockstep.server.api.metrics import Metrics
# "default" names the (first) model; `<model>:deterministic` asks for deterministic mode by the
# model's name, for clients that drop extra body fields (docs/API.md)
from lockstep.server.api.model_pool import DETERMINISTIC_SUFFIX, MODEL_ALIAS, ModelPool  # noqa: F401
from lockstep.server.api.model_routes import install_model_routes, install_pool_model_routes
from lockstep.server.api.recorder import RecordedGroup, Recorder
from lockstep.server.api.request_record import RecordRequests, current, track
from lockstep.server.api.responses import ResponsesRoute
from lockstep.server.api.responses_protocol import ResponsesRequest
from lockstep.server.api.errors import (APIError, RetryAfter, context_length_exceeded, generation_error,
                               install_error_handlers, model_not_found)
from lockstep.server.engine.guarantee.decode_plan import PREDICTION, DecodePlan, RequestRejected, plan_request
from lockstep.server.engine.generate import Delta, GenerationRequest
from lockstep.server.engine.decoding.request_report import rendered
from lockstep.server.engine.decoding.logits_processors import logits_width
from lockstep.server.engine.decoding.sampling import GREEDY_BELOW, SamplingParams, draw_seed
from lockstep.server.api.tool_call_stream import ToolCallStream, call_stream
from lockstep.server.api.tool_calls import ParsedCall, new_call_id, tool_format

# How long a deterministic request waits for a guarantee still being proven (`--guarantee-timeout`),
# and the Retry-After of its 503 when that runs out.
DEFAULT_GUARANTEE_TIMEOUT_S = 120.0
GUARANTEE_RETRY_AFTER_S = 5
SHUTTING_DOWN = "the server is shutting down; this request was cut off"

log = logging.getLogger("lockstep.app")


def _fingerprint(loaded) -> str:
    recipe = f"{loaded.name}|{loaded.weights}|mlx {metadata.version('mlx')}"
    return "fp_" + hashlib.sha256(recipe.encode()).hexdigest()[:10]


def _extras(extras: dict | Callable[[], dict] | None) -> dict:
    """/v1/models' extra details; a function gives those that change (the guarantee's state)."""
    return (extras() if callable(extras) else extras) or {}


def _sse(payload: ResponseBody | str) -> str:
    """One event: a chunk, or its JSON already rendered (server/api/chunk_json.py)."""
    return f"data: {payload if isinstance(payload, str) else payload.model_dump_json()}\n\n"


def _chat_logprobs(delta: Delta) -> ChatLogprobs:
    def top(token: str, logprob: float) -> TopLogprob:
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()),
                top_logprobs=[top(t, v) for t, v in lp.top],
            )
            for lp in delta.logprobs
        ]
    )


def _completion_logprobs(delta: Delta) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=[lp.token for lp in delta.logprobs],
        token_logprobs=[lp.logprob for lp in delta.logprobs],
        top_logprobs=[dict(lp.top) for lp in delta.logprobs],
        text_offset=list(delta.text_offsets),
    )


def _response_calls(calls: list[ParsedCall]) -> list[ResponseToolCall]:
    return [ResponseToolCall(id=new_call_id(), function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]


def _choice_lockstep(d: Delta, body: SamplingRequest) -> dict | None:
    """A finished choice's own `lockstep` object: its receipt, and its token ids when asked."""
    if d.report is None:
        return None
    info = {"receipt": d.report.receipt}
    if body.return_token_ids:
        info["token_ids"] = list(d.token_ids or ())
    return info


def _final_lockstep(d: Delta, body: SamplingRequest) -> dict | None:
    """A stream's `lockstep` object on a choice's final chunk (its own report and receipt)."""
    if d.report is None or not body.return_token_ids:
        return rendered(d.report)
    return {**d.report.render(), "token_ids": list(d.token_ids or ())}


def _finish_reason(reason: str | None, called: bool, legacy: bool = False) -> str | None:
    if called and reason == "stop":
        return "function_call" if legacy else "tool_calls"
    return reason


class Routes:
    """Request handling for one served model."""

    def __init__(self, engine: Engine, fingerprint: str | None, limits: Limits = Limits(), log_prompts: bool = False,
                 guarantee_timeout: float = DEFAULT_GUARANTEE_TIMEOUT_S, drain: Drain | None = None,
                 deterministic_by_default: bool = False, recorder: Recorder | None = None,
                 name: str | None = None, grammar_checks: GrammarChecks | None = None):
        self.engine = engine
        self.drain = drain or Drain()
        self.deterministic_by_default = deterministic_by_default
        self.recorder = recorder
        self.loaded = engine.loaded
        self.name = name or (self.loaded.name if self.loaded is not None else "")  # the id it is served as
        self._fingerprint = fingerprint
        self.limits = limits
        self.guarantee_timeout = guarantee_timeout
        self.log_prompts = log_prompts
        self.created = int(time.time())
        self.tool_format = tool_format(self.loaded.tokenizer) if self.loaded is not None else None
        self.constraints = Constraints(self.loaded, self.tool_format)
        self.grammar_checks = grammar_checks or GrammarChecks(limits.grammar_workers, limits.grammar_queue)

    @property
    def fingerprint(self) -> str:
        """The one given, else the deployment's (it names the strategy, so it changes once the
        guarantee is proven), else one from the model."""
        return self._fingerprint or self.engine.deployment.fingerprint or _fingerprint(self.loaded)

    # ------------------------------------------------------------ request -> generation

    def _check_model(self, model: str) -> None:
        if model.removesuffix(DETERMINISTIC_SUFFIX) not in (self.name, MODEL_ALIAS):
            raise model_not_found(model)

    def _settle_determinism(self, body: SamplingRequest) -> None:
        """Whether `body` is deterministic (its field; else the model name's suffix; else the
        deployment's default), and the seed a sampled deterministic request runs with: the one it
        sent, else one drawn here and reported back (`lockstep.seed`), so the answer can be
        reproduced by sending it. Set on `body` itself: the response is rendered from it."""
        if "deterministic" not in body.model_fields_set:
            body.deterministic = body.model.endswith(DETERMINISTIC_SUFFIX) or self.deterministic_by_default
        if body.deterministic and body.temperature >= GREEDY_BELOW and body.seed is None:
            body.seed = draw_seed()

    def _chat_tokens(self, body: ChatCompletionRequest) -> list[int]:
        return chat_prompt_tokens(self.loaded.tokenizer, body, self.tool_format)

    def _completion_tokens(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self.loaded.tokenizer.encode(prompt))
        vocab = len(self.loaded.tokenizer)
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)

    def _prepare(self, body: SamplingRequest, tokenize: Callable) -> tuple[list[int], tuple[int, ...]]:
        """Prompt tokens and the prediction's tokens, the offered tools checked (CPU work, run off
        the event loop)."""
        prompt = tokenize(body)
        self.constraints.check_tools(body)
        return prompt, self._prediction_tokens(body)

    async def _grammar(self, body: SamplingRequest):
        """The output grammar, or None. Checked and compiled on the grammar checks' own threads
        (a 429 when their queue is full), so a plain request never waits behind them."""
        if not self.constraints.needs_grammar(body):
            return None
        return await self.grammar_checks.run(self.constraints.grammar_for, body)

    def _prediction_tokens(self, body: SamplingRequest) -> tuple[int, ...]:
        """Predicted Outputs: the predicted answer as the tokens the model would write it in."""
        text = body.prediction_text()
        if not text:
            return ()
        return tuple(self.loaded.tokenizer.encode(text, add_special_tokens=False))

    async def _submit(self, body: SamplingRequest, tokenize: Callable, param: str) -> list:
        """Submit `body`'s n choices; returns their engine handles."""
        self._check_model(body.model)
        self._settle_determinism(body)
        try:
            prompt, prediction = await asyncio.to_thread(self._prepare, body, tokenize)
            grammar = await self._grammar(body)
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
        # without --max-prompt-tokens a prompt may fill the context, as far as KV memory holds it
        kv_room = self.engine.kv_room(len(prompt)) if hasattr(self.engine, "kv_room") else None
        if self.limits.max_prompt_tokens is None and kv_room is not None and kv_room < 1:
            raise prompt_too_long(len(prompt), len(prompt) + kv_room - 1, param)
        if len(prediction) > self.limits.max_prediction_tokens:
            raise prediction_too_long(len(prediction), self.limits.max_prediction_tokens)
        requested = body.token_limit()
        if requested is not None and requested > self.limits.max_tokens:
            cap_param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            raise max_tokens_too_large(requested, self.limits.max_tokens, cap_param)
        vocab = logits_width(self.loaded)
        if any(token >= vocab for token, _ in body.bias_items()):
            raise APIError(400, f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
        if body.deterministic:
            await self._await_guarantee()
        plan = self._plan(body, bool(prediction))
        requests = [
            GenerationRequest(
                prompt_tokens=prompt,
                max_tokens=requested or self._default_max_tokens(len(prompt), plan, kv_room),
                sampling=self._sampling(body, i),
                stop=tuple(body.stop_list()) + self._tool_stops(body),
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                logit_bias=body.bias_items(),
                grammar=grammar,
                prediction=prediction if plan.method == PREDICTION else (),
            )
            for i in range(body.n)
        ]
        record = current()
        if self.log_prompts and record is not None:
            record.prompt = body.messages if isinstance(body, ChatCompletionRequest) else body.prompt
        try:
            handles = [track(handle) for handle in self.engine.submit_group(requests, plan)]
        except QueueFull as exc:
            raise queue_full(self.limits.max_queue) from exc
        except TooLargeForMemory as exc:
            raise APIError(400, str(exc), param="max_tokens", code="kv_budget_exceeded") from exc
        except GenerationError as exc:
            raise APIError(503, str(exc), type="server_error") from exc
        if self.recorder is not None:  # `serve --record`: written once every choice has finished
            handles = RecordedGroup(self.recorder, body, handles).handles
        return handles

    def _default_max_tokens(self, prompt_tokens: int, plan: DecodePlan, kv_room: int | None) -> int:
        """max_tokens for a request that sets none: --max-tokens-limit, within the context and
        what the KV budget leaves beside the prompt (a long conversation is answered, not
        refused for a limit it did not ask for)."""
        tokens = min(self.limits.max_tokens, self.loaded.context_length - prompt_tokens)
        if kv_room is not None:
            tokens = min(tokens, kv_room - plan.num_draft_tokens)
        return max(1, tokens)

    async def _await_guarantee(self) -> None:
        """A deterministic request is planned only once the guarantee's proof has settled (it
        never runs unproven): it waits up to `--guarantee-timeout`, then gets a 503 (at once if
        the server starts draining meanwhile)."""
        state = self.engine.guarantee
        if state.settled or await self.drain.unless_draining(state.wait(self.guarantee_timeout)):
            return
        raise APIError(503, "this server is still proving its determinism guarantee (it serves requests "
                            "without `deterministic` meanwhile); retry shortly",
                       type="server_error", param="deterministic", code="guarantee_pending",
                       headers={"Retry-After": str(GUARANTEE_RETRY_AFTER_S)})

    def _tool_stops(self, body: SamplingRequest) -> tuple[str, ...]:
        """A format whose turn ends with a call (gpt-oss's <|call|>, which not every config makes an
        eos token) stops there: the tool answers next, not the model."""
        offered = isinstance(body, ChatCompletionRequest) and body.tool_mode() != "none"
        return (self.tool_format.stop,) if offered and self.tool_format and self.tool_format.stop else ()

    @staticmethod
    def _sampling(body: SamplingRequest, choice: int) -> SamplingParams:
        seed = {} if body.seed is None else {"seed": choices.choice_seed(body.seed, choice)}
        return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                              min_p=body.min_p, top_logprobs=body.logprobs_count(), **seed)

    def _plan(self, body: SamplingRequest, prediction: bool = False) -> DecodePlan:
        try:
            plan = plan_request(self.engine.deployment, deterministic=body.deterministic,
                                speculative=body.speculative, num_draft_tokens=body.num_draft_tokens,
                                prediction=prediction)
        except RequestRejected as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        sampled = body.deterministic and body.temperature >= GREEDY_BELOW
        return dataclasses.replace(plan, seed=body.seed) if sampled else plan

    async def submit_chat(self, body: ChatCompletionRequest) -> list:
        """Submit a chat request's n choices (also what /v1/responses runs as)."""
        return await self._submit(body, self._chat_tokens, "messages")

    async def collect(self, handles, receive) -> list[Delta]:
        """Each choice's whole output; a client that disconnects cancels them all."""
        try:
            if receive is None:
                return await choices.collect(handles)
            return await unless_disconnected(choices.collect(handles), receive)
        except GenerationError as exc:
            raise generation_error(exc) from exc

    async def _stream(self, handles, chunks: AsyncIterator[ResponseBody | str], gather: bool = False) -> AsyncIterator[str]:
        """SSE framing for `chunks` (made from `handles`' deltas), ending in [DONE]. `gather`:
        every delta makes a chunk, so the events of deltas already queued go out in one write
        (server/api/sse.py); where a delta may make none (text held back), each goes alone."""
        writes = sse.Writes(lambda: any(sse.queued(h) for h in handles)) if gather else sse.Writes()
        try:
            async for chunk in chunks:
                write = writes.add(_sse(chunk))
                if write is not None:
                    yield write
        except GenerationError as exc:  # headers are sent: report it as an event
            yield writes.take() + _sse(ErrorResponse(error=generation_error(exc).body))
        finally:
            choices.cancel_all(handles)  # the client went away (or we are done): free the slots
        yield writes.take() + sse.DONE

    # ------------------------------------------------------------------- endpoints

    def tool_calls_stream(self, body: ChatCompletionRequest) -> ToolCallStream | None:
        """What splits this request's output into content and tool calls (None: no tools, the
        output is all content). A call the output ends inside is dropped (docs/API.md, Tools)."""
        if body.tool_mode() == "none":
            # gpt-oss writes its channels' markup whatever the tools: content is its final text
            harmony = self.tool_format is not None and self.tool_format.name == "gpt_oss"
            return call_stream(self.tool_format, set()) if harmony else None
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        return call_stream(self.tool_format, {t.function.name for t in body.tools},
                           None if body.parallel_tool_calls else 1, tools)

    def _chat_choice(self, index: int, d: Delta, body: ChatCompletionRequest) -> ChatChoice:
        stream = self.tool_calls_stream(body)
        content, calls = (d.text, []) if stream is None else stream.split(d.text)
        legacy = body.legacy_functions()  # deprecated functions: the call as message.function_call
        cut_off = stream is not None and stream.cut_off
        message = AssistantMessage(
            content=(content or None) if calls or cut_off else content,  # null, not "", beside a call
            tool_calls=None if legacy else _response_calls(calls) or None,
            function_call=ResponseFunctionCall(name=calls[0].name, arguments=calls[0].arguments)
            if legacy and calls else None)
        return ChatChoice(index=index, message=message,
                          finish_reason=_finish_reason(d.finish_reason, bool(calls), legacy),
                          logprobs=_chat_logprobs(d) if body.logprobs else None,
                          lockstep=_choice_lockstep(d, body))

    async def chat(self, body: ChatCompletionRequest, receive=None):
        handles = await self.submit_chat(body)
        common = {"id": new_id("chatcmpl"), "model": self.name, "system_fingerprint": self.fingerprint}
        if body.service_tier is not None:  # one tier here, named as OpenAI names its standard one
            common["service_tier"] = "default"
        legacy = body.legacy_functions()

        if not body.stream:
            finals = await self.collect(handles, receive)
            return JSONResponse(ChatCompletion(
                **common, choices=[self._chat_choice(i, d, body) for i, d in enumerate(finals)],
                usage=choices.usage(finals), lockstep=rendered(finals[0].report)).model_dump())

        async def chunks() -> AsyncIterator[ChatCompletionChunk | str]:
            role_due = [True] * len(handles)  # the role is sent once per choice, in its first chunk
            calls = [self.tool_calls_stream(body) for _ in handles]
            sent = [0] * len(handles)  # tool calls sent per choice
            templates: dict[int, ChunkTemplate] = {}  # per choice
            finals: list[Delta] = []
            async for i, d in choices.interleave(handles):
                text, new_calls = d.text, []
                if calls[i] is not None:
                    text, new_calls = calls[i].add(d.text)
                    if d.finish_reason is not None:
                        rest, more = calls[i].finish()
                        text, new_calls = text + rest, new_calls + more
                if text and not (d.logprobs or role_due[i] or new_calls or body.logprobs):
                    # a chunk of text alone, most of a stream's: its JSON from the choice's template
                    if i not in templates:
                        templates[i] = ChunkTemplate(lambda created, content, i=i: ChatCompletionChunk(
                            **common, created=created,
                            choices=[ChatChunkChoice(index=i, delta=ChatDelta(content=content))]))
                    yield templates[i].render(text)
                elif text or d.logprobs or role_due[i] or new_calls:
                    tool_deltas = [ToolCallDelta(index=sent[i] + k, id=c.id, function=c.function)
                                   for k, c in enumerate(_response_calls(new_calls))] or None
                    sent[i] += len(new_calls)
                    function_call = None
                    if legacy and tool_deltas:  # at most one call (parallel_tool_calls is off)
                        function_call, tool_deltas = tool_deltas[0].function, None
                    delta = ChatDelta(role="assistant" if role_due[i] else None,
                                      content=text if text or not (tool_deltas or function_call) else None,
                                      tool_calls=tool_deltas, function_call=function_call)
                    logprobs = _chat_logprobs(d) if body.logprobs else None
                    yield ChatCompletionChunk(**common, choices=[ChatChunkChoice(index=i, delta=delta, logprobs=logprobs)])
                    role_due[i] = False
                if d.finish_reason is not None:
                    finish = ChatChunkChoice(index=i, delta=ChatDelta(),
                                             finish_reason=_finish_reason(d.finish_reason, sent[i] > 0, legacy))
                    yield ChatCompletionChunk(**common, choices=[finish], lockstep=_final_lockstep(d, body))
                    finals.append(d)
            if body.include_usage():
                yield ChatCompletionChunk(**common, choices=[], usage=choices.usage(finals))

        # tool calls and gpt-oss channels hold text back: a delta may then make no chunk
        gather = self.tool_calls_stream(body) is None
        return StreamingResponse(self._stream(handles, chunks(), gather), media_type="text/event-stream")

    async def completions(self, body: CompletionRequest, receive=None):
        handles = await self._submit(body, self._completion_tokens, "prompt")
        common = {"id": new_id("cmpl"), "model": self.name, "system_fingerprint": self.fingerprint}

        def choice(i: int, d: Delta) -> CompletionChoice:
            logprobs = _completion_logprobs(d) if body.logprobs is not None else None
            return CompletionChoice(index=i, text=d.text, finish_reason=d.finish_reason, logprobs=logprobs,
                                    lockstep=_choice_lockstep(d, body) if not body.stream else None)

        if not body.stream:
            finals = await self.collect(handles, receive)
            return JSONResponse(TextCompletion(**common, choices=[choice(i, d) for i, d in enumerate(finals)],
                                               usage=choices.usage(finals), lockstep=rendered(finals[0].report)).model_dump())

        async def chunks() -> AsyncIterator[TextCompletion | str]:
            finals: list[Delta] = []
            templates: dict[int, ChunkTemplate] = {}  # per choice
            async for i, d in choices.interleave(handles):
                if d.finish_reason is None and body.logprobs is None:
                    # text alone, most of a stream's chunks: their JSON from the choice's template
                    if i not in templates:
                        templates[i] = ChunkTemplate(lambda created, text, i=i: TextCompletion(
                            **common, created=created, choices=[CompletionChoice(index=i, text=text)]))
                    yield templates[i].render(d.text)
                    continue
                yield TextCompletion(**common, choices=[choice(i, d)], lockstep=_final_lockstep(d, body))
                if d.finish_reason is not None:
                    finals.append(d)
            if body.include_usage():
                yield TextCompletion(**common, choices=[], usage=choices.usage(finals))

        return StreamingResponse(self._stream(handles, chunks(), gather=True), media_type="text/event-stream")

    def model_card(self, extras: dict | Callable[[], dict] | None) -> ModelCard:
        extras = _extras(extras)
        info = {"weights": self.loaded.weights, "context_length": self.loaded.context_length,
                "batching": self.engine.describe()}
        return ModelCard(id=self.name, created=self.created, lockstep={**info, **extras})

    def models(self, extras: dict | None) -> ModelList:
        card = self.model_card(extras)
        deterministic = card.model_copy(update={"id": card.id + DETERMINISTIC_SUFFIX,
                                                "lockstep": {**card.lockstep, "deterministic_by_name": True}})
        return ModelList(data=[card, deterministic])

    def model(self, model_id: str, extras: dict | None) -> ModelCard:
        """One model by id (the served model's name or the alias "default", either with the
        deterministic suffix); 404 otherwise."""
        self._check_model(model_id)
        card = self.model_card(extras)
        if model_id.endswith(DETERMINISTIC_SUFFIX):
            card = card.model_copy(update={"id": card.id + DETERMINISTIC_SUFFIX,
                                           "lockstep": {**card.lockstep, "deterministic_by_name": True}})
        return card


class OneModel:
    """The one model of a single-model server, behind the interface a `ModelPool` has."""

    def __init__(self, routes: Routes):
        self.routes = routes

    @contextlib.asynccontextmanager
    async def use(self, name: str):
        self.routes._check_model(name)
        yield self.routes


def create_app(
    engine: Engine | None = None,
    *,
    pool: ModelPool | None = None,
    model_extras: dict | Callable[[], dict] | None = None,
    fingerprint: str | None = None,
    api_keys: Sequence[str] = (),
    limits: Limits = Limits(),
    log_prompts: bool = False,
    guarantee_timeout: float = DEFAULT_GUARANTEE_TIMEOUT_S,
    deterministic_by_default: bool = False,
    record_dir: str | None = None,
) -> FastAPI:
    """The HTTP app for `engine`'s model, or for the models of `pool` (each its own engine, loaded
    on demand: server/api/model_pool.py; each model's details are then its `info`). `model_extras`
    (or what it returns, when a function) is added to the one model's /v1/models entry; `fingerprint` (default: the deployment's) is every response's
    system_fingerprint.

    `api_keys` (empty: auth off) guard /v1 and /metrics; `limits` caps bodies, tokens and
    the queue; prompts appear in the access log only with `log_prompts`; a deterministic request
    waits at most `guarantee_timeout` seconds for a guarantee still being proven;
    `deterministic_by_default`: requests that do not send `deterministic` are deterministic;
    `record_dir`: each answered request is appended there (server/api/recorder.py).
    """
    drain = Drain()
    recorder = Recorder(record_dir) if record_dir else None
    app = FastAPI(title="lockstep", docs_url=None, redoc_url=None)
    app.state.drain = drain
    metrics = Metrics()
    if pool is None:
        routes = Routes(engine, fingerprint, limits, log_prompts, guarantee_timeout, drain, deterministic_by_default,
                        recorder)
        models = OneModel(routes)
        app.state.engine = engine
        metrics.watch_engine(engine)
        metrics.watch_startup(lambda: _extras(model_extras).get("startup", {}), engine.guarantee)
        engine.max_waiting = limits.max_queue
        app.state.drain.on_cut.append(lambda: engine.cut_off(SHUTTING_DOWN))
    else:
        grammar_checks = GrammarChecks(limits.grammar_workers, limits.grammar_queue)  # one pool for every model

        def make_routes(service, name: str) -> Routes:
            service.engine.max_waiting = limits.max_queue
            return Routes(service.engine, fingerprint, limits, log_prompts, guarantee_timeout, drain,
                          deterministic_by_default, recorder, name=name, grammar_checks=grammar_checks)

        pool.make_routes = make_routes
        models = pool
        app.state.pool = pool
        metrics.watch_pool(pool)
        app.state.drain.on_cut.append(lambda: sum(e.cut_off(SHUTTING_DOWN) for e in pool.loaded_engines()))
    install_error_handlers(app)
    # Added innermost first: Retry-After -> record (log, metrics) -> drain -> auth -> body size -> routes.
    app.add_middleware(BodySizeLimit, limit=limits.max_body_bytes)
    app.add_middleware(APIKeyAuth, keys=list(api_keys))
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    app.add_middleware(RecordRequests, sinks=[AccessLog(log_prompts), metrics])
    app.add_middleware(RetryAfter)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        async with models.use(body.model) as routes:
            return await routes.chat(body, request.receive)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        async with models.use(body.model) as routes:
            return await routes.completions(body, request.receive)

    responses = ResponsesRoute(models)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return await responses.create(body, request.receive)

    messages = MessagesRoute(models)

    @app.post("/v1/messages")  # Anthropic's Messages API (server/api/messages.py)
    async def create_message(request: Request):
        return await messages.create(await request.body(), request.receive)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request):
        return await messages.count_tokens(await request.body())

    if pool is None:
        install_model_routes(app, routes, model_extras)
    else:
        install_pool_model_routes(app, pool)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    metrics.endpoints = {route.path for route in app.routes}
    return app
