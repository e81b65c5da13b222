"""One served model's requests as the generating endpoints submit them (`Submissions`).

`submit_chat` / `submit_completion` turn a request into its n `GenerationRequest`s and submit
them: the model name checked, determinism settled (and a seed drawn for a sampled
deterministic request), the prompt tokenized and the offered tools checked off the event loop,
the output grammar compiled on the grammar checks' threads, the limits applied, the guarantee
waited for (deterministic requests), the request planned and its choices submitted as one
group. `collect` reads the choices' whole outputs; `tool_calls_stream` says how the output
splits into content and tool calls. Chat and completions render the outputs (chat.py,
completions.py), as do /v1/responses and /v1/messages (responses.py, messages.py).

The `model` field must name the served model (its `name`) or the alias "default".
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from importlib import metadata
from typing import Callable

from lockstep.server.api import choices
from lockstep.server.api.chat_prompt import chat_prompt_tokens
from lockstep.server.api.chat_protocol import ChatCompletionRequest
from lockstep.server.api.completions_protocol import CompletionRequest
from lockstep.server.api.constraints import Constraints
from lockstep.server.api.disconnect import unless_disconnected
from lockstep.server.api.drain import Drain
from lockstep.server.api.errors import APIError, context_length_exceeded, generation_error, model_not_found
from lockstep.server.api.grammar_checks import GrammarChecks
from lockstep.server.api.limits import Limits, max_tokens_too_large, prediction_too_long, prompt_too_long, queue_full
# "default" names the (first) model; `<model>:deterministic` asks for deterministic mode by the
# model's name, for clients that drop extra body fields (docs/API.md)
from lockstep.server.api.model_pool import DETERMINISTIC_SUFFIX, MODEL_ALIAS
from lockstep.server.api.recorder import RecordedGroup, Recorder
from lockstep.server.api.request_record import current, track
from lockstep.server.api.sampling_protocol import SamplingRequest
from lockstep.server.api.tool_call_stream import ToolCallStream, call_stream
from lockstep.server.api.tool_calls import tool_format
from lockstep.server.engine import Engine, GenerationError, QueueFull, TooLargeForMemory
from lockstep.server.engine.decoding.logits_processors import logits_width
from lockstep.server.engine.decoding.sampling import GREEDY_BELOW, SamplingParams, draw_seed
from lockstep.server.engine.generate import Delta, GenerationRequest
from lockstep.server.engine.guarantee.decode_plan import PREDICTION, DecodePlan, RequestRejected, plan_request

# How long a deterministic request waits for a guarantee still being proven (`--guarantee-timeout`),
# and the Retry-After of its 503 when that runs out.
DEFAULT_GUARANTEE_TIMEOUT_S = 120.0
GUARANTEE_RETRY_AFTER_S = 5


def _fingerprint(loaded) -> str:
    recipe = f"{loaded.name}|{loaded.weights}|mlx {metadata.version('mlx')}"
    return "fp_" + hashlib.sha256(recipe.encode()).hexdigest()[:10]


class Submissions:
    """One served model's request handling: requests in, engine handles out."""

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

    def check_model(self, model: str) -> None:
        """A 404 unless `model` is this model's name or "default", either with `:deterministic`."""
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

    def chat_tokens(self, body: ChatCompletionRequest) -> list[int]:
        """A chat request's prompt: its messages and tools in the model's chat template."""
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
        self.check_model(body.model)
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
        """Submit a chat request's n choices (also what /v1/responses and /v1/messages run as)."""
        return await self._submit(body, self.chat_tokens, "messages")

    async def submit_completion(self, body: CompletionRequest) -> list:
        """Submit a completions request's n choices."""
        return await self._submit(body, self._completion_tokens, "prompt")

    async def collect(self, handles, receive) -> list[Delta]:
        """Each choice's whole output; a client that disconnects cancels them all."""
        try:
            if receive is None:
                return await choices.collect(handles)
            return await unless_disconnected(choices.collect(handles), receive)
        except GenerationError as exc:
            raise generation_error(exc) from exc

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
