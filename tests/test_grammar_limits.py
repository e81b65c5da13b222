"""Regression tests for the constrained-decoding findings of issue 25's adversarial round: each
test names the finding it guards. Grammar limits (server/engine/structured/grammar_limits.py), the
grammar checker process (server/engine/structured/grammar_sandbox.py) and their errors over HTTP.
"""
import json
import logging
import subprocess
import sys
import textwrap

import httpx2 as httpx
import llguidance
import pytest

from lockstep.server.engine.structured.grammar import JSON_OPTIONS, GrammarCompiler, GrammarError

CHAT = {"model": "default", "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "max_tokens": 24, "temperature": 0}


def chain(links: int) -> dict:
    """The schema of finding 1: `links` definitions, each an object whose one property refers to the next."""
    defs = {f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["n"]}
            for i in range(links)}
    defs[f"d{links}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def optional_properties(count: int, prefix: str = "p") -> dict:
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(count)}}


SELF_REF = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
HUGE_REPEAT = {"type": "string", "pattern": "^a{1000000}$"}


@pytest.fixture(scope="module")
def compiler(embedded_model):
    compiler = GrammarCompiler(embedded_model.tokenizer, embedded_model.model.args.vocab_size,
                               embedded_model.eos_token_ids)
    yield compiler
    compiler.sandbox.close()


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.removesuffix("/v1"), timeout=300) as client:
        yield client


def error_of(response, status: int, param: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def required_tool(parameters: dict) -> dict:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": "required"}


def as_parameters(schema: dict) -> dict:
    """`schema` as the one argument of a function (its $defs at the root, where its $refs point)."""
    inner = {k: v for k, v in schema.items() if k != "$defs"}
    defs = {"$defs": schema["$defs"]} if "$defs" in schema else {}
    return {"type": "object", "properties": {"v": inner}, "required": ["v"], **defs}


def responses_format(schema: dict) -> dict:
    return {"model": "default", "input": "Describe a person as JSON.", "max_output_tokens": 16, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}


# ------------------------------------------------- 1. one request kills the server

def test_a_chained_ref_schema_crashes_only_the_checker_process(embedded_model):
    """With the static limits lifted, the schema reaches the grammar engine: the compile that
    overflows its stack must be the checker's, and the process asking must live on."""
    script = textwrap.dedent(f"""
        import json, sys, threading
        from pathlib import Path
        from mlx_lm.utils import load_tokenizer
        from lockstep.server.engine.structured.grammar import GrammarCompiler, GrammarError
        try:  # today's code has no static limits to lift
            from lockstep.server.engine.structured import grammar_limits
            grammar_limits.schema_problem = lambda schema, what="": None
        except ImportError:
            pass
        tokenizer = load_tokenizer(Path({str(embedded_model.path)!r}))  # as the server loads it
        compiler = GrammarCompiler(tokenizer, {embedded_model.model.args.vocab_size}, {sorted(embedded_model.eos_token_ids)})
        schema = json.loads(sys.stdin.read())
        outcome = {{}}

        def compile_it():
            try:
                compiler.json_schema(schema)
                outcome["result"] = "compiled"
            except GrammarError as exc:
                outcome["result"] = type(exc).__name__ + ": " + str(exc)

        thread = threading.Thread(target=compile_it)  # as the server compiles: off the main thread
        thread.start()
        thread.join()
        fine = compiler.json_schema({{"type": "object", "properties": {{"a": {{"type": "integer"}}}}}})
        print(json.dumps([outcome["result"], fine.matcher().finished]))
    """)
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(chain(1000)), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result, finished = json.loads(done.stdout.strip().splitlines()[-1])
    assert result.startswith("GrammarLimitError: json_schema: the grammar engine crashed compiling this grammar")
    assert "stack" in result and finished is False


def test_a_chained_ref_schema_is_a_400_on_every_route_and_the_server_lives(http):
    schema = chain(1000)
    for path, body, param in [
        ("/v1/chat/completions", {**CHAT, "response_format": schema_format(schema)}, "response_format"),
        ("/v1/chat/completions", {**CHAT, **required_tool(as_parameters(schema))}, "tools"),
        ("/v1/responses", responses_format(schema), "text"),
    ]:
        error = error_of(http.post(path, json=body), 400, param)
        assert "MAX_SCHEMA_DEPTH = 100" in error["message"] and error["code"] == "grammar_limit_exceeded"
    assert http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code == 200


def test_the_checker_survives_crashes_and_timeouts(compiler):
    from lockstep.server.engine.structured import grammar_sandbox

    sandbox = compiler.sandbox
    crash = llguidance.LLMatcher.grammar_from_json_schema(chain(1000), overrides=JSON_OPTIONS)
    refusal = sandbox.check(crash)
    assert refusal.limit and "crashed compiling this grammar" in refusal.message
    assert sandbox.pid is None  # the crashed child is gone
    fine = llguidance.LLMatcher.grammar_from_json_schema(chain(20), overrides=JSON_OPTIONS)
    assert sandbox.check(fine) is None  # a fresh child
    pid = sandbox.pid
    assert sandbox.check(fine) is None and sandbox.pid == pid
    # A crash is not the engine's own verdict (tests/test_grammar_sandbox.py): checked, and crashed, again.
    assert sandbox.check(crash) == refusal and sandbox.pid is None

    many = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(4000)},
            "required": [f"p{i}" for i in range(4000)]}
    slow = llguidance.LLMatcher.grammar_from_json_schema(many, overrides=JSON_OPTIONS)
    grammar_sandbox.configure(timeout_s=0.01)
    try:
        refusal = sandbox.check(slow)
    finally:
        grammar_sandbox.configure(timeout_s=grammar_sandbox.DEFAULT_TIMEOUT_S)
    assert refusal.limit and "longer than the grammar timeout of 0.01 s" in refusal.message
    assert sandbox.pid is None  # killed
    assert compiler.json_schema({"type": "object", "properties": {"b": {"type": "boolean"}}}).matcher()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_checker_runs_under_its_memory_limit(compiler):
    from lockstep.server.engine.structured import grammar_sandbox

    compiler.json_schema({"type": "object", "properties": {"m": {"type": "null"}}})  # a running child
    limits = open(f"/proc/{compiler.sandbox.pid}/limits").read()
    line = next(row for row in limits.splitlines() if row.startswith("Max address space"))
    assert line.split()[3] == str(grammar_sandbox.GRAMMAR_MEMORY_BYTES)


