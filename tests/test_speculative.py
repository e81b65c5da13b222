"""Speculative decoding core (speculative.py): the verify step, the k policy and the draft
backoff, with draft models and early-exit drafts, on a tiny random llama. The drafters that
propose from text (prompt lookup, a prediction) are tests/test_drafters.py's."""
import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from lockstep.server.engine.decoding.drafters import DraftModelDrafter
from lockstep.server.engine.decoding.speculative import AdaptiveDraftLength, accept_drafts
from lockstep.server.engine.decoding.request_report import RequestReport


def tiny_llama(seed: int, layers: int = 2) -> llama.Model:
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def forward_fn(model, cache):
    return lambda tokens: model(mx.array(tokens)[None], cache=cache)[0]


def verify(forward, cache, last_token, drafts, choose):
    """The target's pass over [last_token, *drafts], then its agreeing prefix kept."""
    return accept_drafts(forward([last_token, *drafts]), cache, drafts, choose)


def greedy(row, _i):
    return int(mx.argmax(row).item())


def plain_greedy(model, prompt, n):
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits).item())
        out.append(token)
        logits = model(mx.array([token])[None], cache=cache)[0, -1]
    return out


def speculative_greedy(model, drafter, prompt, n, k):
    cache = make_prompt_cache(model)
    forward = forward_fn(model, cache)
    logits = forward(prompt[:-1]) if len(prompt) > 1 else None  # KV for all but the last token
    context, out = list(prompt), []
    drafted = accepted = 0
    while len(out) < n:
        step = verify(forward, cache, context[-1], drafter.propose(context, k), greedy)
        drafted += step.drafted
        accepted += step.accepted
        context.extend(step.tokens)
        out.extend(step.tokens)
        # the cache holds KV for every context token except the newest one
        assert cache[0].offset == len(context) - 1
    del logits
    return out[:n], drafted, accepted



def test_accept_drafts_trims_rejected_rows():
    model = tiny_llama(0)
    cache = make_prompt_cache(model)
    forward = forward_fn(model, cache)
    forward([1, 2, 3])
    step = verify(forward, cache, 4, [90, 91, 92], lambda row, i: 7)  # rejects all drafts
    assert step.tokens == [7] and step.accepted == 0
    assert cache[0].offset == 4


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_equals_plain_with_draft_model(k):
    target, draft = tiny_llama(0), tiny_llama(1, layers=1)
    prompt = [3, 14, 15, 92, 65, 35]
    plain = plain_greedy(target, prompt, 12)
    spec, drafted, _ = speculative_greedy(target, DraftModelDrafter(draft), prompt, 12, k)
    assert spec == plain and drafted > 0


def test_speculative_with_target_as_draft_accepts_everything():
    target = tiny_llama(0)
    _, drafted, accepted = speculative_greedy(target, DraftModelDrafter(target), [1, 2, 3], 9, 2)
    assert drafted > 0 and accepted == drafted


# ------------------------------------------------------------ adaptive k

def test_adaptive_k_is_zero_when_a_pass_costs_its_rows_and_grows_when_passes_are_flat():
    linear = AdaptiveDraftLength(7)  # no table: k + 1 rows cost k + 1 steps (the CPU)
    flat = AdaptiveDraftLength(7, pass_costs=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7])
    for _ in range(20):
        linear.record(4, 4)
        flat.record(4, 4)
    assert linear.choose() == 0  # even at full acceptance drafts cannot beat one row per step
    assert flat.choose() == 7
    ks = []
    for _ in range(40):  # drafts stop paying: k falls to 0
        flat.record(4, 0)
        ks.append(flat.choose())
    assert ks[-1] == 0 and ks == sorted(ks, reverse=True)


def test_adaptive_k_probes_an_expensive_drafter_less_often_after_failed_probes():
    policy = AdaptiveDraftLength(4, pass_costs=[1.0, 1.1, 1.2, 1.3, 1.4], draft_cost=0.5)
    for _ in range(10):
        policy.record(4, 0)
    probes = []
    for step in range(200):
        k = policy.choose(probe=True)
        if k:
            probes.append(step)
            policy.record(1, 0, probed=True)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes and gaps == sorted(gaps) and gaps[-1] > gaps[0]


