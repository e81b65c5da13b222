"""What the OpenAI-shaped endpoints answer: chat completions and their stream chunks, text
completions, usage, logprobs, model cards and lists, the error body; `new_id`."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from lockstep.server.api.sampling_protocol import _omit_if_none


FinishReason = Literal["stop", "length", "tool_calls", "function_call"]


class ResponseBody(BaseModel):
    pass


class CompletionTokensDetails(ResponseBody):
    """As OpenAI reports them: prediction tokens accepted and rejected by verification (docs/API.md)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    reasoning_tokens: int = 0  # no reasoning models are served
    audio_tokens: int = 0


class PromptTokensDetails(ResponseBody):
    """As OpenAI reports them: prompt tokens whose KV came from the prefix cache."""

    cached_tokens: int = 0
    audio_tokens: int = 0


class Usage(ResponseBody):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(default=None, exclude_if=_omit_if_none)
    completion_tokens_details: CompletionTokensDetails | None = Field(default=None, exclude_if=_omit_if_none)


class TopLogprob(ResponseBody):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseBody):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(ResponseBody):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class ResponseFunctionCall(ResponseBody):
    name: str
    arguments: str


class ResponseToolCall(ResponseBody):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(ResponseBody):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None  # lockstep's models never refuse through this field
    tool_calls: list[ResponseToolCall] | None = Field(default=None, exclude_if=_omit_if_none)
    function_call: ResponseFunctionCall | None = Field(default=None, exclude_if=_omit_if_none)  # legacy functions


class ChatChoice(ResponseBody):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None
    lockstep: dict | None = Field(default=None, exclude_if=_omit_if_none)  # the choice's receipt


class ToolCallDelta(ResponseBody):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatDelta(ResponseBody):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_omit_if_none)
    content: str | None = Field(default=None, exclude_if=_omit_if_none)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_omit_if_none)
    function_call: ResponseFunctionCall | None = Field(default=None, exclude_if=_omit_if_none)


class ChatChunkChoice(ResponseBody):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class CompletionChoice(ResponseBody):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None
    lockstep: dict | None = Field(default=None, exclude_if=_omit_if_none)  # the choice's receipt


class _Completion(ResponseBody):
    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    service_tier: str | None = Field(default=None, exclude_if=_omit_if_none)  # "default", when asked
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


class ModelCard(ResponseBody):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lockstep"
    # lockstep extension: per-model details (weights, context length, audit summary...).
    lockstep: dict | None = Field(default=None, exclude_if=_omit_if_none)


class ModelList(ResponseBody):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(ResponseBody):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseBody):
    error: ErrorBody


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
