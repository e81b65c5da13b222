"""Tool-call formats of the families people serve (issue 31, items 4 and 5): Hermes/Qwen
`<tool_call>`, Llama 3.x JSON, Mistral `[TOOL_CALLS]`, gpt-oss harmony.

Each family is a tiny random llama with that family's tokenizer config: its published chat
template (tests/chat_templates/, unmodified), special tokens and eos tokens
(tests/synthetic.py `CHAT_FAMILIES`). What the model writes for a call is taken from the
family's own template (the assistant turn it renders for that call), so parsing is checked
against the format the model is trained on; constrained calls run on the real engine.
"""
import contextlib
import json
from types import SimpleNamespace

import jsonschema
import pytest
from openai import OpenAI

from lockstep.models.load import load_model
from lockstep.server.api.chat_protocol import ChatCompletionRequest
from lockstep.server.api.app import create_app
from lockstep.server.api.constraints import Constraints
from lockstep.server.api.errors import APIError
from lockstep.server.api.tool_call_stream import call_stream, split_tool_calls
from lockstep.server.api.tool_calls import mistral_call_id, tool_format
from lockstep.server.engine import Engine
from lockstep.server.engine.generate import Delta
from lockstep.server.engine.structured.grammar import compiler_for
from tests.doubles.scripted_engine import ScriptedEngine
from tests.http_server import running
from tests.synthetic import CHAT_FAMILIES, build_chat_model_dir

FORMATS = {"qwen2.5": "json_tools", "llama3.2": "llama3_json", "mistral-nemo": "mistral", "gpt-oss": "gpt_oss"}
# Llama's and gpt-oss's templates render one call per assistant turn
SEVERAL = {"qwen2.5": True, "llama3.2": False, "mistral-nemo": True, "gpt-oss": False}
# what each family's turn ends with: an eos token (never output text) or gpt-oss's <|call|> (a stop)
TURN_END = {"qwen2.5": "<|im_end|>\n", "llama3.2": "<|eot_id|>", "mistral-nemo": "</s>", "gpt-oss": "<|call|>"}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {  # no description: gpt-oss's template needs one filled in
    "name": "add",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["a"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
NAMES = {"get_weather", "add"}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALLS = [("get_weather", {"city": "Paris"}), ("add", {"a": 3})]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {family: load_model(str(build_chat_model_dir(tmp_path_factory.mktemp(family), family)))
            for family in CHAT_FAMILIES}


def model_turn(loaded, family: str, calls) -> str:
    """The text `family`'s model writes for `calls`: its template's assistant turn holding them,
    after the generation prompt, less the end of the turn."""
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call{i:05d}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for i, (name, arguments) in enumerate(calls)]}]
    template = loaded.tokenizer.apply_chat_template
    tools = [{**t, "function": {"description": "", **t["function"]}} for t in TOOLS]  # as lockstep sends them
    prompt = template(ASK, tools=tools, add_generation_prompt=True, tokenize=False)
    whole = template(ASK + history, tools=tools, tokenize=False)
    assert whole.startswith(prompt) and whole.endswith(TURN_END[family])
    return whole[len(prompt):len(whole) - len(TURN_END[family])]


def family_calls(family: str):
    return CALLS if SEVERAL[family] else CALLS[:1]


def pieces(stream, text: str, size: int):
    content, calls = "", []
    for i in range(0, len(text), size):
        more, new = stream.add(text[i:i + size])
        content, calls = content + more, calls + new
    rest, last = stream.finish()
    return content + rest, calls + last


