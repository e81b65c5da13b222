"""n > 1, presence/frequency penalties and logit_bias: over HTTP with the official client on a
deterministic server (L = 6), and the penalty arithmetic against OpenAI's definition."""
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from openai import BadRequestError

from lockstep.server.api.choices import choice_seed
from lockstep.server.engine.decoding.logits_processors import LogitBias, Penalties
from tests.deterministic_fixtures import float_bits
from tests.http_server import deterministic_server

L = 6
REPEAT = [{"role": "user", "content": "Write the word 'hello' forty times, separated by spaces."}]
STORY = [{"role": "user", "content": "Tell me a story about a fox."}]


@pytest.fixture(scope="module")
def server(embedded_model):
    with deterministic_server(embedded_model, L) as (client, engine):
        yield SimpleNamespace(client=client, engine=engine)


def chat(server, messages=STORY, **kwargs):
    kwargs.setdefault("max_tokens", 10)
    return server.client.chat.completions.create(model="default", messages=messages, **kwargs)


def tokens_of(choice):
    return [(t.token, float_bits(t.logprob)) for t in choice.logprobs.content]


# ------------------------------------------------------------------------------- n

SEEDED = dict(temperature=1.0, seed=77, logprobs=True, extra_body={"deterministic": True})


def test_n_choices_are_distinct_streams_and_deterministic_across_reruns(server):
    first = chat(server, n=3, **SEEDED)
    again = chat(server, n=3, **SEEDED)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [tokens_of(c) for c in first.choices] == [tokens_of(c) for c in again.choices]
    assert len({c.message.content for c in first.choices}) > 1  # seed streams (seed, i) differ
    single = chat(server, n=1, **SEEDED)
    assert tokens_of(single.choices[0]) == tokens_of(first.choices[0])  # choice 0 keeps the seed
    alone = chat(server, n=1, **{**SEEDED, "seed": choice_seed(77, 2)})
    assert tokens_of(alone.choices[0]) == tokens_of(first.choices[2])  # choice i is stream (seed, i), batched or not
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)
    assert first.usage.prompt_tokens == single.usage.prompt_tokens


def test_streamed_n_choices_equal_the_non_streamed_ones(server):
    whole = chat(server, n=3, **SEEDED)
    texts = {0: "", 1: "", 2: ""}
    finishes = {}
    for chunk in chat(server, n=3, stream=True, **SEEDED):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}


def test_n_choices_share_one_prompt_prefill(server, monkeypatch):
    from collections import OrderedDict

    from lockstep.server.engine.runner import model_runner

    cache = server.engine.prefix_cache  # off here, so each request's own prefill is counted
    monkeypatch.setattr(cache, "entries", 0)
    monkeypatch.setattr(cache, "_store", OrderedDict())
    chunks = []
    real = model_runner.prompt_forward
    monkeypatch.setattr(model_runner, "prompt_forward",
                        lambda model, cache, tokens: (chunks.append(len(tokens)), real(model, cache, tokens))[1])
    chat(server, messages=REPEAT, n=1, max_tokens=2, temperature=0)
    alone = list(chunks)
    chunks.clear()
    many = chat(server, messages=REPEAT, n=4, max_tokens=2, temperature=0)
    assert chunks == alone and sum(alone) == many.usage.prompt_tokens - 1  # prefilled once, not 4 times
    assert len({c.message.content for c in many.choices}) == 1  # greedy: all choices agree


def test_n_above_the_limit_is_refused(server):
    with pytest.raises(BadRequestError) as err:
        chat(server, n=17)
    assert err.value.body["param"] == "n"


# ------------------------------------------------------------------------ penalties

def _most_repeated(text: str) -> int:
    words = text.split()
    return max(words.count(w) for w in set(words)) if words else 0


def test_frequency_and_presence_penalties_cut_repetition(server):
    plain = chat(server, messages=REPEAT, max_tokens=24, temperature=0).choices[0].message.content
    for field in ("frequency_penalty", "presence_penalty"):
        penalised = chat(server, messages=REPEAT, max_tokens=24, temperature=0, **{field: 2.0}).choices[0].message.content
        assert _most_repeated(penalised) < _most_repeated(plain), (field, plain, penalised)


