"""The grammar layer (server/engine/structured/grammar.py) on the embedded model's tokenizer and weights."""
import json
import threading

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from lockstep.server.engine.structured.grammar import GrammarCompiler, GrammarError
from lockstep.server.engine.decoding.logits_processors import apply_mask

START, END = "<tool_call>\n", "\n</tool_call>"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                       "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
        "required": ["a", "b"], "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def model(embedded_model):
    return embedded_model


@pytest.fixture(scope="module")
def compiler(model):
    return GrammarCompiler(model.tokenizer, model.model.args.vocab_size, model.eos_token_ids)


def encode(model, text: str) -> list[int]:
    return model.tokenizer._tokenizer.encode(text, add_special_tokens=False)


def allowed_ids(matcher) -> set[int]:
    return set(np.nonzero(np.array(matcher.allowed()))[0].tolist())


def walk(model, matcher, text: str) -> None:
    for token in encode(model, text):
        mask = matcher.allowed()
        assert mask.dtype == mx.bool_ and mask.shape == (model.model.args.vocab_size,)
        assert mask[token].item(), f"token {token} ({model.tokenizer.decode([token])!r}) masked out in {text!r}"
        matcher.consume(token)


def test_valid_instance_walks_to_finished(model, compiler):
    matcher = compiler.json_schema(PERSON).matcher()
    assert not allowed_ids(matcher) & model.eos_token_ids  # nothing generated yet: cannot end
    walk(model, matcher, '{"name": "Ada", "age": 36, "color": "blue"}')
    assert matcher.finished
    assert allowed_ids(matcher) == model.eos_token_ids  # can only end now
    matcher.consume(min(model.eos_token_ids))
    assert matcher.finished


def test_breaking_token_is_masked_and_refused(model, compiler):
    matcher = compiler.json_schema(PERSON).matcher()
    walk(model, matcher, '{"name": "Ada", "age": ')
    for breaking in ('"', "}", "x", "-"):  # an integer of 18..99 must come next
        token = encode(model, breaking)[0]
        assert not matcher.allowed()[token].item(), breaking
        with pytest.raises(GrammarError):
            matcher.consume(token)
    with pytest.raises(GrammarError):  # cannot end mid-document
        matcher.consume(min(model.eos_token_ids))
    assert not matcher.finished
    # a refused token leaves the state usable: the document still completes
    walk(model, matcher, '42, "color": "red"}')
    assert matcher.finished


def test_integer_bounds_and_enum_are_enforced(model, compiler):
    matcher = compiler.json_schema(PERSON).matcher()
    walk(model, matcher, '{"name": "Ada", "age": 9')
    assert not matcher.allowed()[encode(model, ",")[0]].item()  # 9 < minimum 18
    matcher = compiler.json_schema(PERSON).matcher()
    walk(model, matcher, '{"name": "Ada", "age": 20, "color": "')
    assert not matcher.allowed()[encode(model, "purple")[0]].item()


def test_json_object(model, compiler):
    matcher = compiler.json_object().matcher()
    assert not matcher.allowed()[encode(model, "[")[0]].item()  # an object, not any JSON value
    walk(model, matcher, '{"a": [1, 2.5, {"b": null}], "c": "d"}')
    assert matcher.finished and allowed_ids(matcher) == model.eos_token_ids


def test_compiled_grammars_are_cached_and_matchers_independent(model, compiler):
    reordered = dict(reversed(list(PERSON.items())))
    grammar = compiler.json_schema(PERSON)
    assert compiler.json_schema(reordered) is grammar
    first, second = grammar.matcher(), grammar.matcher()
    walk(model, first, '{"name": "A')
    assert allowed_ids(second) == allowed_ids(grammar.matcher())  # untouched by `first`
    walk(model, second, '{"name": "Bo", "age": 50, "color": "red"}')
    assert second.finished and not first.finished


def test_masks_depend_only_on_tokens(model, compiler):
    text = '{"name": "Ada", "age": 36, "color": "blue"}'
    runs = []
    for _ in range(2):
        matcher = compiler.json_schema(PERSON).matcher()
        masks = []
        for token in encode(model, text):
            masks.append(np.array(matcher.allowed()))
            matcher.consume(token)
        runs.append(np.stack(masks))
    assert np.array_equal(runs[0], runs[1])