def as_pairs(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


# ------------------------------------------------------------------- the format of each family

@pytest.mark.parametrize("family", FORMATS)
def test_the_call_format_is_read_from_the_family_template(models, family):
    fmt = tool_format(models[family].tokenizer)
    assert (fmt.name, fmt.native, fmt.json_calls) == (FORMATS[family], True, True)


@pytest.mark.parametrize("family", FORMATS)
def test_the_models_own_calls_are_parsed_whole_and_streamed(models, family):
    fmt = tool_format(models[family].tokenizer)
    text = model_turn(models[family], family, family_calls(family))
    content, calls = split_tool_calls(text, fmt, NAMES)
    assert content == "" and as_pairs(calls) == family_calls(family)
    for size in (1, 3):
        content, calls = pieces(call_stream(fmt, NAMES), text, size)
        assert content == "" and as_pairs(calls) == family_calls(family)
    assert split_tool_calls(text, fmt, {"other"}) in (("", []), (text, []))  # no call of an unknown tool


@pytest.mark.parametrize("family", FORMATS)
def test_a_cut_off_call_of_every_family_is_dropped(models, family):
    """Item 4 in every format: whatever the cut, the partial call is neither content nor a call."""
    fmt = tool_format(models[family].tokenizer)
    text = model_turn(models[family], family, family_calls(family))
    last_call = text.rfind(family_calls(family)[-1][0])  # inside the last call
    for cut in range(1, len(text), 7):
        for size in (1, 5):
            content, calls = pieces(call_stream(fmt, NAMES), text[:cut], size)
            assert content == "", (cut, content)
            complete = as_pairs(calls)
            assert complete == family_calls(family)[:len(complete)]
            if cut < last_call:
                assert len(complete) < len(family_calls(family))


# ------------------------------------------------------------------------------- over HTTP

class Script:
    """What the scripted engine writes next: `text` in pieces of 3 characters, then `finish`."""

    def __init__(self):
        self.text, self.finish, self.requests = "", "stop", []

    def __call__(self, loaded, request, **_):
        self.requests.append(request)
        n = len(request.prompt_tokens)
        chunks = [self.text[i:i + 3] for i in range(0, len(self.text), 3)] or [""]
        for k, chunk in enumerate(chunks):
            yield Delta(text=chunk, prompt_tokens=n, completion_tokens=k + 1,
                        finish_reason=self.finish if k == len(chunks) - 1 else None)


@pytest.fixture(scope="module")
def scripted(models):
    """family -> (openai client, Script): the API over a scripted engine for each family."""
    served = {}
    with contextlib.ExitStack() as stack:
        for family, loaded in models.items():
            script = Script()
            engine = ScriptedEngine(loaded, script).start()
            stack.callback(engine.stop)
            url = stack.enter_context(running(create_app(engine)))
            served[family] = SimpleNamespace(
                client=OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60), script=script)
        yield served


def chat(client, **kwargs):
    kwargs.setdefault("max_tokens", 200)
    return client.chat.completions.create(model="default", messages=kwargs.pop("messages", ASK), tools=TOOLS,
                                          **kwargs)


def streamed(client, **kwargs):
    content, calls, finish = "", [], None
    for chunk in chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("family", FORMATS)
def test_the_models_own_calls_reach_the_client_streamed_and_not(models, scripted, family):
    served = scripted[family]
    served.script.text, served.script.finish = model_turn(models[family], family, family_calls(family)), "stop"
    whole = chat(served.client).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == \
        family_calls(family)
    content, calls, finish = streamed(served.client)
    assert (content, finish) == ("", "tool_calls")
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(i, name, arguments) for i, (name, arguments) in enumerate(family_calls(family))]
    # gpt-oss's <|call|> ends a turn with tools (its config has no eos for it); no other format stops early
    assert served.script.requests[-1].stop == (("<|call|>",) if family == "gpt-oss" else ())


@pytest.mark.parametrize("only_call", [False, True])
@pytest.mark.parametrize("family", FORMATS)
def test_a_call_cut_off_by_max_tokens_never_reaches_content(models, scripted, family, only_call):
    """Issue 31, item 4 over HTTP, streamed and not: complete calls kept, the cut one dropped,
    finish_reason "length", no markup in content, which is null (issue 49, 14b: it was ""
    where the cut call was the only one)."""
    served = scripted[family]
    made = CALLS[:1] if only_call else family_calls(family)
    text = model_turn(models[family], family, made)
    cut = text[:text.rfind(made[-1][0]) + 4]  # inside the last call's name
    served.script.text, served.script.finish = cut, "length"
    kept = made[:-1]
    whole = chat(served.client, tool_choice="required").choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []] == kept
    content, calls, finish = streamed(served.client, tool_choice="required")
    assert (content, finish) == ("", "length")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == kept


