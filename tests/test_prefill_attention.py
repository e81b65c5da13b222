"""Long causal prompt chunks on the CPU attend in blocks of query rows
(kernels/invariance/prefill_attention.py): the same attention, less of the masked triangle computed."""
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from lockstep.kernels.batching.ragged import enable_ragged
from lockstep.kernels.invariance.prefill_attention import BLOCK, blocked_causal, wants_blocks
from tests.test_deterministic_double import peaked_llama


def sdpa(q, k, v, mask=None, scale=0.125):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def test_blocks_compute_causal_attention_for_chunks_after_a_cached_prefix():
    for prefix, rows in ((0, 3 * BLOCK + 5), (40, 2 * BLOCK + 1)):
        key = mx.random.key(prefix + rows)
        q = mx.random.normal((1, 4, rows, 16), key=key)
        k = mx.random.normal((1, 2, prefix + rows, 16), key=mx.random.split(key)[0])
        v = mx.random.normal((1, 2, prefix + rows, 16), key=mx.random.split(key)[1])
        whole = sdpa(q, k, v, mask="causal")
        assert wants_blocks(q, k, "causal") and not wants_blocks(q[:, :, :BLOCK], k, "causal")
        assert mx.allclose(blocked_causal(sdpa, q, k, v), whole, atol=1e-5).item()


def test_the_models_prefill_goes_through_blocks_and_keeps_its_function():
    model = peaked_llama()
    tokens = mx.array([[(7 * i) % 90 + 3 for i in range(3 * BLOCK)]])
    plain = model(tokens, cache=make_prompt_cache(model))  # the model's own attention
    enable_ragged(model)  # routes the model's attention name through lockstep's hook
    calls = []
    import lockstep.kernels.invariance.layers as layers

    original = layers.blocked_causal
    layers.blocked_causal = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        hooked = model(tokens, cache=make_prompt_cache(model))
    finally:
        layers.blocked_causal = original
    assert calls, "a chunk of 3 blocks should attend in blocks"
    assert mx.allclose(hooked, plain, atol=1e-4).item()
