"""Tools, tool choices, the tool calls a request replays, and response formats: the request
fields that constrain what the model may write (their grammars: server/api/constraints.py)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, ValidationInfo

from lockstep.server.api.sampling_protocol import Request, shown


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
