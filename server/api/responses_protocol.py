"""Pydantic models for /v1/responses: the request, the `Response` object and its stream events.

lockstep keeps no state between requests, so only the stateless subset of the Responses
API is accepted: the whole conversation comes in `input` (messages, earlier function calls
and their outputs), and fields that need stored responses or hosted tools
(`previous_response_id`, `store: true`, `background: true`, non-function tools, `include`)
are rejected with the field named as `param`, as are unknown fields (`Request` base).
The sampling extensions of /v1/chat/completions (`seed`, `deterministic`, `speculative`,
`num_draft_tokens`) are accepted here too. server/api/responses.py turns a request into a
chat request and renders the result.
"""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from lockstep.server.api.response_bodies import ResponseBody
from lockstep.server.api.sampling_protocol import (SEED_MAX, SEED_MIN, Request, _omit_if_none, shown,
                                                   unicode_checked)
from lockstep.server.api.tools_protocol import FUNCTION_NAME, _choice_names_a_tool, _unique_names

ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    """OpenAI-style ids: "resp_...", "msg_...", "fc_...", "call_..."."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ----------------------------------------------------------------------------- input items

class InputText(Request):
    type: Literal["input_text"]
    text: str


class OutputText(Request):
    """An earlier assistant answer sent back as input (as a client gets it in `output`)."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict] = []
    logprobs: list[dict] | None = None


class Refusal(Request):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]
TEXT_PARTS = ("input_text", "output_text", "refusal")


def _text_of(part: InputText | OutputText | Refusal) -> str:
    return part.refusal if isinstance(part, Refusal) else part.text


def _text_parts_only(content):
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS:
                raise ValueError(f"only text content parts are supported (got type {shown(kind)})")
    return content


