"""/v1/chat/completions' request: its messages and `ChatCompletionRequest`.

Messages are one class per role (a union on `role`), so a field another role has is still
unknown on this one. Legacy shapes are normalised after validation, so prompt building
sees one shape: `functions` / `function_call` become `tools` / `tool_choice`, a `function`
message a tool result, an assistant `function_call` a tool call, and an `allowed_tools`
tool_choice the subset of tools it allows. The `lockstep` request fields and the `lockstep`
response object are this server's extensions. /v1/responses has its models in
server/api/responses_protocol.py.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from lockstep.server.api.sampling_protocol import (MAX_TOP_LOGPROBS, Metadata, Request, SamplingRequest, _refused,
                                                   shown)
from lockstep.server.api.tools_protocol import (AllowedToolsChoice, AnyTool, AnyToolCall, CUSTOM_TOOLS, CustomTool,
                                                CustomToolCall, FunctionCall, FunctionDefinition, FunctionName,
                                                LegacyFunction, LegacyFunctionChoice, NamedCustomChoice,
                                                NamedToolChoice, ReplayedFunctionCall, ResponseFormat, Tool,
                                                ToolCall, ToolChoice, _choice_names_a_tool, _unique_names)


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


class VoiceID(Request):
    id: str


class ChatAudioOutput(Request):
    format: Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]
    voice: str | VoiceID


class Prediction(Request):
    """Predicted Outputs: the client's draft of the answer (server/engine/decoding/drafters.py)."""

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
