"""`lockstep serve --record` then `lockstep replay` (server/api/recorder.py, server/tools/replay.py):
a recording of mixed requests (plain and streamed, a drawn seed, n = 3, a forced tool call, a
JSON schema, completions, prompt lookup, a prediction; sent 4 at a time) replays identical
against a server of the same deployment; one altered token is reported at that token and
nowhere else; answers the guarantee did not cover, or from another deployment (model, fingerprint,
L), are reported as not comparable, never as identical or diverged.
"""
import json
import shutil
import threading
from types import SimpleNamespace

import pytest
from openai import OpenAI

from lockstep.server.api.app import create_app
from lockstep.server.commands import replay as replay_command
from lockstep.server.tools import replay
from tests.http_server import deterministic_server, running

L = 6
STORY = [{"role": "user", "content": "Tell me a story about a fox."}]
REPEAT = [{"role": "user", "content": "Repeat after me: the quick brown fox jumps over the lazy dog."}]
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
DET = {"deterministic": True}


def mixed_requests(client: OpenAI) -> list:
    chat = client.chat.completions.create
    jobs = [
        lambda: chat(model="default", messages=STORY, max_tokens=6, temperature=0, extra_body=DET),
        lambda: chat(model="default", messages=STORY, max_tokens=6, temperature=0.9, extra_body=DET),
        lambda: list(chat(model="default", messages=STORY, max_tokens=6, temperature=0.7, seed=3, stream=True,
                          extra_body=DET)),
        lambda: chat(model="default", messages=STORY, max_tokens=5, temperature=1.0, seed=11, n=3, extra_body=DET),
        lambda: chat(model="default", messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=24,
                     temperature=0, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}},
                     extra_body=DET),
        lambda: chat(model="default", messages=STORY, max_tokens=8, temperature=0, extra_body=DET,
                     response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                         "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}),
        lambda: client.completions.create(model="default", prompt="The fox", max_tokens=6, temperature=0,
                                          extra_body=DET),
        lambda: chat(model="default", messages=REPEAT, max_tokens=8, temperature=0,
                     extra_body={**DET, "speculative": "prompt_lookup", "num_draft_tokens": 3}),
        lambda: chat(model="default", messages=REPEAT, max_tokens=8, temperature=0, extra_body=DET,
                     prediction={"type": "content", "content": "the quick brown fox jumps over the lazy dog"}),
    ]
    errors = []

    def run(job):
        try:
            job()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    for start in range(0, len(jobs), 4):  # 4 at a time: they share passes
        threads = [threading.Thread(target=run, args=(job,)) for job in jobs[start:start + 4]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    return jobs


@pytest.fixture(scope="module")
def recorded(embedded_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("record")
    with deterministic_server(embedded_model, L) as (client, engine):
        with running(create_app(engine, record_dir=str(directory))) as url:
            recording = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
            jobs = mixed_requests(recording)
        yield SimpleNamespace(file=directory / "requests.jsonl", url=str(client.base_url).removesuffix("/v1/"),
                              engine=engine, requests=len(jobs))


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_answered_request_is_one_line_with_its_choices(recorded):
    entries = lines(recorded.file)
    assert len(entries) == recorded.requests
    assert sum(len(e["choices"]) for e in entries) == recorded.requests + 2  # n = 3 adds two
    for entry in entries:
        for choice in entry["choices"]:
            assert choice["receipt"]["answer_tokens"] == len(choice["token_ids"]) > 0
    drawn = [e for e in entries if e["request"].get("temperature") == 0.9]
    assert len(drawn) == 1 and isinstance(drawn[0]["request"]["seed"], int)  # the seed the server drew


def test_a_recording_replays_identical(recorded):
    verdicts = replay.replay([str(recorded.file)], recorded.url)
    assert [v.outcome for v in verdicts] == [replay.IDENTICAL] * len(verdicts), replay.summary(verdicts)
    assert replay.exit_status(verdicts) == 0


def test_without_speculation_the_answers_are_the_same(recorded):
    verdicts = replay.replay([str(recorded.file)], recorded.url, speculation=False)
    assert {v.outcome for v in verdicts} == {replay.IDENTICAL}, replay.summary(verdicts)


def test_one_altered_token_is_reported_at_that_token_and_nowhere_else(recorded, tmp_path, capsys):
    entries = lines(recorded.file)
    victim, choice, at = 3, 1, 2  # the n = 3 request's second choice, its third token
    assert len(entries[victim]["choices"]) == 3
    original = entries[victim]["choices"][choice]["token_ids"][at]
    entries[victim]["choices"][choice]["token_ids"][at] = original + 1
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("".join(json.dumps(e) + "\n" for e in entries))
    verdicts = replay.replay([str(tampered)], recorded.url)
    diverged = [v for v in verdicts if v.outcome != replay.IDENTICAL]
    assert len(diverged) == 1, replay.summary(verdicts)
    assert (diverged[0].line, diverged[0].choice, diverged[0].outcome) == (victim + 1, choice, replay.DIVERGED)
    assert (diverged[0].index, diverged[0].recorded, diverged[0].replayed) == (at, original + 1, original)
    # the command says so and exits 1
    from lockstep.server.cli import build_parser

    status = replay_command.run(build_parser().parse_args(["replay", str(tampered), "--url", recorded.url]))
    assert status == 1 and "token 2: recorded" in capsys.readouterr().out


def test_answers_the_guarantee_did_not_cover_are_not_comparable(recorded, tmp_path):
    with running(create_app(recorded.engine, record_dir=str(tmp_path))) as url:
        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        client.chat.completions.create(model="default", messages=STORY, max_tokens=4, temperature=0)  # plain
        # replayed into the server that records it: the file grows by the replay's own line
        verdicts = replay.replay([str(tmp_path / "requests.jsonl")], url)
    assert len(lines(tmp_path / "requests.jsonl")) == 2
    assert [v.outcome for v in verdicts] == [replay.NOT_COMPARABLE]
    assert "not covered by the determinism guarantee" in verdicts[0].reason
    assert replay.exit_status(verdicts) == 0


@pytest.mark.parametrize("field, value, words", [
    ("model", "sha-of-other-weights", "another model"),
    ("system_fingerprint", "fp_other", "another system_fingerprint"),
    ("batch_invariant_limit", 0, "another batch-invariant limit"),
    ("guaranteed", False, "not covered by the determinism guarantee"),
])
def test_answers_of_another_deployment_are_not_comparable_and_say_why(recorded, field, value, words):
    entry = lines(recorded.file)[0]
    receipt = entry["choices"][0]["receipt"]
    for tokens in (entry["choices"][0]["token_ids"], [t + 1 for t in entry["choices"][0]["token_ids"]]):
        # other tokens from another deployment are no divergence, the same ones no match
        replayed = {"lockstep": {"receipt": {**receipt, field: value}, "token_ids": tokens}}
        verdict = replay.judge(entry["choices"][0], replayed, ("f", 1))
        assert verdict.outcome == replay.NOT_COMPARABLE and words in verdict.reason
    # control: the same receipt is compared (and identical)
    same = {"lockstep": {"receipt": receipt, "token_ids": entry["choices"][0]["token_ids"]}}
    assert replay.judge(entry["choices"][0], same, ("f", 1)).outcome == replay.IDENTICAL


def test_a_server_that_is_gone_is_failed_not_identical(recorded, tmp_path):
    shutil.copy(recorded.file, tmp_path / "r.jsonl")
    verdicts = replay.replay([str(tmp_path / "r.jsonl")], "http://127.0.0.1:9", timeout=5)
    assert {v.outcome for v in verdicts} == {replay.FAILED} and replay.exit_status(verdicts) == 1
