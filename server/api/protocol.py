"""Pydantic models mirroring the OpenAI API: requests, responses, stream chunks, errors.

Requests forbid unknown fields, so a typo is a 400 naming the field instead of being
silently ignored, and types are strict as OpenAI's are (`"4"`, `true` or `1e3` is not an
integer, `"yes"` is not a boolean). Fields lockstep cannot honour (echo, suffix) are
rejected with the field named as `param`; rules that a union type would report obscurely
(how many stop strings, one prompt, text-only content) are checked first and named
plainly. The `lockstep` request fields and the `lockstep` response object are this
server's extensions; everything else follows the spec. /v1/responses has its models in
server/api/responses_protocol.py.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n: choices per request (each is generated as a request of its own)
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
# OpenAI's seed is a signed 64-bit integer; outside it a seed would alias another one.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _check_unicode(text: str) -> str:
    """Lone surrogates (valid JSON escapes, invalid Unicode) cannot be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it contains a lone surrogate)") from None
    return text


def _omit_if_none(value) -> bool:
    return value is None


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Request):
    include_usage: bool = False


class SamplingRequest(Request):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # 0 = off (OpenAI has no top_k; vLLM-style)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # Token id (as a string, as JSON keys are) -> bias in [-100, 100].
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # lockstep extensions, carried to the engine unchanged.
    deterministic: bool = False
    speculative: Literal["none", "draft", "prompt_lookup"] | None = None
    num_draft_tokens: int | None = Field(default=None, ge=1)

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_and_range(cls, bias):
        for key, value in (bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key}")
        return bias

    @field_validator("stop", mode="before")
    @classmethod
    def _at_most_four_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stop)}")
        return stop

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def bias_items(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), v) for k, v in (self.logit_bias or {}).items())


# ----------------------------------------------------------------------------- tools

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; absent = no arguments
    strict: bool | None = None


class Tool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Request):
    name: str


class NamedToolChoice(Request):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseFormatText(Request):
    type: Literal["text"]


class ResponseFormatJSONObject(Request):
    type: Literal["json_object"]


class JSONSchemaFormat(Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormatJSONSchema(Request):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
                           Field(discriminator="type")]


class TextContentPart(Request):
    type: Literal["text"]
    text: str


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: which call this answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"only text content parts are supported (got type {kind!r})")
        return content

    @field_validator("content")
    @classmethod
    def _valid_unicode(cls, content):
        if content is None:
            return content
        for text in [content] if isinstance(content, str) else [part.text for part in content]:
            _check_unicode(text)
        return content

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        """Alternatives per token, or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_mode(self) -> str:
        """"none" (tools not offered), "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"


TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    # A string, one string in a list, token ids, or one list of token ids.
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1, max_length=1)
    ]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt):
        # A list of strings or of token lists is a batch of prompts; lockstep takes one.
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(x, (str, list)) for x in prompt):
            raise ValueError(f"one prompt per request is supported, got {len(prompt)}")
        return prompt

    @field_validator("prompt")
    @classmethod
    def _valid_unicode(cls, prompt):
        texts = [prompt] if isinstance(prompt, str) else [x for x in prompt if isinstance(x, str)]
        for text in texts:
            _check_unicode(text)
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix):
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return self.logprobs


# ----------------------------------------------------------------------------- responses

FinishReason = Literal["stop", "length", "tool_calls"]


class Response(BaseModel):
    pass


class Usage(Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Response):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(Response):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class ResponseFunctionCall(Response):
    name: str
    arguments: str


class ResponseToolCall(Response):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = Field(default=None, exclude_if=_omit_if_none)


class ChatChoice(Response):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ToolCallDelta(Response):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatDelta(Response):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_omit_if_none)
    content: str | None = Field(default=None, exclude_if=_omit_if_none)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_omit_if_none)


class ChatChunkChoice(Response):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class CompletionChoice(Response):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class _Completion(Response):
    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list
    usage: Usage | None = None
    # lockstep extension (e.g. determinism or speculative-decoding statistics).
    lockstep: dict | None = Field(default=None, exclude_if=_omit_if_none)


class ChatCompletion(_Completion):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_Completion):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class TextCompletion(_Completion):
    # OpenAI uses the same object name for streamed chunks of /v1/completions.
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lockstep"
    # lockstep extension: per-model details (weights, context length, audit summary...).
    lockstep: dict | None = Field(default=None, exclude_if=_omit_if_none)


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Response):
    error: ErrorBody


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