def _adaptive_run(model, prompt, n, step_fn=None, room=lambda i: None, k=4, costs=(1.0, 1.0, 1.0, 1.0, 1.0)):
    """Greedy adaptive prompt lookup: (tokens, k per step, passes, logits rows' bytes)."""
    import numpy as np
    from lockstep.server.engine.decoding.sampling import SamplingParams
    from lockstep.server.engine.decoding.token_steps import DecodeInputs, Speculation, SpeculationStats, make_source

    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    stats = SpeculationStats()
    source = make_source(DecodeInputs(cache, list(prompt), SamplingParams(temperature=0.0)), stats,
                         Speculation("prompt_lookup", k, adaptive=True, pass_costs=list(costs)))
    tokens, ks, rows_bytes, i = [], [], [], 0
    while len(tokens) < n:
        rows = source.rows(room(i))
        ks.append(len(rows) - 1)
        logits = step_fn(cache, rows) if step_fn else model(mx.array(rows)[None], cache=cache)[0]
        for s in source.take(logits):
            tokens.append(s.sampled.token)
            rows_bytes.append(np.array(s.logits).tobytes())
        i += 1
    return tokens[:n], ks, stats.passes, rows_bytes[:n]


REPEATING = [3, 14, 15, 92, 65, 35, 3, 14, 15, 92, 65, 35, 3, 14, 15]


@pytest.mark.reference_blas
def test_adaptive_k_depends_only_on_the_requests_own_history_not_on_its_batch():
    """The same request, alone and sharing ragged passes with others that change every step:
    the same k at every step, and bit-identical tokens and logits rows."""
    import random

    from lockstep.kernels.batching.ragged import enable_ragged, ragged_forward

    model = tiny_llama(0)
    enable_ragged(model)
    alone = _adaptive_run(model, REPEATING, 24)
    rng = random.Random(1)
    neighbours = []
    for _ in range(3):
        c = make_prompt_cache(model)
        model(mx.array([rng.randrange(97) for _ in range(rng.randrange(2, 9))])[None], cache=c)
        neighbours.append(c)

    def batched(cache, rows):
        others = [(c, [rng.randrange(97) for _ in range(rng.randrange(1, 4))])
                  for c in rng.sample(neighbours, rng.randrange(0, 4))]
        members = others[:1] + [(cache, rows)] + others[1:]
        return ragged_forward(model, members)[min(1, len(others))]

    together = _adaptive_run(model, REPEATING, 24, batched)
    assert max(alone[1]) > 0  # it did speculate
    assert together[1] == alone[1]  # the same k at every step
    assert together[0] == alone[0] and together[3] == alone[3]


@pytest.mark.reference_blas
def test_a_full_batch_cuts_drafts_but_never_changes_the_tokens():
    """The batch-full hook (rows(room)) is the one input to k from outside the request: it
    changes how many drafts a step verifies, hence the passes, never a token or logits bit."""
    model = tiny_llama(0)
    free = _adaptive_run(model, REPEATING, 24)
    crowded = _adaptive_run(model, REPEATING, 24, room=lambda i: 1 if i % 3 else 2)
    assert crowded[0] == free[0] and crowded[3] == free[3]
    assert max(crowded[1]) <= 1 < max(free[1])
    assert crowded[2] > free[2]  # more passes for the same tokens


# ------------------------------------------------------------ self-speculation

def test_early_exit_draft_shares_the_targets_weights_and_keeps_speculation_exact():
    from lockstep.server.engine.decoding.drafters import EarlyExitModel

    target = tiny_llama(0, layers=3)
    draft = EarlyExitModel(target, 1)
    assert draft.layers[0] is target.model.layers[0] and len(make_prompt_cache(draft)) == 1
    prompt = [3, 14, 15, 92, 65, 35]
    spec, drafted, _ = speculative_greedy(target, DraftModelDrafter(draft), prompt, 12, 3)
    assert spec == plain_greedy(target, prompt, 12) and drafted > 0
    with pytest.raises(ValueError, match="exit layer"):
        EarlyExitModel(target, 3)


def test_early_exit_wrapper_given_every_layer_reproduces_the_target_bitwise():
    """The wrapper's embedding, mask, norm and head are the target's own: with all layers
    put back it must give the target's logits exactly."""
    from lockstep.server.engine.decoding.drafters import EarlyExitModel

    target = tiny_llama(0, layers=3)
    full = EarlyExitModel(target, 2)
    full.layers = list(target.model.layers)  # all layers: must reproduce the target bitwise
    tokens = mx.array([[5, 6, 7, 8]])
    import numpy as np

    assert np.array_equal(np.array(full(tokens)), np.array(target(tokens)))


def test_adaptive_k_keeps_acceptance_per_match_class():
    policy = AdaptiveDraftLength(4, pass_costs=[1.0, 1.1, 1.2, 1.3, 1.4])
    for _ in range(30):
        policy.record(4, 4, kind=2)  # long matches: always right
        policy.record(4, 0, kind=0)  # one-token matches: always wrong
    assert policy.choose(kind=2) == 4 and policy.choose(kind=0) == 0
    assert policy.choose(kind=1) == policy.best_k(kind=1) > 0  # no evidence yet: the prior (p = 0.3)
    costly = AdaptiveDraftLength(7, pass_costs=[1.0] + [1.95] * 7)  # the H200's 2..8-row passes
    assert costly.choose(kind=3) == 0  # the prior alone never pays for a pass that costs ~2 rows


