"""A deterministic answer anyone can check again (server/engine/guarantee/receipt.py, server/api/submission.py):
a seed drawn when none is sent and reported back, deterministic mode asked for by the model's
name or by the deployment's default, and the receipt every response carries.

Over HTTP with the official client on a deterministic server (L = 6); receipts' digests are
compared with digests computed here from what the server returned.
"""
import json
import struct
from decimal import Decimal
from types import SimpleNamespace

import pytest

from lockstep.server.api.app import create_app
from lockstep.server.engine.guarantee.receipt import Receipt, token_digest
from lockstep.server.engine.decoding.sampling import SamplingParams
from lockstep.server.engine.generate import GenerationRequest
from lockstep.server.engine.guarantee.decode_plan import PLAIN
from tests.deterministic_fixtures import float_bits
from tests.http_server import deterministic_server, running

L = 6
STORY = [{"role": "user", "content": "Tell me a story about a fox."}]
SAMPLED = dict(temperature=0.8, max_tokens=8, logprobs=True)


@pytest.fixture(scope="module")
def server(embedded_model):
    with deterministic_server(embedded_model, L) as (client, engine):
        yield SimpleNamespace(client=client, engine=engine)


def chat(client, model="default", **kwargs):
    return client.chat.completions.create(model=model, messages=STORY, **kwargs)


def bits(response):
    return [(t.token, float_bits(t.logprob)) for t in response.choices[0].logprobs.content]


def test_a_seedless_deterministic_request_is_served_with_a_drawn_seed_that_reproduces_it(server):
    first = chat(server.client, extra_body={"deterministic": True}, **SAMPLED)
    seed = first.model_extra["lockstep"]["seed"]
    assert isinstance(seed, int)
    again = chat(server.client, seed=seed, extra_body={"deterministic": True}, **SAMPLED)
    assert bits(again) == bits(first)
    assert again.model_extra["lockstep"]["receipt"] == first.model_extra["lockstep"]["receipt"]
    # control: another drawn seed is another answer, and its receipt says so
    other = chat(server.client, extra_body={"deterministic": True}, **SAMPLED)
    assert other.model_extra["lockstep"]["seed"] != seed
    assert other.model_extra["lockstep"]["receipt"]["answer"] != first.model_extra["lockstep"]["receipt"]["answer"]


def js_number(value) -> int:
    """What a JavaScript client sends back for a JSON integer it read: the nearest double,
    written as JSON.stringify writes it (shortest round-trip digits)."""
    return int(Decimal(repr(float(value))))


def test_a_drawn_seed_read_and_sent_back_by_a_javascript_client_is_the_same_seed(server):
    # JavaScript's JSON numbers are doubles (openai-node, fetch): a seed beyond 2**53 comes back
    # as another seed, another answer (or, rounded past 2**63 - 1, a 400).
    for _ in range(3):  # each drawn seed of 63 bits is beyond 2**53 with odds 1 - 2**-10
        raw = server.client.chat.completions.with_raw_response.create(
            model="default", messages=STORY, extra_body={"deterministic": True}, **SAMPLED)
        first = raw.parse().model_extra["lockstep"]
        seed_read = json.loads(raw.text, parse_int=float)["lockstep"]["seed"]
        again = chat(server.client, seed=js_number(seed_read), extra_body={"deterministic": True}, **SAMPLED)
        assert again.model_extra["lockstep"]["receipt"] == first["receipt"]
    # the seed a plain request samples with, which its receipt reports, too
    plain = chat(server.client, **SAMPLED).model_extra["lockstep"]["receipt"]["seed"]
    assert js_number(plain) == plain


def test_a_plain_request_draws_no_reported_seed(server):
    plain = chat(server.client, **SAMPLED)
    assert "seed" not in plain.model_extra["lockstep"]
    assert plain.model_extra["lockstep"]["receipt"]["deterministic"] is False


def test_the_model_names_suffix_asks_for_deterministic_mode(server):
    ids = [m.id for m in server.client.models.list().data]
    assert ids[1] == ids[0] + ":deterministic"
    assert server.client.models.retrieve("default:deterministic").id == ids[1]
    by_name = chat(server.client, model="default:deterministic", **SAMPLED)
    assert by_name.model_extra["lockstep"]["deterministic"] is True
    assert by_name.model_extra["lockstep"]["guaranteed"] is True
    assert chat(server.client, **SAMPLED).model_extra["lockstep"]["deterministic"] is False  # control
    # the body field still wins over the name
    told = chat(server.client, model="default:deterministic", extra_body={"deterministic": False}, **SAMPLED)
    assert told.model_extra["lockstep"]["deterministic"] is False


def test_the_model_names_suffix_holds_for_streams_and_for_responses(server):
    # every way a request reaches the engine reads its model name alike
    def streamed_chat(model):
        chunks = list(chat(server.client, model=model, stream=True, **SAMPLED))
        return [c for c in chunks if c.choices and c.choices[0].finish_reason][0].model_extra["lockstep"]

    def response(model, stream):
        asked = dict(model=model, input="Say hi.", max_output_tokens=4)
        if stream:
            return list(server.client.responses.create(stream=True, **asked))[-1].response.model_extra["lockstep"]
        return server.client.responses.create(**asked).model_extra["lockstep"]

    assert streamed_chat("default:deterministic")["deterministic"] is True
    assert streamed_chat("default")["deterministic"] is False  # control
    for stream in (False, True):
        assert response("default:deterministic", stream)["deterministic"] is True, stream
        assert response("default", stream)["deterministic"] is False, stream  # control


