"""Decoding ahead (server/engine/runner/decode_ahead.py, held by the model runner): the next compiled
decode pass built on the tokens of the one still running, taken over when its requests decode
next. Driven through the real engine on the tiny random llama, over the KV pool with
the CPU stand-in for its attention kernel (tests/doubles/pool_kernel.py), against the same
requests decoded one pass at a time.
"""
import asyncio
import struct
from dataclasses import replace

import pytest

from lockstep.server.engine import Engine
from lockstep.server.engine.guarantee.decode_plan import plan_request
from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.decoding.request_state import GenerationRequest
from lockstep.server.engine.decoding.sampling import SamplingParams
from tests.deterministic_fixtures import TinyLoaded
from tests.doubles.pool_kernel import pool_kernel_double
from tests.tiny_models import tiny_llama

# Finishing after 3, 9 and 14 tokens: the pass taken over loses a request twice on the way.
REQUESTS = {
    "greedy": GenerationRequest([3, 4, 5, 6], 14, SamplingParams(temperature=0.0)),
    "sampled": GenerationRequest([7, 8, 9], 9, SamplingParams(temperature=1.0, seed=11, top_logprobs=2)),
    "short": GenerationRequest([5, 5], 3, SamplingParams(temperature=1.0, seed=3)),
}


@pytest.fixture(scope="module")
def tiny():
    with pool_kernel_double():
        yield TinyLoaded(tiny_llama())


def decode(tiny, ahead: bool, requests=REQUESTS, deployment=None, deterministic=False,
           speculative=None, prediction=False, watch=None) -> tuple[dict, object]:
    """Every request's (token ids, logprob bits), all queued before the engine starts (so both
    runs schedule the same passes), and the engine's model runner. `prediction`: the requests
    draft from their Predicted Outputs. `watch(engine)` is called before it starts."""
    deployment = replace(deployment or Deployment(kv_pool="kernel", prefill_chunk=8), decode_ahead=ahead)
    engine = Engine(tiny, max_active=8, deployment=deployment)
    if watch is not None:
        watch(engine)
    plan = plan_request(deployment, deterministic=deterministic, speculative=speculative, prediction=prediction,
                        num_draft_tokens=3 if speculative or prediction else None)
    out = {}

    async def main():
        handles = {name: engine.submit(request, plan) for name, request in requests.items()}
        engine.start()

        async def consume(name, handle):
            text, bits = "", []
            async for delta in handle:
                text += delta.text
                bits += [struct.pack(">d", v) for lp in delta.logprobs for v in [lp.logprob] + [v for _, v in lp.top]]
            out[name] = ([ord(ch) - 0x4E00 for ch in text], bits)

        await asyncio.gather(*(consume(n, h) for n, h in handles.items()))

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    return out, engine.runner


def test_decoding_ahead_gives_every_request_the_tokens_and_logprobs_of_one_pass_at_a_time(tiny):
    want, one_at_a_time = decode(tiny, ahead=False)
    got, ahead = decode(tiny, ahead=True)
    assert [len(want[name][0]) for name in REQUESTS] == [14, 9, 3]
    assert len(want["sampled"][1]) == 9 * 3  # the chosen token's logprob and two alternatives
    assert got == want
    assert one_at_a_time.ahead_built == one_at_a_time.ahead_taken == one_at_a_time.ahead_dropped == 0
    assert not one_at_a_time.describe()["decode_ahead"] and ahead.describe()["decode_ahead"]
    # 14 decode passes: each one after the first was built ahead and taken over, with the
    # requests that had not finished; none was built past a request's last token
    assert (ahead.ahead_built, ahead.ahead_taken, ahead.ahead_dropped) == (13, 13, 0)


def test_a_pass_ahead_sampling_at_the_wrong_position_diverges(tiny, monkeypatch):
    """Negative control: the comparison above sees a pass built ahead with its sampling keyed
    to the position of the pass before it."""
    from lockstep.server.engine.runner import decode_ahead

    presample = decode_ahead.presample
    monkeypatch.setattr(decode_ahead, "presample",
                        lambda members, logits, spans, ahead=0: presample(members, logits, spans))
    got, ahead = decode(tiny, ahead=True)
    want, _ = decode(tiny, ahead=False)
    assert ahead.ahead_taken == 13
    assert got["greedy"] == want["greedy"] and got["sampled"] != want["sampled"]


def test_a_pass_built_ahead_is_dropped_when_its_requests_are_not_the_next_pass(tiny, monkeypatch):
    from lockstep.server.engine.runner.decode_ahead import AheadPass

    rows_for = AheadPass.rows_for
    monkeypatch.setattr(AheadPass, "rows_for", lambda self, members, canonical: None)
    got, ahead = decode(tiny, ahead=True)
    monkeypatch.setattr(AheadPass, "rows_for", rows_for)
    want, _ = decode(tiny, ahead=False)
    assert got == want  # every pass built again, over rows the dropped passes also wrote
    assert ahead.ahead_taken == 0 and ahead.ahead_built == ahead.ahead_dropped == 13