class InputMessage(Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    # Output messages sent back as input carry these; they change nothing.
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    _content_parts = field_validator("content", mode="before")(_text_parts_only)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(_text_of(p) for p in self.content)


class FunctionCallInput(Request):
    """A call the model made earlier (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputInput(Request):
    """The caller's result for the call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)  # the chat tool message it becomes needs one
    output: str | Annotated[list[InputText], Field(min_length=1)]
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


InputItem = Annotated[InputMessage | FunctionCallInput | FunctionCallOutputInput, Field(discriminator="type")]
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output")


# ----------------------------------------------------------------------------- tools, text

class FunctionTool(Request):
    """Responses' function tool is flat: {type, name, parameters, ...}, not {type, function}."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolChoiceFunction(Request):
    type: Literal["function"]
    name: str


class FormatText(Request):
    type: Literal["text"]


class FormatJSONObject(Request):
    type: Literal["json_object"]


class FormatJSONSchema(Request):
    type: Literal["json_schema"]
    name: str = Field(pattern=FUNCTION_NAME)
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[FormatText | FormatJSONObject | FormatJSONSchema, Field(discriminator="type")]


class TextConfig(Request):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the default; other levels are not honoured

    @field_validator("verbosity", mode="before")
    @classmethod
    def _default_verbosity_only(cls, verbosity):
        if verbosity not in (None, "medium"):
            raise ValueError(f"verbosity {shown(verbosity)} is not supported (only 'medium')")
        return verbosity


class StreamOptions(Request):
    include_obfuscation: bool = False

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, value: bool) -> bool:
        if value:
            raise ValueError("include_obfuscation is not supported")
        return value


# ----------------------------------------------------------------------------- request

def _rejected(field: str, why: str):
    """A validator for a field accepted only when absent, null or false."""
    def check(cls, value):
        if value not in (None, False, []):
            raise ValueError(f"{field}={json.dumps(value)} is not supported: {why}")
        return value

    return field_validator(field, mode="before")(classmethod(check))


STATELESS = "lockstep stores no responses; send the whole conversation in `input`"


class ResponsesRequest(Request):
    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    # Accepted only off: each needs state, hosted tools or output lockstep does not produce.
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    include: list[str] | None = None
    reasoning: dict | None = None
    # lockstep extensions, as on /v1/chat/completions.
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    deterministic: bool = False
    speculative: Literal["none", "draft", "prompt_lookup"] | None = None
    num_draft_tokens: int | None = Field(default=None, ge=1)

    _no_store = _rejected("store", STATELESS)
    _no_background = _rejected("background", STATELESS)
    _no_previous = _rejected("previous_response_id", STATELESS)
    _no_conversation = _rejected("conversation", STATELESS)
    _no_include = _rejected("include", "no extra output data can be included")
    _no_reasoning = _rejected("reasoning", "lockstep serves no reasoning models")
    _valid_unicode = unicode_checked()

    @field_validator("input", mode="before")
    @classmethod
    def _known_item_types(cls, items):
        # Said here: the union would report only its first branch ("input.str").
        if isinstance(items, str):
            return items
        if not isinstance(items, list) or not items:
            raise ValueError("input must be a string or a non-empty list of input items "
                             f"({', '.join(INPUT_ITEM_TYPES)})")
        typed = []
        for item in items:
            if isinstance(item, dict) and "type" not in item and "role" in item:
                item = {**item, "type": "message"}  # EasyInputMessage: `type` is optional
            if not isinstance(item, dict):
                raise ValueError(f"input items must be objects, got {shown(item)}")
            kind = item.get("type")
            if kind not in INPUT_ITEM_TYPES:
                raise ValueError(f"input items of type {shown(kind)} are not supported "
                                 f"(only {', '.join(INPUT_ITEM_TYPES)})")
            if kind == "message":
                _text_parts_only(item.get("content"))
            typed.append(item)
        return typed

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools):
        for tool in tools or []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"only function tools are supported (got type {shown(kind)})")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, choice):
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise ValueError(f"tool_choice of type {shown(choice.get('type'))} is not supported "
                             "(only 'none', 'auto', 'required' or a function)")
        return choice

    # Field validators, as on chat, so the errors name their field; `tools` is declared first.
    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools):
        return _unique_names(tools, [t.name for t in tools or []])

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice, info: ValidationInfo):
        named = choice.name if isinstance(choice, ToolChoiceFunction) else None
        return _choice_names_a_tool(choice, named, info, lambda tool: tool.name)


# ----------------------------------------------------------------------------- response

class OutputTextPart(ResponseBody):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list = []
    logprobs: list = []


class OutputMessage(ResponseBody):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputTextPart] = []


class FunctionCallItem(ResponseBody):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus = "completed"


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(ResponseBody):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(ResponseBody):
    reasoning_tokens: int = 0  # no reasoning models are served


class ResponseUsage(ResponseBody):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class IncompleteDetails(ResponseBody):
    reason: Literal["max_output_tokens"]


class ResponseError(ResponseBody):
    code: str
    message: str


class ResponseObject(ResponseBody):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    # The request's settings, echoed as OpenAI does.
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    parallel_tool_calls: bool
    tool_choice: str | dict
    tools: list[dict]
    text: dict
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = {}
    user: str | None = None
    store: bool = False
    background: bool = False
    previous_response_id: None = None
    reasoning: None = None
    # lockstep extension (determinism or speculative-decoding statistics), as on chat.
    lockstep: dict | None = Field(default=None, exclude_if=_omit_if_none)


# ----------------------------------------------------------------------------- stream events

class StreamEvent(ResponseBody):
    type: str
    sequence_number: int = 0  # numbered as the stream sends them


class ResponseEvent(StreamEvent):
    """response.created / in_progress / completed / incomplete / failed."""

    response: ResponseObject


class OutputItemEvent(StreamEvent):
    """response.output_item.added / done."""

    output_index: int
    item: OutputItem


class ContentPartEvent(StreamEvent):
    """response.content_part.added / done."""

    item_id: str
    output_index: int
    content_index: int
    part: OutputTextPart


class TextDeltaEvent(StreamEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list = []


class TextDoneEvent(StreamEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list = []


class ArgumentsDeltaEvent(StreamEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(StreamEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str
