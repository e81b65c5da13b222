"""Batch invariance: canonical ops, the model-level switch, cache checks, aligned prefill.

The CPU backend is natively shape-invariant, so every claim is also shown under the
shape-variant test double (tests/doubles/shape_variant.py), where the native path must diverge.
"""
import gc

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import base as mlx_base
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import llama

from tests.doubles.shape_variant import shape_variant_backend
from lockstep.kernels.invariance.limit import (
    installed_invariance,
    cache_invariance_problem,
    set_batch_invariant_limit,
    uncovered_parts,
)
from lockstep.kernels.invariance.layers import Setting, _sdpa_users, batch_invariant, invariant_sdpa
from lockstep.kernels.invariance.ops import ROWWISE, attention_per_query, dense_rows, quantized_rows
from lockstep.kernels.invariance.prefill import prefill
from lockstep.kernels.invariance.selftest import bits_equal, self_test
from tiny_models import QUANT_MODES, tiny_llama

CANONICAL = ("rowwise", "strided_gemv")


def rand(*shape, seed=0):
    return mx.random.normal(shape, key=mx.random.key(seed))


# -- one-line proofs, per canonical op: f(a)[:1] == f(a[:1]) -------------------------------

@pytest.mark.parametrize("form", CANONICAL)
@pytest.mark.parametrize("variant", [False, True])
def test_dense_row_is_its_solo_result(form, variant):
    a, w = rand(9, 128), rand(64, 128, seed=1)
    with shape_variant_backend() if variant else _nothing():
        assert bits_equal(dense_rows(a, w, form)[:1], dense_rows(a[:1], w, form))


@pytest.mark.reference_blas
def test_native_dense_row_diverges_under_the_double():
    a, w = rand(9, 128), rand(64, 128, seed=1)
    with shape_variant_backend():
        assert not bits_equal((a @ w.T)[:1], a[:1] @ w.T)
    assert bits_equal((a @ w.T)[:1], a[:1] @ w.T)  # and the CPU itself is invariant


@pytest.mark.parametrize("mode", sorted(QUANT_MODES))
def test_quantized_row_is_its_solo_result_in_every_mode(mode):
    group_size, bits = QUANT_MODES[mode]
    a = rand(9, 128)
    w, scales, *biases = mx.quantize(rand(64, 128, seed=1), group_size, bits, mode=mode)
    biases = biases[0] if biases else None
    kw = dict(group_size=group_size, bits=bits, mode=mode)

    def f(x, rows):
        return quantized_rows(x, w, scales, biases, rows_per_call=rows, **kw)

    with shape_variant_backend():
        for rows in (1, 7):
            assert bits_equal(f(a, rows)[:1], f(a[:1], rows))
        # negative control: one call of 9 rows is not the single-row result
        native = lambda x: mx.quantized_matmul(x, w, scales, biases, transpose=True, **kw)
        assert not bits_equal(native(a)[:1], native(a[:1]))


def _attention_inputs(t=5, s=12):
    q = rand(1, 4, t, 32)
    k, v = rand(1, 2, s, 32, seed=1), rand(1, 2, s, 32, seed=2)
    return q, k, v


def _sdpa(q, k, v, mask=None):
    return mlx_base.scaled_dot_product_attention(q, k, v, cache=None, scale=32**-0.5, mask=mask)


def test_attention_query_is_its_decode_call():
    q, k, v = _attention_inputs()
    first = k.shape[2] - q.shape[2]
    with shape_variant_backend():
        block = attention_per_query(_sdpa, q, k, v, mask="causal")
        for i in range(q.shape[2]):
            decode = _sdpa(q[:, :, i : i + 1], k[:, :, : first + i + 1], v[:, :, : first + i + 1])
            assert bits_equal(block[:, :, i : i + 1], decode)
        # negative control: the native causal block differs from the decode call
        native = _sdpa(q, k, v, mask="causal")
        assert not bits_equal(native[:, :, :1], _sdpa(q[:, :, :1], k[:, :, : first + 1], v[:, :, : first + 1]))
    # the per-query form computes the same attention as the native block (sanity)
    assert mx.allclose(block, _sdpa(q, k, v, mask="causal"), atol=1e-5)


def test_attention_wrapper_stays_native_on_a_rotating_cache():
    q, k, v = _attention_inputs()
    rotating = mlx_cache.RotatingKVCache(max_size=8)
    with shape_variant_backend(), batch_invariant(Setting(8, ROWWISE)):
        got = invariant_sdpa(q, k, v, cache=rotating, scale=32**-0.5, mask="causal")
        assert bits_equal(got, _sdpa(q, k, v, mask="causal"))
        assert not bits_equal(invariant_sdpa(q, k, v, cache=None, scale=32**-0.5, mask="causal"), got)