def _ahead_metrics(metrics) -> dict[str, float]:
    text = metrics.exposition()[0].decode()
    prefix = "lockstep_decode_ahead_passes_total{outcome=\""
    return {line[len(prefix):].split("\"")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def test_metrics_count_the_passes_built_ahead_taken_and_dropped(tiny, monkeypatch):
    """/metrics' `lockstep_decode_ahead_passes_total{outcome}` is the runner's own count: 13
    built and taken above; the same requests with every pass ahead refused by its next pass,
    13 built and dropped; without decoding ahead, none."""
    from lockstep.server.api.metrics import Metrics
    from lockstep.server.engine.runner.decode_ahead import AheadPass

    taken, dropped, off = Metrics(), Metrics(), Metrics()
    decode(tiny, ahead=True, watch=taken.watch_engine)
    decode(tiny, ahead=False, watch=off.watch_engine)
    monkeypatch.setattr(AheadPass, "rows_for", lambda self, members, canonical: None)
    decode(tiny, ahead=True, watch=dropped.watch_engine)
    assert _ahead_metrics(taken) == {"built": 13, "taken": 13, "dropped": 0}
    assert _ahead_metrics(dropped) == {"built": 13, "taken": 0, "dropped": 13}
    assert _ahead_metrics(off) == {"built": 0, "taken": 0, "dropped": 0}


def test_no_pass_is_built_ahead_of_a_request_at_its_last_token(tiny):
    one = {"short": REQUESTS["short"]}
    got, ahead = decode(tiny, ahead=True, requests=one)
    want, _ = decode(tiny, ahead=False, requests=one)
    assert got == want
    # 3 tokens, 3 decode passes: the first builds the second ahead, the second the third; the
    # third, at the last token, builds none (a fourth would be past max_tokens)
    assert (ahead.ahead_built, ahead.ahead_taken, ahead.ahead_dropped) == (2, 2, 0)


# Repeated n-grams: prompt lookup drafts from the first steps; the random model's tokens miss them.
LOOKUP = {"lookup": GenerationRequest([3, 4, 5, 3, 4, 5, 3, 4], 24, SamplingParams(temperature=0.0))}


def test_a_greedy_request_whose_drafts_miss_decodes_ahead_while_its_drafter_rests(tiny, monkeypatch):
    """Issue 54: a request with a cheap drafter stops verifying drafts after a miss (the
    back-off), and while it rests its rows are built ahead as a plain request's are. Its tokens
    are those of the same request drafting without passes built ahead, and of it without
    drafts. Control: where a drafting request never decodes ahead (as before), no pass is built
    ahead of it."""
    from lockstep.server.engine.decoding.token_steps import SpeculativeSource

    plain, _ = decode(tiny, ahead=False, requests=LOOKUP)
    drafting, _ = decode(tiny, ahead=False, requests=LOOKUP, speculative="prompt_lookup")
    got, ahead = decode(tiny, ahead=True, requests=LOOKUP, speculative="prompt_lookup")
    assert got == drafting and got["lookup"][0] == plain["lookup"][0] and len(got["lookup"][0]) == 24
    assert ahead.ahead_taken >= 12 and ahead.ahead_dropped <= 1
    monkeypatch.setattr(SpeculativeSource, "decodes_ahead", lambda self: False)
    again, never = decode(tiny, ahead=True, requests=LOOKUP, speculative="prompt_lookup")
    assert again == drafting and never.ahead_built == 0


def test_a_request_whose_prediction_is_used_up_decodes_ahead_as_a_plain_one(tiny, monkeypatch):
    """Issue 54: a cheap drafter with no guess (here a Predicted Output of the answer's first 4
    tokens, used up after them) verifies nothing, so its rows are built ahead as a plain
    request's are; its tokens are those of the same request without passes built ahead and
    of it without drafts. Control: where a drafter without a guess is not taken as resting
    (as before), its passes after the prediction are not built ahead."""
    from lockstep.server.engine.decoding.token_steps import SpeculativeSource

    prompt = [3, 4, 5, 6]
    plain, _ = decode(tiny, ahead=False, requests={"p": GenerationRequest(prompt, 24, SamplingParams(temperature=0.0))})
    answer = plain["p"][0]
    assert len(answer) == 24
    predicted = {"p": GenerationRequest(prompt, 24, SamplingParams(temperature=0.0), prediction=tuple(answer[:4]))}
    drafting, _ = decode(tiny, ahead=False, requests=predicted, prediction=True)
    got, ahead = decode(tiny, ahead=True, requests=predicted, prediction=True)
    assert got == drafting and got["p"][0] == answer
    assert ahead.ahead_taken >= 16 and ahead.ahead_dropped <= 1
    monkeypatch.setattr(SpeculativeSource, "__setattr__", _keep_guessing)
    again, before = decode(tiny, ahead=True, requests=predicted, prediction=True)
    assert again == drafting and before.ahead_taken <= 4


def _keep_guessing(self, name, value):
    """The rule before: a drafter without a guess was not resting."""
    object.__setattr__(self, name, True if name == "_guessing" else value)


def test_a_row_built_ahead_verifies_no_drafts_in_its_pass(tiny):
    """The pass after one whose next row was built ahead drafts nothing (so it can take the row
    over), whatever the drafter's policy says meanwhile; the pass after that drafts again."""
    from lockstep.server.engine.decoding.request_state import RequestState

    deployment = Deployment(kv_pool="kernel", prefill_chunk=8)
    plan = plan_request(deployment, deterministic=False, speculative="prompt_lookup", num_draft_tokens=3)
    state = RequestState(tiny, LOOKUP["lookup"], plan=plan, deployment=deployment)
    assert state.draft_length() == 1  # the back-off's first guess
    state.row_built_ahead()
    assert state.draft_length() == 1  # the pass now running is not the one built ahead
    state.source.context.append(7)  # its token reached the host: the next pass is the one built ahead
    assert state.draft_length() == 0 and state.source.draft_length() == 1
    state.source.context.append(8)
    assert state.draft_length() == 1


def test_deterministic_requests_decoded_ahead_keep_their_solo_bits():
    """Deterministic requests share canonical passes built ahead, under a backend whose native
    matmul bits change with the pass's width (tests/doubles/shape_variant.py): each answer
    equals that request decoded alone, one pass at a time, bit for bit; the same requests with
    plain plans do not (the negative control)."""
    from lockstep.kernels.batching.ragged import enable_ragged
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.server.engine.guarantee.deployment import proven_deployment
    from tests.doubles.shape_variant import shape_variant_backend
    from tests.test_deterministic_double import peaked_llama

    model = peaked_llama()
    enable_ragged(model)
    loaded = TinyLoaded(model)
    requests = {name: GenerationRequest(prompt, tokens, SamplingParams(temperature=0.9, seed=seed, top_logprobs=2))
                for name, prompt, tokens, seed in (("a", [3, 4, 5], 10, 1), ("b", [6, 7], 7, 2), ("c", [8], 4, 3))}
    with pool_kernel_double(), shape_variant_backend():
        deployment = replace(proven_deployment(model, set_batch_invariant_limit(model, 4), kv_pool="kernel",
                                               pass_rows=4), prefill_chunk=8)
        assert deployment.guarantee.guaranteed and deployment.guarantee.shared_passes and deployment.guarantee.compiled_canonical_passes
        solo, plain_solo = {}, {}
        for name, request in requests.items():
            solo.update(decode(loaded, False, {name: request}, deployment, deterministic=True)[0])
            plain_solo.update(decode(loaded, False, {name: request}, deployment)[0])
        together, ahead = decode(loaded, True, requests, deployment, deterministic=True)
        plain, _ = decode(loaded, True, requests, deployment)
    set_batch_invariant_limit(model, 0)
    assert together == solo
    assert ahead.ahead_taken == 9  # 10 decode passes, every one after the first built ahead
    assert plain != plain_solo


def test_deterministic_drafting_requests_decoded_ahead_keep_their_solo_bits():
    """Deterministic requests drafting by prompt lookup, sampled with logprobs and greedy, share
    canonical passes and are decoded ahead while their drafters rest (their one row sampled in
    the pass's batches): each answer equals that request decoded alone, one pass at a time, bit
    for bit, under a backend whose native bits change with the pass's width; the same requests
    with plain plans do not (the negative control)."""
    from lockstep.kernels.batching.ragged import enable_ragged
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.server.engine.guarantee.deployment import proven_deployment
    from tests.doubles.shape_variant import shape_variant_backend
    from tests.test_deterministic_double import peaked_llama

    model = peaked_llama()
    enable_ragged(model)
    loaded = TinyLoaded(model)
    requests = {"a": GenerationRequest([3, 4, 3, 4, 3], 12, SamplingParams(temperature=0.9, seed=1, top_logprobs=2)),
                "b": GenerationRequest([6, 7, 6, 7], 10, SamplingParams(temperature=0.0, top_logprobs=2)),
                "c": GenerationRequest([8, 9, 8, 9], 8, SamplingParams(temperature=0.0))}
    with pool_kernel_double(), shape_variant_backend():
        deployment = replace(proven_deployment(model, set_batch_invariant_limit(model, 4), kv_pool="kernel",
                                               pass_rows=8), prefill_chunk=8)
        solo, plain_solo = {}, {}
        for name, request in requests.items():
            solo.update(decode(loaded, False, {name: request}, deployment, deterministic=True,
                               speculative="prompt_lookup")[0])
            plain_solo.update(decode(loaded, False, {name: request}, deployment, speculative="prompt_lookup")[0])
        together, ahead = decode(loaded, True, requests, deployment, deterministic=True, speculative="prompt_lookup")
        plain, _ = decode(loaded, True, requests, deployment, speculative="prompt_lookup")
    set_batch_invariant_limit(model, 0)
    assert together == solo
    assert ahead.ahead_taken >= 3
    assert plain != plain_solo


def test_serve_decode_ahead_reaches_the_deployment():
    import argparse

    from lockstep.server.commands.runtime_args import options_from_args
    from lockstep.server.commands.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert options_from_args(parser.parse_args([])).decode_ahead is True
    assert options_from_args(parser.parse_args(["--decode-ahead", "off"])).decode_ahead is False
    assert Deployment().decode_ahead is True