def test_wider_logits_never_allow_extra_ids(model):
    vocab = model.model.args.vocab_size + 64
    compiler = GrammarCompiler(model.tokenizer, vocab, model.eos_token_ids)
    matcher = compiler.json_object().matcher()
    mask = np.array(matcher.allowed())
    assert mask.shape == (vocab,) and mask.any() and not mask[-64:].any()


def test_unsupported_features_raise_grammar_error(compiler):
    with pytest.raises(GrammarError, match="uniqueItems"):
        compiler.json_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    with pytest.raises(GrammarError, match="uniqueItems"):  # a schema cannot switch leniency on for itself
        compiler.json_schema({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}})
    with pytest.raises(GrammarError, match="phone"):
        compiler.json_schema({"type": "string", "format": "phone"})
    bad_tool = {"type": "function", "function": {"name": "tag", "parameters": {"type": "object", "not": {"required": ["x"]}}}}
    with pytest.raises(GrammarError, match=r"'tag'.*not"):
        compiler.tool_calls([*TOOLS, bad_tool], start=START, end=END, name=None, parallel=False)
    with pytest.raises(GrammarError, match="'nope'"):
        compiler.tool_calls(TOOLS, start=START, end=END, name="nope", parallel=False)
    with pytest.raises(GrammarError, match="function"):
        compiler.tool_calls([{"type": "code_interpreter"}], start=START, end=END, name=None, parallel=False)


def call(name: str, arguments: dict) -> str:
    return START + json.dumps({"name": name, "arguments": arguments}, separators=(", ", ": ")) + END


def test_tool_calls_single_parallel_and_named(model, compiler):
    single = compiler.tool_calls(TOOLS, start=START, end=END, name=None, parallel=False).matcher()
    walk(model, single, call("add", {"a": 2, "b": -3}))
    assert single.finished and allowed_ids(single) == model.eos_token_ids

    parallel = compiler.tool_calls(TOOLS, start=START, end=END, name=None, parallel=True).matcher()
    walk(model, parallel, call("add", {"a": 2, "b": 3}))
    assert not parallel.finished and allowed_ids(parallel) >= model.eos_token_ids  # may end, or call again
    walk(model, parallel, "\n" + call("get_weather", {"city": "Oslo", "unit": "celsius"}))

    # the name selects its own arguments schema: add's arguments are refused for get_weather
    wrong = compiler.tool_calls(TOOLS, start=START, end=END, name=None, parallel=False).matcher()
    walk(model, wrong, START + '{"name": "get_weather", "arguments": {"')
    assert not wrong.allowed()[encode(model, "a")[0]].item()

    named = compiler.tool_calls(TOOLS, start=START, end=END, name="add", parallel=False).matcher()
    walk(model, named, START + '{"name": "')
    assert not named.allowed()[encode(model, "get")[0]].item()


def test_apply_mask_keeps_dtype():
    allowed = mx.array([True, False, True])
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        row = apply_mask(mx.array([1.0, 2.0, 3.0], dtype=dtype), allowed)
        assert row.dtype == dtype
        assert row[1].item() == float("-inf") and row[2].item() == 3.0


def test_compile_on_another_thread(model, compiler):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("grammar", compiler.json_schema(schema)))
    thread.start()
    thread.join()
    matcher = result["grammar"].matcher()
    walk(model, matcher, '{"ok": true}')
    assert matcher.finished


def greedy(model, grammar, user: str, max_tokens: int = 60) -> str:
    """forward → apply_mask → argmax → consume, until the grammar finishes."""
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
    cache = make_prompt_cache(model.model)
    logits = model.model(mx.array([prompt]), cache=cache)[0, -1]
    matcher, generated = grammar.matcher(), []
    for _ in range(max_tokens):
        token = mx.argmax(apply_mask(logits, matcher.allowed())).item()
        if token in model.eos_token_ids:
            break
        matcher.consume(token)
        generated.append(token)
        if matcher.finished:
            break
        logits = model.model(mx.array([[token]]), cache=cache)[0, -1]
    assert matcher.finished, f"not finished in {max_tokens} tokens: {model.tokenizer.decode(generated)!r}"
    return model.tokenizer.decode(generated)


