"""The API's own OpenAPI schema, fuzzed: no input gets a 5xx; bad input gets a clear 4xx.

Runs on the real model (generation bugs count) behind an app with tiny token caps, so each
generated request costs at most a couple of decode steps. Bounded by `max_examples`.
"""
import json

import httpx2 as httpx
import pytest

from tests.http_server import running

schemathesis = pytest.importorskip("schemathesis")  # the `test` extra; absence is reported, not passed

MAX_EXAMPLES = 15
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def fuzz_server(embedded_model):
    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine
    from lockstep.server.api.limits import Limits

    engine = Engine(embedded_model, max_active=2).start()
    try:
        app = create_app(engine, limits=Limits(max_tokens=2, max_prompt_tokens=48, max_body_bytes=64 * 1024))
        with running(app) as url:
            yield url
    finally:
        engine.stop()


def test_schema_fuzz_finds_no_server_errors(fuzz_server):
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(fuzz_server + "/openapi.json")
    failures = []
    for operation in schema.get_all_operations():
        op = operation.ok()

        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def check(case):
            response = case.call(base_url=fuzz_server, timeout=120)
            if response.status_code >= 500:
                failures.append((op.label, case.body, response.status_code, response.text[:300]))
            case.validate_response(response, checks=[not_a_server_error])

        check()
    assert not failures


@pytest.mark.parametrize("content, why", [
    ('{"model": "default", "messages": [', "malformed JSON"),
    ('[1, 2, 3]', "not an object"),
    ('{"model": "default", "messages": "hello"}', "wrong type"),
    ('{"model": 5, "messages": [{"role": "user", "content": "hi"}]}', "wrong type"),
    ('{"model": "default", "messages": [{"role": "robot", "content": "hi"}]}', "bad enum"),
    ('{"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}', "huge float"),
    ('{"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999999999999999999999}',
     "huge int"),
    ('{"model": "default", "messages": [{"role": "user", "content": "%s"}]}' % ("x" * 70000), "huge body"),
    ('{"model": "default", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN"),
    ('{"model": "default", "messages": [{"role": "user", "content": "hi"}], "unknown_field": 1}', "unknown field"),
    ('{"model": "default", "prompt": [-1]}', "negative token id"),
])
def test_bad_input_gets_a_clear_4xx(fuzz_server, content, why):
    path = "/v1/completions" if '"prompt"' in content else "/v1/chat/completions"
    response = httpx.post(fuzz_server + path, content=content, headers={"content-type": "application/json"},
                          timeout=120)
    assert 400 <= response.status_code < 500, (why, response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"] and error["type"] == "invalid_request_error"
    assert error["message"] != "There was an error parsing the body"  # says what is wrong
