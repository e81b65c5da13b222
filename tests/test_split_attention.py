"""The plain passes' split attention (kernels/custom/split_attention.py): its order through
the NumPy model (kernels/custom/split_attention_order.py), what it takes, and that only a
pass with no row under the guarantee takes it (kv_pool.pass_attention). The kernel itself
runs on CUDA only: its smoke test there checks it against the reference form and a row alone
against the same row beside others; its timings are in
bench/results/history/2026-12-03-h200-one-row-step-split-attention-issue28.md."""
import mlx.core as mx
import numpy as np
import pytest

from lockstep.kernels.batching.kv_pool import KVPool
from lockstep.kernels.batching.ragged import enable_ragged
from lockstep.kernels.custom import split_attention
from lockstep.kernels.custom.attention import PoolRows
from lockstep.kernels.custom.split_attention_order import (LOADS, WARPS, attention_row, lanes_per_key,
                                                           pass_schedule)
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.layers import batch_invariant, native_forms
from tests.test_deterministic_double import peaked_llama


@pytest.mark.parametrize("slots", [1, 2, 4, 8])
@pytest.mark.parametrize("length", [1, 7, 8, 9, 31, 128, 129, 1000, 4097])
def test_the_schedule_takes_every_key_once_each_warp_in_increasing_passes(length, slots):
    schedule = pass_schedule(length, slots)
    assert len(schedule) == WARPS
    taken = [j for passes in schedule for in_slots in passes for keys in in_slots for j in keys]
    assert sorted(taken) == list(range(length))
    per_pass = slots * LOADS
    for w, passes in enumerate(schedule):
        firsts = [min(j for keys in in_slots for j in keys) for in_slots in passes]
        assert firsts == [p * per_pass for p in range(w, -(-length // per_pass), WARPS)]
        for in_slots in passes:  # slot s of a pass: every slots-th key from its own offset
            for s, keys in enumerate(in_slots):
                assert all(j % slots == s for j in keys) and keys == sorted(keys)


@pytest.mark.parametrize("dim, itemsize", [(128, 2), (64, 2), (128, 4), (256, 2), (32, 2)])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 300, 700])
def test_the_order_model_computes_softmax_attention(dim, itemsize, length):
    rng = np.random.default_rng(length + dim)
    q = rng.normal(size=dim).astype(np.float32)
    keys = rng.normal(size=(length, dim)).astype(np.float32)
    values = rng.normal(size=(length, dim)).astype(np.float32)
    scale = dim ** -0.5
    s = keys.astype(np.float64) @ q.astype(np.float64) * scale
    p = np.exp(s - s.max())
    want = (p / p.sum()) @ values.astype(np.float64)
    got = attention_row(q, keys, values, scale, itemsize)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_lanes_per_key_is_sixteen_bytes_a_lane():
    assert lanes_per_key(128, 2) == 16 and lanes_per_key(64, 2) == 8 and lanes_per_key(128, 4) == 32


def test_the_kernel_takes_keys_a_warp_holds_whole():
    assert split_attention.kernel_takes(mx.bfloat16, 128) and split_attention.kernel_takes(mx.float16, 64)
    assert split_attention.kernel_takes(mx.float32, 16) and split_attention.kernel_takes(mx.float32, 128)
    assert not split_attention.kernel_takes(mx.bfloat16, 16)    # 32 bytes
    assert not split_attention.kernel_takes(mx.float32, 256)    # 1024 bytes
    assert not split_attention.kernel_takes(mx.bfloat16, 72)    # 9 lanes a key: a warp would split one
    assert not split_attention.kernel_takes(mx.int32, 64)


@pytest.fixture(scope="module")
def model():
    m = peaked_llama()
    enable_ragged(m)
    return m


def test_off_cuda_the_pool_has_no_split_kernel_and_says_why(model):
    assert split_attention.kernel_unavailable_reason(mx.float32, 64) is not None
    assert KVPool(model, 32).split_kernel is False


def test_only_a_pass_with_no_row_under_the_guarantee_takes_the_split_kernel(model, monkeypatch):
    pool = KVPool(model, 32)
    pool.split_kernel = True  # as on a GPU whose smoke test passed
    calls = []

    def kernel(queries, k_pool, v_pool, rows, scale):
        calls.append(queries.shape)
        return mx.zeros(queries.shape, queries.dtype)

    monkeypatch.setattr(split_attention, "kernel_attention", kernel)
    heads, dim = model.args.num_attention_heads, pool.keys[0].shape[-1]
    pool.values[0] = mx.ones(pool.values[0].shape, pool.values[0].dtype)  # any other attention gives ones
    queries = mx.ones((1, heads, 2, dim), pool.keys[0].dtype)
    rows = PoolRows([0, 0], [1, 2])
    plain = pool.attention(0, queries, rows, dim ** -0.5)
    assert calls == [queries.shape] and not plain.any().item()
    pool.attention(0, queries, rows, dim ** -0.5, sinks=mx.zeros((heads,)))
    assert len(calls) == 1  # sinks: the pooled attention's reference form
    set_batch_invariant_limit(model, 4)
    try:
        with batch_invariant(model._lockstep_setting):
            canonical = pool.attention(0, queries, rows, dim ** -0.5)
            assert len(calls) == 1 and mx.all(canonical == 1).item()  # the pooled attention
            with native_forms():  # the engine's plain passes of a deployment with L > 0
                pool.attention(0, queries, rows, dim ** -0.5)
        assert len(calls) == 2
    finally:
        set_batch_invariant_limit(model, 0)


def test_the_smoke_test_fails_a_kernel_off_the_reference_or_whose_rows_meet(monkeypatch):
    """Its verdict decides whether plain passes take the kernel: it must pass a correct
    row-independent kernel (here the CPU stand-in) and fail a wrong one and one whose row
    depends on the rows beside it."""
    from tests.doubles.pool_kernel import masked_attention

    monkeypatch.setattr(split_attention, "kernel_attention", masked_attention)
    assert split_attention._smoke_test(mx.float32, 32) is None

    def off(queries, k_pool, v_pool, rows, scale):
        return masked_attention(queries, k_pool, v_pool, rows, scale) * 1.1

    monkeypatch.setattr(split_attention, "kernel_attention", off)
    assert "disagrees" in split_attention._smoke_test(mx.float32, 32)

    def meeting(queries, k_pool, v_pool, rows, scale):
        out = masked_attention(queries, k_pool, v_pool, rows, scale)
        return out + 1e-3 * (queries.shape[2] - 1)  # close to the reference, other bits with company

    monkeypatch.setattr(split_attention, "kernel_attention", meeting)
    assert "alone differs" in split_attention._smoke_test(mx.float32, 32)


def test_the_smoke_test_fails_blocks_of_two_heads_off_blocks_of_one(monkeypatch):
    """Blocks of two query heads (wide passes) must give blocks of one head's bits."""
    from tests.doubles.pool_kernel import masked_attention

    def paired_off(queries, k_pool, v_pool, rows, scale, per_block=None):
        out = masked_attention(queries, k_pool, v_pool, rows, scale)
        return out + 1e-2 if per_block == 2 else out

    monkeypatch.setattr(split_attention, "kernel_attention", paired_off)
    assert "blocks of two query heads differ" in split_attention._smoke_test(mx.bfloat16, 64)
    monkeypatch.setattr(split_attention, "kernel_attention",
                        lambda *args, per_block=None: masked_attention(*args))
    assert split_attention._smoke_test(mx.bfloat16, 64) is None


def test_wide_passes_pair_the_query_heads_of_a_kv_head():
    take = split_attention.heads_a_block
    wide = split_attention.PAIRED_HEADS_FROM_ROWS
    assert take(mx.bfloat16, 128, 4, wide) == 2 and take(mx.float16, 64, 2, wide + 9) == 2
    assert take(mx.bfloat16, 128, 4, wide - 1) == 1  # narrower passes: one head a block
    assert take(mx.bfloat16, 128, 3, wide) == 1  # an odd group
    assert take(mx.float32, 64, 4, wide) == 1 and take(mx.bfloat16, 256, 4, wide) == 1  # registers
    assert [t[-1] for _, t in split_attention.instances(mx.bfloat16, 128, 4)] == [("HG", 1), ("HG", 2)]
    assert [t[-1] for _, t in split_attention.instances(mx.bfloat16, 128, 3)] == [("HG", 1)]
    # a block a (query-head group, row): the grid shrinks by the heads a block takes
    for count, hg in ((16, 1), (32, 2)):
        launch = split_attention.launch_plan(mx.bfloat16, 128, 32, count, 8)
        assert dict(launch["template"])["HG"] == hg
        assert launch["grid"][0] == 32 // hg * count * split_attention.THREADS