def test_the_checker_compiles_on_a_smaller_stack_than_the_server(embedded_model, monkeypatch):
    """Finding 1's premise: a grammar that compiled in the checker cannot overflow the server's
    compile thread. The stacks are read from the threads themselves: the child's check thread
    (tests/doubles/stack_reporting_checker.py runs the real child) and a server compile thread."""
    import os

    from lockstep.server.engine.structured import grammar, grammar_sandbox
    from tests.doubles import stack_reporting_checker

    sandbox_file = os.path.abspath(grammar_sandbox.__file__)
    real_popen = subprocess.Popen

    def popen(argv, **kwargs):  # the checker's child, with the check replaced by the report
        if argv[2:3] == [sandbox_file]:
            argv = [*argv[:2], stack_reporting_checker.__file__, *argv[2:]]
        return real_popen(argv, **kwargs)

    monkeypatch.setattr(grammar_sandbox.subprocess, "Popen", popen)
    compiler = GrammarCompiler(embedded_model.tokenizer, embedded_model.model.args.vocab_size,
                               embedded_model.eos_token_ids)
    try:
        refusal = compiler.sandbox.check('{"type": "string"}')
    finally:
        compiler.sandbox.close()
    child = json.loads(refusal.message.removeprefix("not supported by the grammar engine: "))
    server = grammar._on_compile_thread(stack_reporting_checker.thread_stack_bytes)
    page = os.sysconf("SC_PAGE_SIZE")
    assert abs(child["stack_bytes"] - grammar_sandbox.CHECK_STACK_BYTES) <= 4 * page, child
    assert abs(server - grammar_sandbox.COMPILE_STACK_BYTES) <= 4 * page, server
    assert child["stack_bytes"] < server


@pytest.mark.parametrize("schema, constant", [
    (chain(40), "MAX_SCHEMA_DEPTH"),
    ({"type": "string", "enum": ["x" * 1000] * 300}, "MAX_SCHEMA_BYTES"),
    ({"$defs": {f"d{i}": {"type": "integer"} for i in range(1001)}, "type": "integer"}, "MAX_DEFINITIONS"),
    ({"anyOf": [{"$ref": "#/$defs/a"}] * 2001, "$defs": {"a": {"type": "integer"}}}, "MAX_REFS"),
    (optional_properties(257), "MAX_OPTIONAL_PROPERTIES"),
    ({"type": "string", "pattern": "a" * 1001}, "MAX_PATTERN_CHARS"),
    ({"type": "string", "pattern": "^(?:(a{101}){10}){10}$"}, "MAX_REGEX_REPEAT"),
    ({"type": "object", "patternProperties": {"(b{200}){51}": {"type": "integer"}}}, "MAX_REGEX_REPEAT"),
])
def test_each_static_limit_is_refused_by_name(compiler, schema, constant):
    from lockstep.server.engine.structured import grammar_limits
    from lockstep.server.engine.structured.grammar import GrammarLimitError

    with pytest.raises(GrammarLimitError, match=f"{constant} = {getattr(grammar_limits, constant)}"):
        compiler.json_schema(schema)


