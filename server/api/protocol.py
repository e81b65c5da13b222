"""Pydantic models mirroring the OpenAI API: requests, responses, stream chunks, errors.

Requests forbid unknown fields, so a typo is a 400 naming the field instead of being
silently ignored, and types are strict as OpenAI's are (`"4"`, `true` or `1e3` is not an
integer, `"yes"` is not a boolean). Fields lockstep cannot honour (n > 1, penalties, echo)
are rejected with the field named as `param`; rules that a union type would report
obscurely (how many stop strings, one prompt, text-only content) are checked first and
named plainly. The `lockstep` request fields and the `lockstep`
response object are this server's extensions; everything else follows the spec.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
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
    n: int = 1
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # lockstep extensions, carried to the engine unchanged.
    deterministic: bool = False
    speculative: Literal["none", "draft", "prompt_lookup"] | None = None
    num_draft_tokens: int | None = Field(default=None, ge=1)

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("penalties are not supported; use 0")
        return value

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


class TextContentPart(Request):
    type: Literal["text"]
    text: str


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart]
    name: str | None = None

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
        for text in [content] if isinstance(content, str) else [part.text for part in content]:
            _check_unicode(text)
        return content

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        """Alternatives per token, or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None


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

FinishReason = Literal["stop", "length"]


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


class AssistantMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(Response):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatDelta(Response):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_omit_if_none)
    content: str | None = Field(default=None, exclude_if=_omit_if_none)


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