@pytest.mark.parametrize("family", FORMATS)
def test_a_call_and_its_result_go_back_through_the_family_template(models, scripted, family):
    """History with lockstep's own call ids renders through each published template: Mistral's
    takes only 9-character ids (mapped, the same for the call and its result)."""
    served = scripted[family]
    served.script.text, served.script.finish = "It is sunny.", "stop"
    call_id = "call_0123456789abcdef01234567"
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "18 C"}]
    answer = chat(served.client, messages=history).choices[0]
    assert answer.message.content == "It is sunny." and answer.finish_reason == "stop"
    prompt = models[family].tokenizer.decode(served.script.requests[-1].prompt_tokens)
    rendered_call = model_turn(models[family], family, CALLS[:1])
    if family == "mistral-nemo":
        rendered_call = rendered_call.replace('"call00000"', f'"{mistral_call_id(call_id)}"')
        assert f'"call_id": "{mistral_call_id(call_id)}"}}[/TOOL_RESULTS]' in prompt
    assert rendered_call in prompt and "18 C" in prompt


def test_gpt_oss_content_is_its_final_channel_only(models, scripted):
    """Harmony's analysis channel is the model's reasoning, not content; no channel markup
    reaches content, with tools or without."""
    served = scripted["gpt-oss"]
    served.script.finish = "stop"
    served.script.text = ("<|channel|>analysis<|message|>The user wants weather.<|end|>"
                          "<|start|>assistant<|channel|>final<|message|>Sunny in Paris.")
    for tools in (TOOLS, None):
        kwargs = {"tools": tools} if tools else {}
        answer = served.client.chat.completions.create(model="default", messages=ASK, max_tokens=50, **kwargs)
        assert answer.choices[0].message.content == "Sunny in Paris."
    text = ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|><|start|>functions')
    fmt = tool_format(models["gpt-oss"].tokenizer)
    for size in (1, 4):
        content, calls = pieces(call_stream(fmt, NAMES), text, size)
        assert content == "" and as_pairs(calls) == [("get_weather", {"city": "Oslo"})]
    assert split_tool_calls("Just text.", fmt, NAMES) == ("Just text.", [])  # not harmony: all content


def test_llama_json_that_is_no_call_stays_content_and_is_not_held(models):
    fmt = tool_format(models["llama3.2"].tokenizer)
    stream = call_stream(fmt, NAMES)
    assert stream.add('{"na') == ("", [])  # could still open a call
    assert stream.add('mes": [1]}') == ('{"names": [1]}', [])  # known not to: sent at once
    assert split_tool_calls('{"answer": 42}', fmt, NAMES) == ('{"answer": 42}', [])
    person = '{"name": "Bob", "age": 3}'  # looks like a call until its end: whole, so content
    assert split_tool_calls(person, fmt, NAMES) == (person, [])
    assert split_tool_calls(person[:-3], fmt, NAMES) == ("", [])  # cut off: dropped
    two = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}'
    assert as_pairs(split_tool_calls(two, fmt, NAMES)[1]) == [("add", {"a": 1}), ("add", {"a": 2})]


# --------------------------------------------------------------------- constrained decoding

def grammar_for(loaded, fmt, name=None, parallel=True):
    start, end = fmt.grammar_tags()
    return compiler_for(loaded).tool_calls(TOOLS, start=start, end=end, name=name,
                                           parallel=parallel and fmt.max_calls != 1,
                                           layout=fmt.grammar_layout()).matcher()


def walk(loaded, matcher, text: str) -> None:
    for token in loaded.tokenizer.encode(text, add_special_tokens=False):
        assert matcher.allowed()[token].item(), (text, loaded.tokenizer.decode([token]))
        matcher.consume(token)


