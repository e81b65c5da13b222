"""Pydantic models mirroring the OpenAI API: requests, responses, stream chunks, errors.

Requests carry the whole current chat-completions and completions schema (docs/API.md has
the table of every field and what lockstep does with it). Each field is implemented,
accepted with its documented effect (bookkeeping such as `store` and `metadata` is
ignored), or refused with a 400 naming it and saying why (`modalities: ["audio"]`: lockstep
writes text only). Unknown fields are still a 400 naming the field, as OpenAI's are, and
types are strict as OpenAI's are (`"4"`, `true` or `1e3` is not an integer, `"yes"` is not a
boolean); `null` is the default wherever the spec makes a field nullable. Rules that a
union type would report obscurely (how many stop strings, one prompt, text-only content)
are checked first and named plainly, and a lone surrogate is refused in any field.

Messages are one class per role (a union on `role`), so a field another role has is still
unknown on this one. Legacy shapes are normalised after validation, so prompt building
sees one shape: `functions` / `function_call` become `tools` / `tool_choice`, a `function`
message a tool result, an assistant `function_call` a tool call, and an `allowed_tools`
tool_choice the subset of tools it allows. The `lockstep` request fields and the `lockstep`
response object are this server's extensions. /v1/responses has its models in
server/api/responses_protocol.py.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator,
                      model_validator)

MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n: choices per request (each is generated as a request of its own)
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
# OpenAI's seed is a signed 64-bit integer; outside it a seed would alias another one.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512.
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


# OpenAI's logit_bias keys are "token IDs as strings": ASCII digits only (str.isdigit() also
# takes "²" and "٣"), and at most 10 of them, so int() never meets a 5000-digit key.
TOKEN_ID = re.compile(r"[0-9]{1,10}")


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_unicode(value, field: str):
    """Refuses a lone surrogate (a valid JSON escape, invalid Unicode) anywhere in `value`.

    It could not be tokenized, and echoed into a JSON answer or an error it cannot be
    encoded; so every field of a request is checked, keys included (iteratively: the
    body may be nested as deep as the JSON parser allows).
    """
    stack = [(value, field)]
    while stack:
        part, where = stack.pop()
        if isinstance(part, str):
            if not _is_unicode(part):
                raise ValueError(f"text must be valid Unicode (a lone surrogate in {where})")
        elif isinstance(part, dict):
            for key, item in part.items():
                if isinstance(key, str) and not _is_unicode(key):
                    raise ValueError(f"text must be valid Unicode (a lone surrogate in a key of {where})")
                if isinstance(item, (str, dict, list)):
                    stack.append((item, f"{where}.{key}"))
        elif isinstance(part, list):
            stack.extend((item, f"{where}.{i}") for i, item in enumerate(part)
                         if isinstance(item, (str, dict, list)))
    return value


def unicode_checked():
    """A before-validator for every field of a top-level request, so errors name the field."""
    def check(cls, value, info: ValidationInfo):
        return _check_unicode(value, info.field_name)

    return field_validator("*", mode="before")(classmethod(check))


def shown(value, limit: int = 40) -> str:
    """A user's value in an error message: as JSON (escaped, not a Python repr), cut short."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _omit_if_none(value) -> bool:
    return value is None


def _refused(field: str, why: str, allowed=(None,)):
    """A validator for a field lockstep cannot honour: accepted only with a value in `allowed`."""
    def check(cls, value):
        if value not in allowed:
            raise ValueError(f"{field} is not supported: {why}")
        return value

    return field_validator(field)(classmethod(check))


def _nulls_are_defaults(fields: tuple[str, ...]):
    """A before-validator: the spec makes these fields nullable, and null means the default."""
    def drop(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in fields)}
        return data

    return model_validator(mode="before")(classmethod(drop))


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Request):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None

    # Obfuscation pads stream events against a length side channel; lockstep sends none, and
    # a client that asks for it is told so rather than left without it unknowingly.
    _no_obfuscation = _refused("include_obfuscation", "lockstep does not pad stream events",
                               allowed=(None, False))


