"""The startup self-test: it must pass only when block rows are bitwise their solo rows, and
say where they were not."""
import mlx.core as mx
import pytest

from tests.doubles.shape_variant import shape_variant_backend
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.ops import Strategy
from lockstep.kernels.batching.ragged_selftest import per_request_self_test
from lockstep.kernels.invariance.selftest import bits_equal, sample_widths, self_test
from tiny_models import tiny_llama


def test_bits_equal_is_bitwise():
    a = mx.array([0.0, 1.5, -2.0])
    assert bits_equal(a, mx.array([0.0, 1.5, -2.0]))
    assert not bits_equal(a, mx.array([-0.0, 1.5, -2.0]))  # == would call these equal
    assert not bits_equal(a, a.astype(mx.bfloat16).astype(mx.float32) + 1e-7)
    assert not bits_equal(a, a[:2])
    assert bits_equal(a.astype(mx.bfloat16), a.astype(mx.bfloat16))


def test_sample_widths_always_has_two_and_the_limit():
    assert sample_widths(1) == ()
    assert sample_widths(5) == (2, 3, 4, 5)
    for limit in (8, 9, 32, 100):
        widths = sample_widths(limit)
        assert widths[0] == 2 and widths[-1] == limit and 8 in widths and len(widths) <= 8


@pytest.mark.reference_blas
def test_passes_on_the_plain_cpu_backend():
    # Native CPU is shape-invariant; this is no evidence for the mechanism (see below).
    result = self_test(tiny_llama(), 4, prefixes=(7,))
    assert result.passed and result.reason == "ok" and result.widths == (2, 3, 4)


def test_fails_under_the_double_and_says_where():
    with shape_variant_backend():
        result = self_test(tiny_llama(), 4, prefixes=(7,))
    assert not result.passed and not result
    first = result.mismatches[0]
    assert (first.prefix, first.width, first.row, first.what) == (7, 2, 0, "logits")
    assert first.max_abs_diff > 0
    assert "width 2" in result.reason


def test_every_mismatch_can_be_listed():
    with shape_variant_backend():
        result = self_test(tiny_llama(), 3, prefixes=(7,), stop_at_first=False)
    kinds = {m.what for m in result.mismatches}
    assert "logits" in kinds and "layer 0 keys" in kinds
    assert {m.width for m in result.mismatches} == {2, 3}


def test_quantized_chunks_must_stay_below_the_variant_row_count():
    model = tiny_llama(quant="affine")
    with shape_variant_backend(quantized_rows=8):
        # chunks of <= 7 rows keep each row on the per-row kernel: proven up to L = 9
        assert set_batch_invariant_limit(model, 9, "strided_gemv", prefixes=(7,)).guaranteed
        # negative control: chunks of 8 rows are one variant call, caught at width 8
        greedy = Strategy("greedy", dense="strided_gemv", quantized_rows=8, attention="per_query")
        invariance = set_batch_invariant_limit(model, 9, greedy, prefixes=(7,))
        assert not invariance.guaranteed
        assert invariance.self_test.mismatches[0].width == 8


def test_attention_alone_is_caught():
    # Canonical linears with native attention still differ: the test sees attention too.
    half = Strategy("linears_only", dense="rowwise", quantized_rows=1, attention="native")
    with shape_variant_backend():
        invariance = set_batch_invariant_limit(tiny_llama(), 4, half, prefixes=(7,))
    assert not invariance.guaranteed


def test_refuses_a_sliding_window_cache():
    result = self_test(tiny_llama(sliding=True), 4, prefixes=(7,))
    assert not result.passed and result.reason.startswith("cache: layer 0: RotatingKVCache")


def test_longer_prefix_is_tested_too():
    # Mismatches only at the second prefix length are still found.
    with shape_variant_backend():
        result = self_test(tiny_llama(), 2, prefixes=(1, 30), stop_at_first=False)
    assert {m.prefix for m in result.mismatches} == {1, 30}


@pytest.mark.parametrize("limit", [0, 1])
def test_nothing_to_prove_is_not_a_pass(limit):
    assert not self_test(tiny_llama(), limit).passed


def test_a_sliding_window_model_is_proven_for_one_row_per_request():
    """A block of a sliding-window layer is not its one-row calls (above), but each request's
    decode row beside other requests' rows is its solo row: that is what is proven instead."""
    model = tiny_llama(sliding=True)
    with shape_variant_backend():
        native = per_request_self_test(model, 4, prefixes=(7, 12), stop_at_first=False)
        assert not native.passed and {m.width for m in native.mismatches} == {2, 3, 4}
        assert {m.what for m in native.mismatches} >= {"logits", "layer 1 state"}  # the full-attention layer's KV
        invariance = set_batch_invariant_limit(model, 4, "strided_gemv", prefixes=(7, 12),
                                         per_request_proof=per_request_self_test)
    assert invariance.guaranteed and invariance.request_rows == 1 and invariance.call_rows == 4
    assert invariance.per_request_state.startswith("layer 0: RotatingKVCache") and "one row per request" in invariance.reason
    assert invariance.self_test.widths == (2, 3, 4) and invariance.self_test.prefixes == (7, 12)
    set_batch_invariant_limit(model, 0)


def test_the_per_request_proof_is_kept_apart_from_the_block_proof(tmp_path):
    from lockstep.kernels.invariance.selftest import ProofCache
    from lockstep.kernels.verdict_cache import VerdictCache

    store = VerdictCache("selftest", root=tmp_path)
    proofs = ProofCache(store, {"weights": "tiny"})
    model = tiny_llama(sliding=True)
    set_batch_invariant_limit(model, 3, "strided_gemv", verify=False)
    with shape_variant_backend():
        first = per_request_self_test(model, 3, prefixes=(7,), proof_cache=proofs)
        again = per_request_self_test(model, 3, prefixes=(7,), proof_cache=proofs)
        block = self_test(model, 3, prefixes=(7,), proof_cache=proofs)
    assert first.passed and not first.cached and again.passed and again.cached
    assert not block.passed and not block.cached and block.reason.startswith("cache:")
    set_batch_invariant_limit(model, 0)