def test_plans_carry_adaptive_k_from_the_deployment_with_k_as_its_bound():
    from lockstep.server.engine.guarantee.decode_plan import plan_request
    from lockstep.server.engine.guarantee.deployment import Deployment
    from lockstep.server.engine.guarantee.guarantee import Guarantee
    from lockstep.server.engine.decoding.drafters import EarlyExitModel
    from lockstep.server.engine.decoding.token_steps import draft_cost_estimate

    on = Deployment(guarantee=Guarantee(6, proven=True), adaptive_draft_tokens=True)
    plan = plan_request(on, deterministic=True, speculative="prompt_lookup", num_draft_tokens=None)
    assert plan.adaptive and plan.num_draft_tokens == 4
    assert RequestReport.planned(plan, on).render()["adaptive_draft_tokens"]
    assert not plan_request(on, deterministic=False, speculative="none", num_draft_tokens=None).adaptive
    off = plan_request(Deployment(guarantee=Guarantee(6, proven=True)), deterministic=True, speculative="prompt_lookup",
                       num_draft_tokens=3)
    assert not off.adaptive and "adaptive_draft_tokens" not in RequestReport.planned(off, Deployment()).render()
    target = tiny_llama(0, layers=3)
    assert draft_cost_estimate(target, EarlyExitModel(target, 1)) == pytest.approx(1 / 3)


# ------------------------------------------------ a cheap drafter backs off when its drafts fail

VOCAB = 50


class ScriptedDrafter:
    """A cheap drafter guessing the target's tokens `TRUTH` at positions where `right(pos)`,
    a wrong token elsewhere: acceptance is what the test says it is."""

    name, cheap = "scripted", True

    def __init__(self, right):
        self.right = right

    def propose(self, context, k, cancelled=None):
        pos = len(context)
        return [truth(p) if self.right(p) else (truth(p) + 1) % VOCAB for p in range(pos, pos + k)]


def truth(pos: int) -> int:
    return (pos * 7) % VOCAB


def _scripted_run(right, n: int = 40, k: int = 4, backoff: bool = True):
    """Greedy decoding of n tokens whose target always picks truth(position), drafts from a
    ScriptedDrafter, the default policy (no adaptive speculation): (stats, drafts per step)."""
    from mlx_lm.models.cache import KVCache

    from lockstep.server.engine.decoding.sampling import SamplingParams
    from lockstep.server.engine.decoding.token_steps import SpeculationStats, SpeculativeSource

    context = [truth(p) for p in range(5)]
    stats = SpeculationStats()
    source = SpeculativeSource([KVCache()], context, SamplingParams(temperature=0.0), ScriptedDrafter(right), k,
                               stats, remaining=lambda: n + 5 - len(context), backoff=backoff)
    ks = []
    while len(context) < n + 5:
        rows = source.rows()
        ks.append(len(rows) - 1)
        base = len(context)  # row i chooses the token at position base + i
        logits = mx.stack([mx.eye(VOCAB)[truth(base + i)] for i in range(len(rows))])
        source.take(logits)
    assert context == [truth(p) for p in range(n + 5)]  # drafts never change the answer
    return stats, ks


def test_drafts_that_keep_failing_stop_being_verified():
    stats, ks = _scripted_run(lambda pos: False)
    # the first guess is one draft; found wrong, shadow drafts only after it
    assert stats.drafted == 1 and stats.accepted == 0
    assert ks[0] == 1 and set(ks[1:]) == {0}
    assert stats.passes == 40


def test_drafting_resumes_once_shadow_drafts_agree_again():
    wrong = range(15, 25)
    stats, ks = _scripted_run(lambda pos: pos not in wrong)
    # drafts grow 1, 3, k while accepted; the wrong stretch costs one failed verification (k
    # wasted rows); the first shadow draft that agrees again (position 25) brings one draft
    # back on the next step, growing again
    assert stats.drafted - stats.accepted == 4
    assert ks == [1, 3, 4, 4] + [0] * 9 + [1, 3, 4, 4, 2]


def test_without_the_backoff_every_step_verifies_k_drafts():
    """`serve --draft-backoff off`: the behaviour the back-off replaces, kept for comparison."""
    stats, ks = _scripted_run(lambda pos: False, backoff=False)
    assert set(ks[:-4]) == {4} and stats.accepted == 0 and stats.passes == 40


def test_draft_backoff_flag_defaults_on():
    import argparse

    from lockstep.server.commands.runtime_args import add_determinism_arguments, add_model_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    add_determinism_arguments(parser)
    assert options_from_args(parser.parse_args([])).draft_backoff is True
    assert options_from_args(parser.parse_args(["--draft-backoff", "off"])).draft_backoff is False