def test_penalties_stay_bit_identical_with_speculation(server):
    args = dict(messages=REPEAT, max_tokens=20, temperature=0, logprobs=True, frequency_penalty=0.4)
    plain = chat(server, extra_body={"deterministic": True}, **args)
    lookup = chat(server, extra_body={"deterministic": True, "speculative": "prompt_lookup", "num_draft_tokens": 4}, **args)
    assert tokens_of(lookup.choices[0]) == tokens_of(plain.choices[0])
    assert (lookup.model_extra["lockstep"]["drafted_tokens"]) > 0


def test_penalty_arithmetic_follows_openai():
    row = mx.zeros((6,))
    got = np.array(Penalties(presence=0.5, frequency=0.25).apply(row, [1, 1, 3, 1]))
    assert got.tolist() == [0.0, -(0.5 + 3 * 0.25), 0.0, -(0.5 + 0.25), 0.0, 0.0]
    assert np.array(LogitBias({2: -100.0, 9: 5.0}, 6).apply(row)).tolist() == [0, 0, -100, 0, 0, 0]


# ----------------------------------------------------------------------- logit_bias

def test_logit_bias_bans_and_forces_tokens(server):
    plain = chat(server, max_tokens=3, temperature=0, logprobs=True).choices[0]
    first = server.engine.loaded.tokenizer.encode(plain.logprobs.content[0].token, add_special_tokens=False)[0]
    banned = chat(server, max_tokens=3, temperature=0, logprobs=True, logit_bias={str(first): -100}).choices[0]
    assert banned.logprobs.content[0].token != plain.logprobs.content[0].token
    forced_id = server.engine.loaded.tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = chat(server, max_tokens=3, temperature=0, logit_bias={str(forced_id): 100}).choices[0]
    forced_text = server.engine.loaded.tokenizer.decode([forced_id])
    assert forced.message.content == forced_text * 3


def test_logprobs_are_the_models_own_before_the_bias(server):
    # docs/API.md: logprobs stay the model's own distribution (before penalties, bias and
    # grammar masks). Deterministic, so both answers' first rows are the same bits.
    asked = dict(max_tokens=1, temperature=0, logprobs=True, top_logprobs=5, extra_body={"deterministic": True})
    plain = chat(server, **asked).choices[0].logprobs.content[0]
    top = [(t.token, float_bits(t.logprob)) for t in plain.top_logprobs]
    first = server.engine.loaded.tokenizer.encode(plain.token, add_special_tokens=False)[0]
    banned = chat(server, logit_bias={str(first): -100}, **asked).choices[0].logprobs.content[0]
    assert banned.token == top[1][0] != plain.token  # control: the bias changed the choice
    assert float_bits(banned.logprob) == top[1][1]
    assert [(t.token, float_bits(t.logprob)) for t in banned.top_logprobs] == top


@pytest.mark.parametrize("bias, error", [({"x": 1}, "token ids"), ({"5": 101}, "[-100, 100]"),
                                         ({"99999999": 1}, "token ids must be in")])
def test_bad_logit_bias_is_a_400_naming_it(server, bias, error):
    with pytest.raises(BadRequestError) as err:
        chat(server, logit_bias=bias)
    assert err.value.body["param"] == "logit_bias" and error in err.value.body["message"]


# ------------------------------------------------------------------- cached prompt tokens

def test_usage_reports_the_prompt_tokens_a_prefix_cache_hit_reused(server):
    messages = [{"role": "user", "content": "Name three rivers in Europe, and say which is longest."}]
    cold = chat(server, messages, max_tokens=2, temperature=0, logprobs=True, extra_body={"deterministic": True})
    warm = chat(server, messages, max_tokens=2, temperature=0, logprobs=True, extra_body={"deterministic": True})
    # the first request may reuse what it shares with earlier prompts (the chat template's head);
    # the second reuses its whole prompt but the last token, less at most a chunk (4) where the
    # hit resumes at a chunk boundary
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (cold, warm)]
    prompt = warm.usage.prompt_tokens
    assert cached[0] < cached[1] and prompt - 1 - 4 < cached[1] <= prompt - 1
    assert tokens_of(warm.choices[0]) == tokens_of(cold.choices[0])