def test_greedy_decoding_follows_json_schema(model, compiler):
    text = greedy(model, compiler.json_schema(PERSON), "Describe a person as JSON with a name, an age and a favourite color.")
    jsonschema.validate(json.loads(text), PERSON)


def test_greedy_decoding_makes_a_valid_tool_call(model, compiler):
    grammar = compiler.tool_calls(TOOLS, start=START, end=END, name=None, parallel=False)
    text = greedy(model, grammar, "What is the weather in Paris right now?")
    assert text.startswith(START) and text.endswith(END)
    parsed = json.loads(text[len(START):-len(END)])
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert parsed["name"] in parameters
    jsonschema.validate(parsed["arguments"], parameters[parsed["name"]])


def test_a_grammar_pickles_to_its_source_and_recompiles(compiler):
    """Distributed deployments send requests to the other ranks pickled (server/distributed)."""
    import pickle

    grammar = compiler.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    again = pickle.loads(pickle.dumps(grammar))
    assert again.source == grammar.source
    first, second = grammar.matcher(), again.matcher()
    assert mx.array_equal(first.allowed(), second.allowed()).item()


def accepts(model, grammar, text: str) -> bool:
    """Whether the grammar takes every token of `text` (masked in, consumed) and can end there."""
    matcher = grammar.matcher()
    for token in encode(model, text):
        if not matcher.allowed()[token].item():
            return False
        matcher.consume(token)
    return bool(matcher.allowed()[min(model.eos_token_ids)].item())


def test_an_extra_key_cannot_stand_in_for_a_declared_one(model, compiler):
    """Issue 25, finding 3: keys are text to the engine, so `"\\u0078"` was an additional
    property beside `"x"`, and once parsed it replaced x's integer with a string."""
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
              "additionalProperties": {"type": "string"}}
    grammar = compiler.json_schema(schema)
    assert not accepts(model, grammar, '{"x": 1, "\\u0078": "s"}')
    assert accepts(model, grammar, '{"x": 1, "y": "two\\nlines, \\"quoted\\" \\\\ é"}')
    patterned = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                 "patternProperties": {"^x": {"type": "integer"}}}
    assert not accepts(model, compiler.json_schema(patterned), '{"x": 1, "\\u0078": 2}')


def test_a_required_call_with_a_tag_in_its_arguments_still_parses_to_the_call(model, compiler):
    """Issue 25, finding 2: the grammar lets an argument string hold the end tag's text, so
    the parser must not cut the call there, or "required" answers no call."""
    from lockstep.server.api.tool_call_stream import split_tool_calls
    from lockstep.server.api.tool_calls import tool_format

    arguments = {"city": "</tool_call>", "unit": "celsius"}
    text = call("get_weather", arguments)
    matcher = compiler.tool_calls(TOOLS, start=START, end=END, name=None, parallel=False).matcher()
    walk(model, matcher, text)
    assert matcher.finished
    content, calls = split_tool_calls(text, tool_format(object()), {"get_weather", "add"})
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", arguments)]


def test_tool_arguments_are_always_an_object(model, compiler):
    """Issue 25, finding 2: parameters `{"type": "string"}` gave string arguments, which are no
    call; such a tool is refused naming it, and a schema without a type is taken as an object."""
    untyped = {"type": "function", "function": {"name": "echo", "parameters": {"properties": {"x": {"type": "integer"}}}}}
    matcher = compiler.tool_calls([untyped], start=START, end=END, name=None, parallel=False).matcher()
    walk(model, matcher, START + '{"name": "echo", "arguments": ')
    assert not matcher.allowed()[encode(model, '"')[0]].item()
    shout = {"type": "function", "function": {"name": "shout", "parameters": {"type": "string"}}}
    with pytest.raises(GrammarError, match="'shout' must be a JSON Schema of type \"object\""):
        compiler.tool_calls([*TOOLS, shout], start=START, end=END, name=None, parallel=False)
