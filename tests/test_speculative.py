"""Speculative decoding core: drafters and the verify step, on a tiny random llama."""
import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from server.engine.speculative import DraftModelDrafter, PromptLookupDrafter, verify_step


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
        step = verify_step(forward, cache, context[-1], drafter.propose(context, k), greedy)
        drafted += step.drafted
        accepted += step.accepted
        context.extend(step.tokens)
        out.extend(step.tokens)
        # the cache holds KV for every context token except the newest one
        assert cache[0].offset == len(context) - 1
    del logits
    return out[:n], drafted, accepted


def test_prompt_lookup_proposes_continuation_of_latest_match():
    drafter = PromptLookupDrafter(max_ngram=2)
    assert drafter.propose([5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6], 3) == [9, 2, 5]
    assert drafter.propose([1, 2, 3], 4) == []


def test_verify_step_trims_rejected_rows():
    model = tiny_llama(0)
    cache = make_prompt_cache(model)
    forward = forward_fn(model, cache)
    forward([1, 2, 3])
    step = verify_step(forward, cache, 4, [90, 91, 92], lambda row, i: 7)  # rejects all drafts
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