Metadata = Annotated[dict[Annotated[str, Field(max_length=MAX_METADATA_KEY)],
                          Annotated[str, Field(max_length=MAX_METADATA_VALUE)]],
                     Field(max_length=MAX_METADATA)]


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
    user: str | None = None  # bookkeeping: ignored
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # Token id (as a string, as JSON keys are) -> bias in [-100, 100].
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # lockstep extensions, carried to the engine unchanged.
    deterministic: bool = False
    speculative: Literal["none", "draft", "prompt_lookup"] | None = None
    num_draft_tokens: int | None = Field(default=None, ge=1)
    # each choice's `lockstep` object lists the answer's token ids (`lockstep replay` asks for them)
    return_token_ids: bool = False

    _defaults_for_nulls = _nulls_are_defaults((
        "temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "logprobs", "echo"))
    _valid_unicode = unicode_checked()

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_and_range(cls, bias):
        for key, value in (bias or {}).items():
            if not TOKEN_ID.fullmatch(key):
                raise ValueError(f"logit_bias keys must be token ids (decimal integers as strings), "
                                 f"got {shown(key)}")
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

    def prediction_text(self) -> str | None:
        """The client's draft of the answer (Predicted Outputs), or None."""
        return None


# ----------------------------------------------------------------------------- tools

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
CUSTOM_TOOLS = "lockstep calls function tools only"


class FunctionDefinition(Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; absent = no arguments
    strict: bool | None = None


class Tool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class CustomGrammar(Request):
    definition: str
    syntax: Literal["lark", "regex"]


class CustomFormatText(Request):
    type: Literal["text"]


class CustomFormatGrammar(Request):
    type: Literal["grammar"]
    grammar: CustomGrammar


class CustomDefinition(Request):
    name: str
    description: str | None = None
    format: Annotated[CustomFormatText | CustomFormatGrammar, Field(discriminator="type")] | None = None


class CustomTool(Request):
    """A free-form-input tool: in the schema, refused by `tools` (CUSTOM_TOOLS)."""

    type: Literal["custom"]
    custom: CustomDefinition


AnyTool = Annotated[Tool | CustomTool, Field(discriminator="type")]


class FunctionName(Request):
    name: str


class NamedToolChoice(Request):
    type: Literal["function"]
    function: FunctionName


class NamedCustomChoice(Request):
    type: Literal["custom"]
    custom: FunctionName


class AllowedTools(Request):
    mode: Literal["auto", "required"]
    tools: Annotated[list[dict], Field(min_length=1)]


class AllowedToolsChoice(Request):
    """Offer only some of `tools` (normalised to that subset and `mode`)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | NamedCustomChoice


class LegacyFunction(Request):
    """An entry of the deprecated `functions` (a function tool without `strict`)."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None


LegacyFunctionChoice = Literal["none", "auto"] | FunctionName


def _unique_names(tools, names: list[str]):
    if len(set(names)) != len(names):
        raise ValueError("tool names must be unique")
    return tools


def _choice_names_a_tool(choice, named: str | None, info: ValidationInfo, name_of, field: str = "tools"):
    """tool_choice against the request's tools (already validated; absent from info.data if invalid)."""
    if field not in info.data:  # tools were refused: that error is the one reported
        return choice
    names = [name_of(tool) for tool in info.data[field] or []]
    if named is not None and named not in names:
        raise ValueError(f"{'tool_choice' if field == 'tools' else 'function_call'} names {shown(named)}, "
                         f"which is not in {field}")
    if choice == "required" and not names:
        raise ValueError("tool_choice 'required' needs tools")
    return choice


class FunctionCall(Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ReplayedFunctionCall(FunctionCall):
    """An earlier call sent back in an assistant message: the openai SDK's `parse()` adds
    `parsed_arguments` (the arguments as its model), which OpenAI accepts and ignores."""

    parsed_arguments: Any = None


class ToolCall(Request):
    id: str
    type: Literal["function"] = "function"
    function: ReplayedFunctionCall
    index: int | None = None  # what a streamed call was assembled from: not needed here


class CustomCall(Request):
    name: str
    input: str


class CustomToolCall(Request):
    id: str
    type: Literal["custom"]
    custom: CustomCall


def _call_type(call) -> str:
    return call.get("type", "function") if isinstance(call, dict) else "function"


AnyToolCall = Annotated[Union[Annotated[ToolCall, Tag("function")], Annotated[CustomToolCall, Tag("custom")]],
                        Discriminator(_call_type)]


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


# ----------------------------------------------------------------------------- messages

class CacheBreakpoint(Request):
    """A prompt-cache hint on a content part: lockstep's prefix cache needs none (ignored)."""

    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class TextContentPart(Request):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: CacheBreakpoint | None = None


class RefusalContentPart(Request):
    type: Literal["refusal"]
    refusal: str


def _text_parts_only(content, also: tuple[str, ...] = ()):
    """Names a content part lockstep cannot read (images, audio, files) before the union would."""
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" and kind not in also:
                raise ValueError(f"only text content parts are supported: the served model reads text only "
                                 f"(got type {shown(kind)})")
    return content


def _parts_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text if isinstance(part, TextContentPart) else part.refusal for part in content)


def _no_tool_calls(data):
    if isinstance(data, dict) and "tool_calls" in data:
        raise ValueError("only assistant messages carry tool_calls")
    return data


class _Message(Request):
    """What prompt building reads of every message: `role`, `text()`, `tool_calls` and
    `tool_call_id` (fields where the role has them, properties giving None where not)."""

    def text(self) -> str:
        return _parts_text(getattr(self, "content", None))

    def normalized(self) -> "_Message":
        return self


class _TextMessage(_Message):
    """A message whose content is text (a string or text parts), and required."""

    content: str | list[TextContentPart] | None = None  # required; None gets the message below

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        return _text_parts_only(content)

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self


class _CallFreeMessage(_Message):
    """A message that neither makes tool calls nor answers one."""

    @model_validator(mode="before")
    @classmethod
    def _no_calls(cls, data):
        return _no_tool_calls(data)

    @property
    def tool_calls(self) -> None:
        return None

    @property
    def tool_call_id(self) -> None:
        return None


class _InstructionMessage(_TextMessage, _CallFreeMessage):
    name: str | None = None  # templates render no participant names: accepted, not rendered


class SystemMessage(_InstructionMessage):
    role: Literal["system"]


class DeveloperMessage(_InstructionMessage):
    role: Literal["developer"]


class UserMessage(_InstructionMessage):
    role: Literal["user"]


class AssistantAudio(Request):
    id: str


class Annotation(Request):
    """A citation on an answer (what `message.model_dump()` sends back): ignored."""

    type: Literal["url_citation"]
    url_citation: dict


class AssistantMessageParam(_Message):
    role: Literal["assistant"]
    content: str | list[TextContentPart | RefusalContentPart] | None = None
    refusal: str | None = None
    name: str | None = None
    audio: AssistantAudio | None = None
    function_call: FunctionCall | None = None
    tool_calls: list[AnyToolCall] | None = None
    annotations: list[Annotation] | None = None
    # The openai SDK's `parse()` answer as the SDK dumps it: `parsed` is the content as the
    # client's model, which OpenAI accepts and ignores.
    parsed: Any = None

    # An earlier answer's audio is referred to by id: lockstep made none to refer to.
    _no_audio = _refused("audio", "lockstep writes no audio, so there is no earlier audio to refer to")

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        return _text_parts_only(content, also=("refusal",))

    @field_validator("tool_calls")
    @classmethod
    def _function_calls_only(cls, calls):
        if any(isinstance(call, CustomToolCall) for call in calls or []):
            raise ValueError(f"custom tool calls are not supported: {CUSTOM_TOOLS}")
        return calls

    @property
    def tool_call_id(self) -> None:
        return None

    def text(self) -> str:
        """The content, or the refusal when there is no content (what the assistant said)."""
        text = _parts_text(self.content)
        return text if text or self.refusal is None else self.refusal

    def normalized(self) -> "AssistantMessageParam":
        """A legacy `function_call` as the one tool call it is."""
        if self.function_call is None or self.tool_calls:
            return self
        call = ToolCall(id=legacy_call_id(self.function_call.name),
                        function=ReplayedFunctionCall(**self.function_call.model_dump()))
        return self.model_copy(update={"tool_calls": [call], "function_call": None})

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and self.refusal is None and not (self.tool_calls or self.function_call):
            raise ValueError("an assistant message needs content, a refusal or tool calls")
        return self


class ToolMessage(_TextMessage):
    role: Literal["tool"]
    tool_call_id: str = Field(min_length=1)
    name: str | None = None  # the called function (instructor's, litellm's tool results): not rendered

    @model_validator(mode="before")
    @classmethod
    def _no_calls(cls, data):
        if isinstance(data, dict) and not data.get("tool_call_id"):
            raise ValueError("a tool message needs tool_call_id")
        return _no_tool_calls(data)

    @property
    def tool_calls(self) -> None:
        return None


def legacy_call_id(name: str) -> str:
    """The id tying a legacy function call to its `function` message (they pair by name)."""
    return f"call_{name}"


class FunctionMessage(_CallFreeMessage):
    """A legacy function result: rendered as the tool result it is."""

    role: Literal["function"]
    content: str | None
    name: str

    def normalized(self) -> ToolMessage:
        return ToolMessage(role="tool", content=self.content or "", tool_call_id=legacy_call_id(self.name))


ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _role_of(message):
    """The message's class; None (an error naming the roles) for a missing or unknown role. A
    value that is no object at all goes to one class, whose error says it must be an object."""
    if isinstance(message, _Message):
        return message.role
    if not isinstance(message, dict):
        return "user"
    role = message.get("role")
    return role if isinstance(role, str) and role in ROLES else None


ChatMessage = Annotated[
    Union[Annotated[SystemMessage, Tag("system")], Annotated[DeveloperMessage, Tag("developer")],
          Annotated[UserMessage, Tag("user")], Annotated[AssistantMessageParam, Tag("assistant")],
          Annotated[ToolMessage, Tag("tool")], Annotated[FunctionMessage, Tag("function")]],
    Discriminator(_role_of, custom_error_type="message_role",
                  custom_error_message="each message needs a role: one of " + ", ".join(map(repr, ROLES)))]


# ----------------------------------------------------------------------------- chat

class VoiceID(Request):
    id: str


class ChatAudioOutput(Request):
    format: Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]
    voice: str | VoiceID


class Prediction(Request):
    """Predicted Outputs: the client's draft of the answer (server/engine/decoding/speculative.py)."""

    type: Literal["content"]
    content: str | list[TextContentPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        return _text_parts_only(content)

    def text(self) -> str:
        return _parts_text(self.content)


class Moderation(Request):
    model: str
    policy: dict | None = None


class PromptCacheOptions(Request):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class UserLocationApproximate(Request):
    city: str | None = None
    country: str | None = None
    region: str | None = None
    timezone: str | None = None


class UserLocation(Request):
    type: Literal["approximate"]
    approximate: UserLocationApproximate


class WebSearchOptions(Request):
    search_context_size: Literal["low", "medium", "high"] | None = None
    user_location: UserLocation | None = None


REASONING_EFFORTS = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
SERVICE_TIERS = Literal["auto", "default", "flex", "scale", "priority", "fast"]


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Deprecated function calling, normalised into tools / tool_choice (answered in its own shape).
    functions: Annotated[list[LegacyFunction], Field(min_length=1)] | None = None
    function_call: LegacyFunctionChoice | None = None
    tools: list[AnyTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    prediction: Prediction | None = None
    # Output lockstep cannot produce: refused unless off.
    modalities: list[Literal["text", "audio"]] | None = None
    audio: ChatAudioOutput | None = None
    web_search_options: WebSearchOptions | None = None
    moderation: Moderation | None = None
    # Accepted with no effect: bookkeeping, hints for models lockstep does not serve, and
    # prompt-cache settings (lockstep's prefix cache needs none).
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: SERVICE_TIERS | None = None
    reasoning_effort: REASONING_EFFORTS | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None

    _no_audio = _refused("audio", "lockstep writes text only (no audio output)")
    _no_web_search = _refused("web_search_options", "lockstep has no web search")
    _no_moderation = _refused("moderation", "lockstep runs no moderation model")

    @field_validator("modalities")
    @classmethod
    def _text_output_only(cls, modalities):
        if "audio" in (modalities or []):
            raise ValueError('modalities ["audio"] is not supported: lockstep writes text only (no audio output)')
        return modalities

    # Field validators, not a model validator: a model validator's error names no field
    # (param null). Fields are validated in declaration order, so `functions` and `tools`
    # are known when `function_call` and `tool_choice` are checked.
    @field_validator("functions")
    @classmethod
    def _unique_function_names(cls, functions):
        return _unique_names(functions, [f.name for f in functions or []])

    @field_validator("function_call")
    @classmethod
    def _function_call_names_a_function(cls, choice, info: ValidationInfo):
        named = choice.name if isinstance(choice, FunctionName) else None
        if "functions" in info.data and not info.data["functions"] and choice is not None:
            raise ValueError("function_call needs functions")
        return _choice_names_a_tool(choice, named, info, lambda f: f.name, field="functions")

    @field_validator("tools")
    @classmethod
    def _function_tools_with_unique_names(cls, tools, info: ValidationInfo):
        if any(isinstance(tool, CustomTool) for tool in tools or []):
            raise ValueError(f"custom tools are not supported: {CUSTOM_TOOLS}")
        if tools is not None and info.data.get("functions"):
            raise ValueError("send tools or the deprecated functions, not both")
        return _unique_names(tools, [t.function.name for t in tools or []])

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice, info: ValidationInfo):
        if choice is not None and info.data.get("functions"):
            raise ValueError("with the deprecated functions, choose with function_call, not tool_choice")
        if isinstance(choice, NamedCustomChoice):
            raise ValueError(f"a custom tool_choice is not supported: {CUSTOM_TOOLS}")
        if isinstance(choice, AllowedToolsChoice):
            for ref in choice.allowed_tools.tools:
                function = ref.get("function")
                if ref.get("type") != "function" or not isinstance(function, dict) or not isinstance(
                        function.get("name"), str):
                    raise ValueError('allowed_tools entries must be {"type": "function", "function": '
                                     f'{{"name": ...}}}}, got {shown(ref)}')
                _choice_names_a_tool(choice, function["name"], info, lambda tool: tool.function.name)
            return choice
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        return _choice_names_a_tool(choice, named, info, lambda tool: tool.function.name)

    @model_validator(mode="after")
    def _normalise(self):
        """One shape for prompt building, grammars and tool-call parsing (module docstring)."""
        self.messages = [m.normalized() for m in self.messages]
        if self.functions:
            self.tools = [Tool(type="function", function=FunctionDefinition(**f.model_dump(exclude_none=True)))
                          for f in self.functions]
            choice = self.function_call
            self.tool_choice = (NamedToolChoice(type="function", function=choice) if isinstance(choice, FunctionName)
                                else choice)
            self.parallel_tool_calls = False  # a legacy answer holds one function call
        if isinstance(self.tool_choice, AllowedToolsChoice):
            allowed = {ref["function"]["name"] for ref in self.tool_choice.allowed_tools.tools}
            self.tools = [t for t in self.tools if t.function.name in allowed]
            self.tool_choice = self.tool_choice.allowed_tools.mode
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

    def legacy_functions(self) -> bool:
        """Answer in the deprecated shape (`message.function_call`, finish_reason "function_call")."""
        return bool(self.functions)

    def prediction_text(self) -> str | None:
        return self.prediction.text() if self.prediction is not None else None


TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    # A string, one string in a list, token ids, or one list of token ids.
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1, max_length=1)
    ]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt):
        # A list of strings or of token lists is a batch of prompts; lockstep takes one.
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(x, (str, list)) for x in prompt):
            raise ValueError(f"one prompt per request is supported, got {len(prompt)}")
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

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of, info: ValidationInfo):
        # best_of > n ranks candidates by log probability server-side and returns the best n;
        # lockstep returns every choice it generates, so only best_of == n (the default) is met.
        n = info.data.get("n", 1)
        if best_of is not None and best_of != n:
            raise ValueError(f"best_of is supported only equal to n ({n}): lockstep returns every choice "
                             "it generates")
        return best_of

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return self.logprobs


