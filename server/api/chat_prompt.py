"""A chat request's messages (and tools) as prompt tokens, through the model's chat template.

Chat templates know system/user/assistant; "developer" is OpenAI's newer "system". Tools
go to templates that render them (`tools=`); for the others lockstep describes them in the
system prompt and renders earlier calls and tool results in the same fallback format the
model is asked to answer in (server/api/tool_calls.py). Earlier calls go to a template with
their arguments as an object (templates write them with `tojson`); Mistral's templates take
only 9-character call ids, so other ids reach them mapped (`mistral_call_id`).
"""
from __future__ import annotations

import json

from lockstep.server.api.chat_protocol import ChatCompletionRequest, ChatMessage

from lockstep.server.api.tools_protocol import ToolCall
from lockstep.server.api.tool_calls import ToolFormat, fallback_system_prompt, mistral_call_id


def _tool_dicts(body: ChatCompletionRequest, fmt: ToolFormat | None = None) -> list[dict]:
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    if fmt is not None and fmt.name == "gpt_oss":  # its template writes "// " + description unguarded
        for tool in tools:
            tool["function"].setdefault("description", "")
    return tools


def _call_json(call: ToolCall) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments  # passed on as the client sent it
    return {"name": call.function.name, "arguments": arguments}


def _native_message(m: ChatMessage, fmt: ToolFormat) -> dict:
    call_id = mistral_call_id if fmt.name == "mistral" else str
    message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        message["tool_calls"] = [{"id": call_id(c.id), "type": "function", "function": _call_json(c)}
                                 for c in m.tool_calls]
    if m.tool_call_id:
        message["tool_call_id"] = call_id(m.tool_call_id)
    return message


def _fallback_message(m: ChatMessage, fmt: ToolFormat) -> dict:
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
    content = m.text()
    for call in m.tool_calls or []:
        content += f"{fmt.start}\n{json.dumps(_call_json(call), ensure_ascii=False)}\n{fmt.end}"
    return {"role": "system" if m.role == "developer" else m.role, "content": content}


def template_messages(body: ChatCompletionRequest, fmt: ToolFormat) -> tuple[list[dict], dict]:
    """(messages, extra keyword arguments) for `apply_chat_template`."""
    offered = body.tool_mode() != "none"
    if fmt.native:
        kwargs = {"tools": _tool_dicts(body, fmt)} if offered else {}
        return [_native_message(m, fmt) for m in body.messages], kwargs
    messages = [_fallback_message(m, fmt) for m in body.messages]
    if offered:
        instructions = fallback_system_prompt(_tool_dicts(body))
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + instructions}
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    return messages, {}


def chat_prompt_tokens(tokenizer, body: ChatCompletionRequest, fmt: ToolFormat) -> list[int]:
    messages, kwargs = template_messages(body, fmt)
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs))