# -- the model-level switch -----------------------------------------------------------------

MODELS = {
    "dense": dict(),
    "dense_bias_tied": dict(tied=True, bias=True),
    "affine_tied": dict(tied=True, quant="affine"),
    "mxfp4": dict(quant="mxfp4"),
    "nvfp4_tied": dict(tied=True, quant="nvfp4"),
    "mxfp8": dict(quant="mxfp8"),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_block_equals_single_under_the_double_only_with_the_limit(name):
    model = tiny_llama(**MODELS[name])
    with shape_variant_backend():
        assert not self_test(model, 4, prefixes=(7,)).passed  # negative control: native diverges
        for strategy in CANONICAL:
            invariance = set_batch_invariant_limit(model, 4, strategy, prefixes=(7,))
            assert invariance.guaranteed, invariance.reason
        set_batch_invariant_limit(model, 0)
        assert not self_test(model, 4, prefixes=(7,)).passed  # L = 0 is native again


def test_rows_beyond_the_limit_run_native():
    model = tiny_llama()
    with shape_variant_backend():
        set_batch_invariant_limit(model, 3, "rowwise", verify=False)
        assert self_test(model, 3, prefixes=(7,), widths=(3,)).passed
        assert not self_test(model, 4, prefixes=(7,), widths=(4,)).passed


def test_bf16_model_under_the_double():
    model = tiny_llama(dtype=mx.bfloat16, tied=True)
    with shape_variant_backend():
        assert not self_test(model, 4, prefixes=(7,)).passed
        assert set_batch_invariant_limit(model, 4, "strided_gemv", prefixes=(7,)).guaranteed


@pytest.mark.reference_blas
def test_auto_picks_a_proven_strategy_and_records_why():
    model = tiny_llama(quant="affine")
    with shape_variant_backend():
        invariance = set_batch_invariant_limit(model, 9, prefixes=(7,))
    assert invariance.guaranteed and invariance.strategy in CANONICAL
    assert invariance.backend == str(mx.default_device()) and invariance.call_rows == 9
    tried = {name: passed for name, passed, _ in invariance.candidates}
    assert tried == {"native": False, "strided_gemv": True}  # first proven in speed order
    assert invariance.strategy == "strided_gemv" and "failed: ['native']" in invariance.reason
    assert installed_invariance(model) is invariance


@pytest.mark.reference_blas
def test_auto_can_measure_every_candidate():
    model = tiny_llama()
    with shape_variant_backend():
        invariance = set_batch_invariant_limit(model, 3, measure=True, prefixes=(7,))
    assert invariance.guaranteed and invariance.strategy in CANONICAL and "measured fastest" in invariance.reason
    assert [(n, ok) for n, ok, _ in invariance.candidates] == [("native", False), ("strided_gemv", True), ("rowwise", True)]
    assert all(s > 0 for n, ok, s in invariance.candidates if ok)


@pytest.mark.reference_blas
def test_auto_on_the_plain_cpu_keeps_native():
    invariance = set_batch_invariant_limit(tiny_llama(), 4, prefixes=(7,))
    assert invariance.strategy == "native" and invariance.guaranteed and invariance.layers.get("InvariantLinear") is None


def test_an_unproven_strategy_is_not_claimed():
    model = tiny_llama()
    with shape_variant_backend():
        invariance = set_batch_invariant_limit(model, 4, "native", prefixes=(7,))
    assert not invariance.guaranteed and "self-test failed" in invariance.reason
    assert invariance.self_test.mismatches[0].width == 2


def test_canonical_logits_match_native_numerically():
    model = tiny_llama(bias=True, tied=True)
    tokens = mx.arange(10)[None]
    native = model(tokens)
    set_batch_invariant_limit(model, 16, "strided_gemv", verify=False)
    assert mx.allclose(model(tokens), native, atol=1e-4)


def test_limit_zero_restores_the_model_and_install_is_idempotent():
    gc.collect()  # models other tests left installed no longer hold the attention wrapper
    model = tiny_llama(tied=True)
    tokens = mx.arange(6)[None]
    before = model(tokens)
    first = set_batch_invariant_limit(model, 4, "rowwise", verify=False)
    second = set_batch_invariant_limit(model, 4, "rowwise", verify=False)
    assert first.layers == second.layers == {"InvariantLinear": 14, "InvariantEmbedding": 1, "attention_modules": 1}
    assert llama.scaled_dot_product_attention is invariant_sdpa
    off = set_batch_invariant_limit(model, 0)
    assert off.call_rows == 0 and not off.guaranteed
    assert type(model) is llama.Model
    assert not [n for n, m in model.named_modules() if type(m).__name__.startswith("Invariant")]
    assert type(model.layers[0].self_attn.q_proj) is nn.Linear
    assert type(model.model.embed_tokens) is nn.Embedding
    # the name goes back unless another live model (batched requests) still uses the wrapper
    others = [ref for ref in _sdpa_users.get(llama.__name__, {}).values() if ref() is not None]
    expected = invariant_sdpa if others else mlx_base.scaled_dot_product_attention
    assert llama.scaled_dot_product_attention is expected
    assert bits_equal(model(tokens), before)


def test_a_model_without_the_limit_stays_native_beside_one_with_it():
    with_limit, without = tiny_llama(), tiny_llama(seed=1)
    with shape_variant_backend():
        assert set_batch_invariant_limit(with_limit, 4, "rowwise", prefixes=(7,)).guaranteed
        assert not self_test(without, 4, prefixes=(7,)).passed
    set_batch_invariant_limit(with_limit, 0)


# -- MoE experts (mlx-lm's SwitchGLU / SwitchMLP: gather_mm, gather_qmm) ----------------------

def _experts(block, mode):
    mx.random.seed(3)
    experts = block(128, 64, 4)
    if mode is not None:
        group_size, bits = QUANT_MODES[mode]
        nn.quantize(experts, group_size=group_size, bits=bits, mode=mode)
    mx.eval(experts.parameters())
    return experts


@pytest.mark.parametrize("block", ["SwitchGLU", "SwitchMLP"])
@pytest.mark.parametrize("mode", [None, "affine", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("rows", [5, 40])  # 40 rows x 2 experts: mlx-lm sorts the rows by expert
def test_each_token_row_of_the_experts_is_its_decode_call(block, mode, rows):
    from mlx_lm.models import switch_layers
    from lockstep.kernels.invariance.layers import LAYER_SWAPS

    native_class = getattr(switch_layers, block)
    experts = _experts(native_class, mode)
    x = rand(1, rows, 128, seed=4)
    inds = mx.random.randint(0, 4, (1, rows, 2), key=mx.random.key(5))

    def decode(i):  # the call a one-row decode makes: x (1, 1, D), indices (1, 1, k)
        return experts(x[:, i:i + 1], inds[:, i:i + 1])

    with shape_variant_backend():
        native = experts(x, inds)
        assert not all(bits_equal(native[:, i:i + 1], decode(i)) for i in range(rows))  # negative control
        experts.__class__ = LAYER_SWAPS[native_class]
        with batch_invariant(Setting(rows, ROWWISE)):
            block_rows = experts(x, inds)
            assert block_rows.shape == native.shape == (1, rows, 2, 128)
            for i in range(rows):
                assert bits_equal(block_rows[:, i:i + 1], decode(i))
        with batch_invariant(Setting(rows - 1, ROWWISE)):  # more rows than L: the native call
            assert bits_equal(experts(x, inds), native)
    assert mx.allclose(block_rows, native, atol=1e-4)


def _tiny_moe(family):
    from tests.model_families import tiny_family

    return tiny_family(family)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_models_are_covered_and_proven_only_with_the_expert_rows(family):
    from mlx_lm.models.switch_layers import SwitchGLU

    model = _tiny_moe(family)
    assert uncovered_parts(model) == ()
    with shape_variant_backend():
        assert not self_test(model, 4, prefixes=(7,)).passed  # native diverges
        invariance = set_batch_invariant_limit(model, 4, "strided_gemv", prefixes=(7,))
        assert invariance.guaranteed and invariance.request_rows == 4, invariance.reason
        assert invariance.layers["InvariantSwitchGLU"] == 2
        # negative control: every other form installed, the experts back to their own call
        experts = [m for _, m in model.named_modules() if isinstance(m, SwitchGLU)]
        for m in experts:
            m.__class__ = SwitchGLU
        result = self_test(model, 4, prefixes=(7,))
        assert not result.passed and result.mismatches[0].width == 2
    set_batch_invariant_limit(model, 0)


def test_switch_linear_a_model_calls_itself_is_not_covered():
    from mlx_lm.models.switch_layers import SwitchLinear

    model = _tiny_moe("mixtral")
    model.layers[0].block_sparse_moe.own_experts = SwitchLinear(128, 64, 4, bias=False)
    parts = uncovered_parts(model)
    assert len(parts) == 1 and "own_experts" in parts[0] and "outside mlx-lm's SwitchGLU" in parts[0]
    invariance = set_batch_invariant_limit(model, 4, "rowwise", prefixes=(5,))
    assert not invariance.guaranteed and "uncovered" in invariance.reason
    set_batch_invariant_limit(model, 0)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss", "granitemoehybrid"])
def test_top_k_ties_break_the_same_way_alone_and_batched(family):
    """Routing is one argpartition row per token (MLX's CPU kernel: a strict order on (value,
    index) per row; its CUDA kernel: one block per row, chosen by the expert count): with
    two experts tied at the top-k boundary a row routes, and mixes its experts, exactly as alone."""
    model = _tiny_moe(family)
    moe = next(m for _, m in model.named_modules()
               if type(m).__name__ in ("MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "MLPBlock",
                                        "GraniteMoeHybridMoE"))
    router = next(m for n, m in moe.named_modules()
                  if isinstance(m, nn.Linear) and n in ("gate", "router", "router.layer"))
    w = router.weight[1:2]
    # gates (2g, g, g, -g): experts 1 and 2 tie, and the tie is always at the top-2 boundary
    router.weight = mx.concatenate([2 * w, w, w, -w], axis=0)
    if "bias" in router:
        router.bias = mx.zeros_like(router.bias)
    x = rand(1, 6, 128, seed=6)
    gates = router(x)
    assert bits_equal(gates[..., 1], gates[..., 2])
    top = mx.argpartition(gates, kth=-2, axis=-1)[0, :, -2:].tolist()
    assert all((1 in t) != (2 in t) for t in top)  # every row's tie decides which expert it gets
    for kth in (1, -2):  # mixtral's argpartition(-g, kth=k-1), the others' argpartition(g, kth=-k)
        batched = mx.argpartition(-gates if kth == 1 else gates, kth=kth, axis=-1)
        for i in range(6):
            alone = mx.argpartition(-gates[:, i:i + 1] if kth == 1 else gates[:, i:i + 1], kth=kth, axis=-1)
            assert mx.array_equal(batched[:, i:i + 1], alone).item()
    with shape_variant_backend():  # installed on the backend it runs on (the expert form is proven there)
        set_batch_invariant_limit(model, 6, "rowwise", verify=False)
    with shape_variant_backend(), batch_invariant(model._lockstep_setting):
        together = moe(x)
        for i in range(6):
            assert bits_equal(together[:, i:i + 1], moe(x[:, i:i + 1]))
    set_batch_invariant_limit(model, 0)


def test_dense_llama_has_nothing_uncovered():
    assert uncovered_parts(tiny_llama(quant="affine", tied=True)) == ()


# -- caches ---------------------------------------------------------------------------------

def test_cache_check_names_what_breaks_the_guarantee():
    assert cache_invariance_problem([mlx_cache.KVCache(), mlx_cache.KVCache()]) is None
    assert cache_invariance_problem(tiny_llama().make_cache()) is None
    rotating = cache_invariance_problem(tiny_llama(sliding=True).make_cache())
    assert rotating.startswith("layer 0: RotatingKVCache") and "sliding" in rotating
    assert "quantized" in cache_invariance_problem([mlx_cache.KVCache(), mlx_cache.QuantizedKVCache()])
    assert "left-pads" in cache_invariance_problem([mlx_cache.BatchKVCache([0])])
    nested = mlx_cache.CacheList(mlx_cache.KVCache(), mlx_cache.RotatingKVCache(max_size=4))
    assert "RotatingKVCache" in cache_invariance_problem([nested])


def test_per_request_state_narrows_the_guarantee_and_only_odd_caches_refuse_it():
    from lockstep.kernels.invariance.cache_check import cache_refusal, per_request_state

    sliding = tiny_llama(sliding=True).make_cache()
    assert per_request_state(sliding) == "layer 0: RotatingKVCache (a sliding window)"
    assert cache_refusal(sliding) is None  # runs per request: proven for one row per request
    recurrent = [mlx_cache.ArraysCache(2), mlx_cache.KVCache()]
    assert per_request_state(recurrent) == "layer 0: ArraysCache (recurrent or conv state)"
    assert cache_refusal(recurrent) is None and "recurrent" in cache_invariance_problem(recurrent)
    assert per_request_state(tiny_llama().make_cache()) is None
    assert "quantized" in cache_refusal([mlx_cache.KVCache(), mlx_cache.QuantizedKVCache()])
    assert "left-pads" in cache_refusal([mlx_cache.BatchRotatingKVCache(8, [0])])
    assert "CacheList" in cache_refusal([mlx_cache.CacheList(mlx_cache.KVCache(), mlx_cache.ArraysCache(1))])


# -- aligned prefill ------------------------------------------------------------------------

def _kv(cache):
    return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache]


def _same_kv(a, b):
    return all(bits_equal(x, y) for (xk, xv), (yk, yv) in zip(a, b) for x, y in ((xk, yk), (xv, yv)))


def _cold_and_cached(model, tokens, cached, chunk, decode_prefix=False):
    cold = model.make_cache()
    cold_logits = prefill(model, tokens, cold, chunk=chunk)
    warm = model.make_cache()
    if decode_prefix:  # the prefix came from one-token decode steps
        for t in tokens[:cached]:
            mx.eval(model(t.reshape(1, 1), cache=warm))
    else:
        prefill(model, tokens[:cached], warm, chunk=chunk)
    warm_logits = prefill(model, tokens, warm, start=cached, chunk=chunk)
    return (cold_logits, _kv(cold)), (warm_logits, _kv(warm))


@pytest.mark.parametrize("canonical", [True, False])
def test_prefix_cached_prefill_equals_cold_prefill_under_the_double(canonical):
    model = tiny_llama(quant="affine")
    tokens = mx.random.randint(0, 256, (13,), key=mx.random.key(3))
    with shape_variant_backend():
        if canonical:
            assert set_batch_invariant_limit(model, 4, "strided_gemv", prefixes=(7,)).guaranteed
        for cached in (1, 4, 6, 12, 13):
            (cl, ckv), (wl, wkv) = _cold_and_cached(model, tokens, cached, chunk=4)
            assert bits_equal(cl, wl), cached
            assert _same_kv(ckv, wkv), cached
            assert all(c[0].shape[2] == 13 for c in wkv)
        # negative control: an unaligned continuation diverges from the cold prefill
        set_batch_invariant_limit(model, 0)
        naive = model.make_cache()
        mx.eval(model(tokens[None, :6], cache=naive))
        naive_logits = model(tokens[None, 6:], cache=naive)[0, -1]
        assert not bits_equal(naive_logits, cl)


def test_decoded_prefix_equals_cold_prefill_only_with_canonical_rows():
    model = tiny_llama()
    tokens = mx.random.randint(0, 256, (11,), key=mx.random.key(4))
    with shape_variant_backend():
        assert set_batch_invariant_limit(model, 4, "rowwise", prefixes=(7,)).guaranteed
        (cl, ckv), (wl, wkv) = _cold_and_cached(model, tokens, 6, chunk=4, decode_prefix=True)
        assert bits_equal(cl, wl) and _same_kv(ckv, wkv)
        set_batch_invariant_limit(model, 0)
        (cl, ckv), (wl, wkv) = _cold_and_cached(model, tokens, 6, chunk=4, decode_prefix=True)
        assert not _same_kv(ckv, wkv)  # negative control: decode KV != chunked native KV


def test_prefill_checks_its_arguments():
    model = tiny_llama()
    cache = model.make_cache()
    with pytest.raises(ValueError):
        prefill(model, mx.arange(5), cache, start=2)
    with pytest.raises(ValueError):
        prefill(model, mx.arange(0), cache)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_packed_kv_keeps_the_values_and_pads_256_multiples_only_for_cuda(monkeypatch):
    from lockstep.kernels import custom
    from lockstep.kernels.invariance import ops

    x = mx.random.normal((1, 3, 256, 8))
    padded, pad = [], mx.pad
    monkeypatch.setattr(ops.mx, "pad", lambda a, widths: padded.append(widths) or pad(a, widths))
    assert mx.array_equal(ops.packed_kv(x), x) and not padded  # the CPU: a packed copy
    monkeypatch.setattr(custom, "backend", lambda: "cuda")
    out = ops.packed_kv(x)
    assert out.shape == x.shape and mx.array_equal(out, x) and padded == [[(0, 0), (0, 0), (0, 1), (0, 0)]]
    ops.packed_kv(x[:, :, :255])
    assert len(padded) == 1  # other key counts are not padded
