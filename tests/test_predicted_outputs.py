"""Predicted Outputs (`prediction`) end to end on a deterministic server (L = 6), with the
official client: the prediction's tokens are the drafts of speculative decoding, and since
every token is chosen from the target's own logits row, which deterministic mode makes
bit-identical whatever the pass, the answer with a prediction is the answer without one,
tokens and logprobs bit for bit, for greedy and seeded sampling alike, with a prediction
equal to the answer or unlike it. usage.completion_tokens_details counts the prediction
tokens verification accepted and rejected, as OpenAI reports them.
"""
from types import SimpleNamespace

import pytest

from tests.deterministic_fixtures import float_bits
from tests.http_server import deterministic_server

L = 6  # as tests/test_sampling_fields.py: the session's cached proofs for this L are re-used
TOKENS = 24
COPY = [{"role": "user", "content": "Copy this sentence exactly: The keeper climbed the stairs of the "
                                    "lighthouse, lit the lamp and watched the ships pass in the dark."}]
UNLIKE = "Roses are red, violets are blue; the keeper of the lighthouse climbed the stairs too."
GREEDY = dict(temperature=0, logprobs=True, top_logprobs=2)
SEEDED = dict(temperature=0.8, seed=4321, logprobs=True, top_logprobs=2)


@pytest.fixture(scope="module")
def server(embedded_model):
    with deterministic_server(embedded_model, L) as (client, engine):
        yield SimpleNamespace(client=client, answers={})


def ask(server, sampling, prediction=None, **kwargs):
    body = dict(model="default", messages=COPY, max_tokens=TOKENS, extra_body={"deterministic": True},
                **sampling, **kwargs)
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    return server.client.chat.completions.create(**body)


def bits(response):
    """What must not depend on the prediction: text, tokens, logprobs and alternatives (IEEE bits)."""
    choice = response.choices[0]
    return (choice.message.content, choice.finish_reason,
            [(t.token, float_bits(t.logprob), [(a.token, float_bits(a.logprob)) for a in t.top_logprobs])
             for t in choice.logprobs.content])


@pytest.fixture(scope="module")
def baseline(server):
    """The answers without a prediction, greedy and seeded (asked once per module)."""
    return {"greedy": ask(server, GREEDY), "seeded": ask(server, SEEDED)}


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("guess", ["the answer", "unlike it"])
def test_the_answer_with_a_prediction_is_the_answer_without(server, baseline, sampling, guess):
    base = baseline[sampling]
    n = base.usage.completion_tokens
    assert n > TOKENS // 2 and base.model_extra["lockstep"]["speculative"] == "none"
    prediction = base.choices[0].message.content if guess == "the answer" else UNLIKE
    got = ask(server, GREEDY if sampling == "greedy" else SEEDED, prediction)
    assert bits(got) == bits(base)
    ext = got.model_extra["lockstep"]
    assert (ext["speculative"], ext["num_draft_tokens"], ext["guaranteed"]) == ("prediction", L - 1, True)
    details = got.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == ext["accepted_tokens"]
    assert details.rejected_prediction_tokens == ext["drafted_tokens"] - ext["accepted_tokens"]
    if guess == "the answer":  # every draft verified is taken, and passes are saved
        assert details.accepted_prediction_tokens >= n // 2 and details.rejected_prediction_tokens == 0
        assert ext["forward_passes"] < n // 2
    else:
        assert details.rejected_prediction_tokens > 0


def test_a_streamed_answer_with_a_prediction_reports_its_counts_in_the_usage_chunk(server, baseline):
    base = baseline["greedy"]
    chunks = list(ask(server, GREEDY, base.choices[0].message.content, stream=True,
                      stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == base.choices[0].message.content
    usage = chunks[-1].usage
    assert usage.completion_tokens == base.usage.completion_tokens
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_without_a_prediction_the_prediction_counts_are_zero(baseline):
    details = baseline["greedy"].usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)


def test_a_prediction_the_answer_leaves_costs_one_rejected_draft(server, baseline):
    """The server's draft back-off (speculative.py DraftBackoff): the first guess is one draft,
    and once it misses no more are verified while the prediction does not agree again, so a
    wrong prediction costs one row, not k per step (on the CPU each row costs a decode step)."""
    got = ask(server, GREEDY, "zq" * 40)  # no token of it recurs in the answer
    assert bits(got) == bits(baseline["greedy"])
    ext = got.model_extra["lockstep"]
    assert ext["num_draft_tokens"] == L - 1
    assert (ext["drafted_tokens"], ext["accepted_tokens"]) == (1, 0)
    assert got.usage.completion_tokens_details.rejected_prediction_tokens == 1