def test_a_deployment_can_make_deterministic_the_default(server):
    with running(create_app(server.engine, deterministic_by_default=True)) as url:
        from openai import OpenAI

        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
        # a client's defaults: temperature 1, no seed, no extra fields
        answer = client.chat.completions.create(model="default", messages=STORY, max_tokens=4)
        assert answer.model_extra["lockstep"]["deterministic"] is True
        seed = answer.model_extra["lockstep"]["seed"]
        again = client.chat.completions.create(model="default", messages=STORY, max_tokens=4, seed=seed)
        assert again.choices[0].message.content == answer.choices[0].message.content
        refused = client.chat.completions.create(model="default", messages=STORY, max_tokens=4,
                                                 extra_body={"deterministic": False})
        assert refused.model_extra["lockstep"]["deterministic"] is False
        # /v1/responses too, streamed or not
        for stream in (False, True):
            asked = dict(model="default", input="Say hi.", max_output_tokens=4)
            for extra, expected in (({}, True), ({"deterministic": False}, False)):
                if stream:
                    events = list(client.responses.create(stream=True, extra_body=extra, **asked))
                    lockstep = events[-1].response.model_extra["lockstep"]
                else:
                    lockstep = client.responses.create(extra_body=extra, **asked).model_extra["lockstep"]
                assert lockstep["deterministic"] is expected, (stream, extra)


def test_a_receipt_names_the_deployment_the_request_and_digests_of_both_sides(server, embedded_model):
    prompt = embedded_model.tokenizer.encode("The fox ran")
    response = server.client.completions.create(model="default", prompt=prompt, max_tokens=5, temperature=0,
                                                logprobs=1, extra_body={"deterministic": True})
    receipt = response.model_extra["lockstep"]["receipt"]
    deployment = server.engine.deployment
    assert receipt["prompt"] == token_digest(prompt)
    assert receipt["answer_tokens"] == response.usage.completion_tokens == 5
    assert receipt["batch_invariant_limit"] == L and receipt["guaranteed"] is True
    assert receipt["system_fingerprint"] == (deployment.fingerprint or None)
    assert receipt["seed"] is None  # greedy: no seed shapes the tokens
    assert receipt["sampling"]["temperature"] == 0 and receipt["sampling"]["max_tokens"] == 5
    logprobs = response.choices[0].logprobs.token_logprobs
    expected = "sha256:" + __import__("hashlib").sha256(b"".join(struct.pack("<d", lp) for lp in logprobs)).hexdigest()
    assert receipt["logprobs"] == expected


def test_an_answer_ended_by_the_end_token_is_digested_whole(server, embedded_model):
    # The end token is answered (it is in token_ids, and counted in usage): the receipt's digest
    # and count cover it too, or two answers that differ only in how they end share a receipt.
    response = server.client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Say hi."}], max_tokens=64, temperature=0,
        extra_body={"deterministic": True, "return_token_ids": True})
    choice = response.choices[0]
    ids = choice.model_extra["lockstep"]["token_ids"]
    assert choice.finish_reason == "stop" and ids[-1] in embedded_model.eos_token_ids  # what this test is about
    receipt = choice.model_extra["lockstep"]["receipt"]
    assert receipt["answer_tokens"] == len(ids) == response.usage.completion_tokens
    assert receipt["answer"] == token_digest(ids)
    assert receipt["answer"] != token_digest(ids[:-1])  # control: the digest tells the end token apart


def test_a_streams_final_chunk_carries_the_same_receipt(server):
    whole = chat(server.client, seed=5, extra_body={"deterministic": True}, **SAMPLED)
    chunks = list(chat(server.client, seed=5, stream=True, extra_body={"deterministic": True}, **SAMPLED))
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.model_extra["lockstep"]["receipt"] == whole.model_extra["lockstep"]["receipt"]


def test_responses_carry_the_receipt(server):
    response = server.client.responses.create(model="default", input="Say hi.", max_output_tokens=4,
                                              temperature=0, extra_body={"deterministic": True})
    assert response.model_extra["lockstep"]["receipt"]["answer_tokens"] == response.usage.output_tokens


def test_receipts_differ_exactly_where_answers_do():
    request = GenerationRequest(prompt_tokens=[1, 2], max_tokens=3, sampling=SamplingParams(temperature=0))

    def receipt(tokens):
        r = Receipt(request, [1, 2], PLAIN, None)
        for token in tokens:
            r.add(token, None)
        return r.as_dict()

    assert receipt([5, 6, 7]) == receipt([5, 6, 7])
    changed = receipt([5, 6, 8])
    assert changed["answer"] != receipt([5, 6, 7])["answer"]
    assert {k for k, v in changed.items() if v != receipt([5, 6, 7])[k]} == {"answer"}