@pytest.mark.parametrize("family, written", [
    ("qwen2.5", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>'),
    ("llama3.2", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("mistral-nemo", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                     '{"name": "add", "arguments": {"a": 3}}]'),
    ("gpt-oss", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'),
])
def test_the_grammar_writes_the_family_calls_and_the_parser_reads_them(models, family, written):
    loaded = models[family]
    fmt = tool_format(loaded.tokenizer)
    matcher = grammar_for(loaded, fmt)
    walk(loaded, matcher, written)
    eos = sorted(loaded.eos_token_ids)
    assert all(matcher.allowed()[t].item() for t in eos)  # it may end here
    if not SEVERAL[family]:
        assert matcher.finished  # one call per turn in this format: nothing may follow
    assert split_tool_calls(written, fmt, NAMES)[1] and split_tool_calls(written, fmt, NAMES)[0] == ""


@pytest.mark.parametrize("family", FORMATS)
def test_a_forced_call_is_written_in_the_family_format(models, family):
    """tool_choice "required" on the real engine: the tiny random model writes a valid call in
    its family's own format (seen through the logprobs' tokens), parsed back into tool_calls."""
    engine = Engine(models[family], max_active=2).start()
    try:
        with running(create_app(engine)) as url:
            client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
            choice = chat(client, tool_choice="required", temperature=0, logprobs=True, max_tokens=90,
                          parallel_tool_calls=False).choices[0]
    finally:
        engine.stop()
    raw = "".join(t.token for t in choice.logprobs.content)
    opening = {"qwen2.5": '<tool_call>\n{"name": "', "llama3.2": '{"name": "',
               "mistral-nemo": '[TOOL_CALLS][{"name": "', "gpt-oss": "<|channel|>commentary to=functions."}[family]
    assert raw.startswith(opening), raw
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_mistral_name_args_calls_use_mlx_lms_parser_and_the_grammar_writes_them(models):
    """Newer Mistral templates write `[TOOL_CALLS]name[ARGS]{...}` (mlx-lm's parser reads both)."""
    from mlx_lm.tool_parsers import mistral

    tokenizer = SimpleNamespace(chat_template="{{ tools }}[TOOL_CALLS]{{ name }}[ARGS]", has_tool_calling=True,
                                tool_parser=mistral.parse_tool_call, tool_call_start="[TOOL_CALLS]",
                                tool_call_end="")
    fmt = tool_format(tokenizer)
    assert (fmt.name, fmt.header_calls, fmt.json_calls) == ("mistral", True, True)
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 3}'
    assert pieces(call_stream(fmt, NAMES), text, 2) == ("", split_tool_calls(text, fmt, NAMES)[1])
    assert as_pairs(split_tool_calls(text, fmt, NAMES)[1]) == CALLS
    assert split_tool_calls(text[:-4], fmt, NAMES)[0] == ""  # cut off: dropped
    matcher = grammar_for(models["mistral-nemo"], fmt)  # Nemo's vocabulary spells [ARGS] as text
    walk(models["mistral-nemo"], matcher, text)


def test_a_format_the_grammar_cannot_write_is_a_400_and_parsed_by_mlx_lm(models):
    """Qwen3-Coder's XML calls (mlx-lm's qwen3_coder parser): parsed, but not constrainable."""
    from mlx_lm.tool_parsers import qwen3_coder

    tokenizer = SimpleNamespace(chat_template="{{ tools }}<tool_call>\n<function=", has_tool_calling=True,
                                tool_parser=qwen3_coder.parse_tool_call, tool_call_start="<tool_call>",
                                tool_call_end="</tool_call>")
    fmt = tool_format(tokenizer)
    assert (fmt.name, fmt.json_calls) == ("qwen3_coder", False)
    text = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "</function>\n</tool_call>")
    assert as_pairs(split_tool_calls(text, fmt, NAMES)[1]) == [("get_weather", {"city": "Oslo"})]
    assert split_tool_calls(text, fmt, NAMES)[0] == "Checking.\n"
    constraints = Constraints(models["qwen2.5"], fmt)
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        body = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, "tools": TOOLS,
                                                     "tool_choice": choice})
        with pytest.raises(APIError) as err:
            constraints.grammar_for(body)
        assert err.value.status == 400 and err.value.body.param == "tool_choice"
        assert "qwen3_coder" in err.value.body.message


def test_a_template_without_tools_gets_the_fallback_whatever_mlx_lm_infers():
    """The fallback prompt asks for <tool_call> JSON, so calls are parsed as that."""
    from mlx_lm.tool_parsers import pythonic

    tokenizer = SimpleNamespace(chat_template="{{ messages }}", has_tool_calling=True,
                                tool_parser=pythonic.parse_tool_call, tool_call_start="<|tool_call_start|>",
                                tool_call_end="<|tool_call_end|>")
    fmt = tool_format(tokenizer)
    assert (fmt.name, fmt.start, fmt.native) == ("fallback", "<tool_call>", False)

