"""Tool calls: the fallback prompt, and model output text back into OpenAI tool_calls."""
import json

import pytest

from lockstep.server.api.chat_protocol import ChatCompletionRequest
from lockstep.server.api.chat_prompt import template_messages
from lockstep.server.api.tool_call_stream import ToolCallStream, split_tool_calls
from lockstep.server.api.tool_calls import FALLBACK_END, FALLBACK_START, tool_format

FMT = tool_format(object())  # no template, no parser: the fallback format
NAMES = {"get_weather", "add"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_model_without_tool_support_gets_the_fallback_tags():
    assert (FMT.start, FMT.end, FMT.native, FMT.json_calls) == (FALLBACK_START, FALLBACK_END, False, True)


def test_calls_are_split_from_content():
    content, calls = split_tool_calls("Let me check. " + CALL, FMT, NAMES)
    assert content == "Let me check. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_two_calls_and_string_arguments():
    text = CALL + '\n<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    _, calls = split_tool_calls(text, FMT, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]


@pytest.mark.parametrize("body", ['{"name": "rm_rf", "arguments": {}}', "not json", '["a"]',
                                  '{"name": "add", "arguments": 3}'])
def test_a_tagged_body_that_is_no_valid_call_stays_content(body):
    text = f"<tool_call>{body}</tool_call>"
    assert split_tool_calls(text, FMT, NAMES) == (text, [])


def test_an_unterminated_call_counts_when_its_json_is_complete():
    _, calls = split_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 2}}', FMT, NAMES)
    assert [c.name for c in calls] == ["add"]
    _, calls = split_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_', FMT, NAMES)
    assert [c.name for c in calls] == ["add"]  # cut off inside the end tag


def _split_in_pieces(text: str, size: int, max_calls=None):
    """`text` through a ToolCallStream in pieces of `size` characters (0: whole), as streamed."""
    if not size:
        return split_tool_calls(text, FMT, NAMES | {"get_time"}, max_calls)
    stream, content, calls = ToolCallStream(FMT, NAMES | {"get_time"}, max_calls), "", []
    for i in range(0, len(text), size):
        more, new = stream.add(text[i:i + size])
        content, calls = content + more, calls + new
    rest, last = stream.finish()
    return content + rest, calls + last


@pytest.mark.parametrize("size", [0, 1, 4])
@pytest.mark.parametrize("text, content, names", [
    # issue 31, item 4: tool_choice "required", the only call cut off by max_tokens
    ('<tool_call>\n{"name": "get_time", "arguments', "", []),
    # parallel calls: the second cut off inside its JSON, or inside its start tag
    (CALL + '\n<tool_call>\n{"name": "get_time", "arguments', "", ["get_weather"]),
    (CALL + "\n<tool_", "", ["get_weather"]),
    ("Let me check. <tool_ca", "Let me check. ", []),
])
def test_a_call_cut_off_by_max_tokens_leaks_no_markup_into_content(size, text, content, names):
    """Issue 31, item 4: the cut-off call's text went into `content` beside the valid calls.
    It is dropped now: neither a call nor content (docs/API.md, Tools: cut-off calls)."""
    got_content, calls = _split_in_pieces(text, size)
    assert got_content == content and "<tool" not in got_content
    assert [c.name for c in calls] == names


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streamed_pieces_give_the_same_split_and_never_leak_a_tag(size):
    text = "Sure <tool" + "x> then " + CALL + " done"
    stream = ToolCallStream(FMT, NAMES)
    sent, calls = "", []
    for i in range(0, len(text), size):
        content, new = stream.add(text[i:i + size])
        assert "<tool_call>" not in content
        sent, calls = sent + content, calls + new
    rest, more = stream.finish()
    assert (sent + rest, calls + more) == split_tool_calls(text, FMT, NAMES)
    assert sent + rest == "Sure <toolx> then  done"


def _chat(messages, **extra):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **extra})


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_fallback_prompt_lists_tools_and_renders_history_in_the_call_format():
    body = _chat([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ], tools=TOOLS)
    messages, kwargs = template_messages(body, FMT)
    assert kwargs == {}
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert '"get_weather"' in messages[0]["content"] and "<tools>" in messages[0]["content"]
    assert split_tool_calls(messages[2]["content"], FMT, NAMES)[1][0].name == "get_weather"
    assert messages[3] == {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}


def test_tool_choice_none_leaves_tools_out_of_the_prompt():
    messages, _ = template_messages(_chat([{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="none"), FMT)
    assert messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("message, error", [
    ({"role": "tool", "content": "x"}, "tool_call_id"),
    ({"role": "user", "content": None}, "needs content"),
    ({"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "only assistant"),
])
def test_malformed_tool_history_is_refused(message, error):
    with pytest.raises(ValueError, match=error):
        _chat([message])


def test_tool_choice_must_name_an_offered_tool():
    with pytest.raises(ValueError, match="not in tools"):
        _chat([{"role": "user", "content": "x"}], tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "other"}})
    with pytest.raises(ValueError, match="needs tools"):
        _chat([{"role": "user", "content": "x"}], tool_choice="required")


def test_whitespace_between_calls_is_not_content():
    content, calls = split_tool_calls(CALL + "\n\n" + CALL + "\n", FMT, NAMES)
    assert content == "" and len(calls) == 2
    content, _ = split_tool_calls(CALL + "\n\nDone.", FMT, NAMES)
    assert content == "\n\nDone."


@pytest.mark.parametrize("size", [0, 1, 5])
def test_an_end_tag_inside_an_argument_string_does_not_end_the_call(size):
    """Issue 25, finding 2: a call's JSON may hold the tags as text; cutting at the first end
    tag lost the call (and tool_choice "required" answered none)."""
    arguments = {"city": 'say "</tool_call>" then <tool_call>', "note": "\\</tool_call>"}
    text = "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": arguments}) + "\n</tool_call> after"
    if size:
        stream, content, calls = ToolCallStream(FMT, NAMES), "", []
        for i in range(0, len(text), size):
            more, new = stream.add(text[i:i + size])
            content, calls = content + more, calls + new
        rest, last = stream.finish()
        content, calls = content + rest, calls + last
    else:
        content, calls = split_tool_calls(text, FMT, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", arguments)]
    assert content == " after"