# ----------------------------------------------------------------------------- responses

FinishReason = Literal["stop", "length", "tool_calls", "function_call"]


class Response(BaseModel):
    pass


class CompletionTokensDetails(Response):
    """As OpenAI reports them: prediction tokens accepted and rejected by verification (docs/API.md)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    reasoning_tokens: int = 0  # no reasoning models are served
    audio_tokens: int = 0


class PromptTokensDetails(Response):
    """As OpenAI reports them: prompt tokens whose KV came from the prefix cache."""

    cached_tokens: int = 0
    audio_tokens: int = 0


class Usage(Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(default=None, exclude_if=_omit_if_none)
    completion_tokens_details: CompletionTokensDetails | None = Field(default=None, exclude_if=_omit_if_none)


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
    refusal: str | None = None  # lockstep's models never refuse through this field
    tool_calls: list[ResponseToolCall] | None = Field(default=None, exclude_if=_omit_if_none)
    function_call: ResponseFunctionCall | None = Field(default=None, exclude_if=_omit_if_none)  # legacy functions


class ChatChoice(Response):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None
    lockstep: dict | None = Field(default=None, exclude_if=_omit_if_none)  # the choice's receipt


class ToolCallDelta(Response):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatDelta(Response):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_omit_if_none)
    content: str | None = Field(default=None, exclude_if=_omit_if_none)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_omit_if_none)
    function_call: ResponseFunctionCall | None = Field(default=None, exclude_if=_omit_if_none)


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
    lockstep: dict | None = Field(default=None, exclude_if=_omit_if_none)  # the choice's receipt


class _Completion(Response):
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
