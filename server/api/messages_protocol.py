"""Pydantic models for POST /v1/messages (Anthropic's Messages API): the request, the message
object it answers with, and the stream's events.

The request carries what Anthropic's own API takes for text models: `system` (a string or text
blocks), `messages` of text / tool_use / tool_result blocks, `tools` with an `input_schema`,
`tool_choice` (auto, any, tool, none), `stop_sequences`, `max_tokens` (required, as there),
`temperature` (0..1, as there), `top_p`, `top_k`, `metadata`, `stream`, and lockstep's own
fields (`deterministic`, `seed`, `speculative`, `num_draft_tokens`). Prompt-caching hints
(`cache_control`), `thinking` (the models served here write no thinking blocks), `output_config`'s
`effort` and Anthropic's routing fields are accepted with no effect; `output_config.format` (a JSON
schema) constrains the answer as chat's `response_format` does; what lockstep cannot do (images,
documents, server tools, a code-execution container) is a 400 naming it. Unknown fields are a 400, as the OpenAI routes' are.
"""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from lockstep.server.api.sampling_protocol import MAX_STOP_SEQUENCES, SEED_MAX, SEED_MIN, unicode_checked


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict] | None = None  # accepted, ignored (lockstep cites nothing)


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(Strict):
    """A previous turn's thinking, as clients replay it: accepted and left out of the prompt."""
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class UnsupportedBlock(BaseModel):
    """Blocks lockstep cannot read (images, documents, server tool results): a 400 naming them."""
    model_config = ConfigDict(extra="allow")
    type: str

    @field_validator("type")
    @classmethod
    def _refused(cls, kind):
        raise ValueError(f"content blocks of type '{kind}' are not supported: lockstep serves text models "
                         "(text, tool_use and tool_result blocks)")


def _block_kind(block) -> str:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    if kind in ("thinking", "redacted_thinking"):
        return "thinking"
    return kind if kind in ("text", "tool_use", "tool_result") else "unsupported"


ContentBlock = Annotated[
    Union[Annotated[TextBlock, Tag("text")], Annotated[ToolUseBlock, Tag("tool_use")],
          Annotated[ToolResultBlock, Tag("tool_result")], Annotated[ThinkingBlock, Tag("thinking")],
          Annotated[UnsupportedBlock, Tag("unsupported")]],
    Discriminator(_block_kind),
]


class InputMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def blocks(self) -> list:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Tool(Strict):
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    # accepted with no effect: a called tool's input always follows its schema here (a grammar
    # forces it), and hints for Anthropic's own tool runtime
    strict: bool | None = None
    cache_control: CacheControl | None = None
    allowed_callers: list[str] | None = None
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema):
        if schema.get("type") != "object":
            raise ValueError("a tool's input_schema must be a JSON schema of type 'object'")
        return schema


class ToolChoiceAuto(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Strict):
    type: Literal["none"]


ToolChoice = Annotated[Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone],
                       Field(discriminator="type")]


class Thinking(BaseModel):
    """Accepted with no effect: the models lockstep serves write no separate thinking blocks."""
    model_config = ConfigDict(extra="allow")
    type: Literal["disabled", "enabled", "adaptive"]


class JSONOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # no effect here
    format: JSONOutputFormat | None = None


class Metadata(Strict):
    user_id: str | None = None


class MessagesRequest(Strict):
    model: str
    max_tokens: int = Field(ge=1)
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    stream: bool = False
    output_config: OutputConfig | None = None
    container: dict[str, Any] | str | None = None
    # accepted with no effect: caching hints (lockstep's prefix cache needs none), routing and
    # bookkeeping of Anthropic's own service
    service_tier: Literal["auto", "standard_only"] | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # lockstep's extensions, as on the OpenAI routes
    deterministic: bool = False
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    speculative: Literal["none", "draft", "prompt_lookup"] | None = None
    num_draft_tokens: int | None = Field(default=None, ge=1)

    _unicode = unicode_checked()

    @field_validator("container")
    @classmethod
    def _no_container(cls, container):
        if container is not None:
            raise ValueError("lockstep runs no code-execution container")
        return container

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty_stops(cls, stops):
        if any(s == "" for s in stops or []):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools):
        names = [t.name for t in tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        return tools


class CountTokensRequest(Strict):
    """POST /v1/messages/count_tokens: the prompt part of a MessagesRequest."""
    model: str
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None

    _unicode = unicode_checked()


# ----------------------------------------------------------------------------- responses

class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    service_tier: str = "standard"


class OutputText(BaseModel):
    type: Literal["text"] = "text"
    text: str = ""


class OutputToolUse(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText | OutputToolUse] = Field(default_factory=list)
    model: str
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage
    lockstep: dict | None = None


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments (JSON text) as the input object Anthropic's blocks carry."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def event(kind: str, **fields) -> str:
    """One SSE event as Anthropic frames them: `event: <type>` and the same type in the data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


# Anthropic's error types by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