def test_schemas_within_the_static_limits_pass(compiler):
    from lockstep.server.engine.structured import grammar_limits

    tree = {"$defs": {"node": {"type": "object", "properties": {"children": {"type": "array", "items": {
        "$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}  # recursion is not depth
    for schema in [chain(25), tree, optional_properties(256), {"type": "string", "pattern": "^(a{100}){100}$"},
                   {"type": "string", "pattern": "^[a-z]{1,100}@[a-z]{1,100}\\.[a-z]{2,100}$"}]:
        assert compiler.json_schema(schema).matcher().allowed().any().item()
    assert grammar_limits.regex_repeat(r"\{99999\}[{]99999[}]x{3}") == 3  # escaped and in-class braces


# ------------------------------------------------- 3. constrained JSON repeats keys

def test_min_properties_that_only_repeated_keys_could_meet_is_refused(compiler):
    with pytest.raises(GrammarError, match="minProperties 3 with 0 required"):
        compiler.json_schema({"type": "object", "patternProperties": {"^x$": {"type": "integer"}},
                              "minProperties": 3})
    with pytest.raises(GrammarError, match="minProperties 4 with 1 required"):
        compiler.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                              "additionalProperties": {"type": "integer"}, "minProperties": 4})
    # one key beyond the required ones is always distinct from them: allowed
    compiler.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                          "additionalProperties": {"type": "integer"}, "minProperties": 2})


# ------------------------------------------------- 4. grammar-engine limits become 500s

@pytest.mark.parametrize("schema, named", [
    (optional_properties(501), "MAX_OPTIONAL_PROPERTIES = 256"),
    (SELF_REF, "only refers to itself"),
    (HUGE_REPEAT, "MAX_REGEX_REPEAT = 10000"),
])
def test_engine_limits_known_at_check_time_are_400s_naming_limit_and_field(http, schema, named):
    for path, body, param in [
        ("/v1/chat/completions", {**CHAT, "response_format": schema_format(schema)}, "response_format"),
        ("/v1/chat/completions", {**CHAT, **required_tool(as_parameters(schema))}, "tools"),
        ("/v1/responses", responses_format(schema), "text"),
    ]:
        error = error_of(http.post(path, json=body), 400, param)
        assert named in error["message"] and error["type"] == "invalid_request_error"


def test_the_checker_finds_limits_one_token_into_the_output(compiler):
    """Past the static limits, the checker's first step still finds the engine's own limits."""
    for schema, engine_message in [(optional_properties(501), "Current row has"),
                                   (HUGE_REPEAT, "too many expressions")]:
        source = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        refusal = compiler.sandbox.check(source)
        assert refusal.limit and engine_message in refusal.message, refusal


# A name the model must finish first (bounded), then a value whose first key opens more
# alternatives than the engine's parser keeps in one row: past the checker's first step.
LATE_LIMIT = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 4},
    "value": {"anyOf": [optional_properties(200, prefix) for prefix in "xyz"]}},
    "required": ["name", "value"], "additionalProperties": False}


def test_a_limit_reached_during_generation_is_a_400_and_one_warning_line(http, caplog):
    body = {**CHAT, "response_format": schema_format(LATE_LIMIT), "max_tokens": 40}
    with caplog.at_level(logging.WARNING):
        error = error_of(http.post("/v1/chat/completions", json=body), 400, "response_format")
    assert error["type"] == "invalid_request_error" and error["code"] == "grammar_limit_exceeded"
    assert "grammar engine limit during generation" in error["message"] and "token" not in error["message"]
    stopped = [r for r in caplog.records if "generation stopped" in r.getMessage()]
    assert len(stopped) == 1 and stopped[0].levelno == logging.WARNING and stopped[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

    events = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = json.loads(events[-2])["error"]
    assert streamed["param"] == "response_format" and streamed["code"] == "grammar_limit_exceeded"
    assert "grammar engine limit during generation" in streamed["message"]
