"""The shared KV pool (kernels/batching/kv_pool.py) and its pooled attention (kernels/custom/attention.py).

On the CPU there is no custom-kernel API, so the pool runs its reference form (one MLX
attention call per row); the GPU kernel's order of work is checked here through its NumPy
model (kernels/custom/attention_order.py), its bits on the H200 (bench/results/cuda/).
"""
import mlx.core as mx
import numpy as np
import pytest

from lockstep.kernels.batching.kv_pool import KVPool, fill_prefix, written_kv
from lockstep.kernels.batching.pool_mode import pool_mode
from lockstep.kernels.batching.ragged import enable_ragged, ragged_forward
from lockstep.kernels.batching.ragged_selftest import prove_ragged
from lockstep.kernels.custom.attention import PoolRows, kernel_unavailable_reason, pooled_attention
from lockstep.kernels.custom.attention_order import TILE, WARPS, attention_row, tile_schedule
from tests.doubles.shape_variant import shape_variant_backend
from lockstep.kernels.invariance import set_batch_invariant_limit
from tests.test_deterministic_double import peaked_llama

LIMIT = 8


@pytest.fixture(scope="module")
def model():
    m = peaked_llama()
    enable_ragged(m)
    return m


def bits(x: mx.array) -> bytes:
    return np.array(x.astype(mx.float32)).tobytes()


# ------------------------------------------------------------------------- row writes

@pytest.mark.parametrize("starts", [[7], [3, 40, 90], [10, 11]])
def test_a_pass_writes_each_rows_kv_to_its_own_slot(model, starts):
    """Consecutive slots (one request, or requests that follow on) take a slice write, the
    others put_along_axis; both must leave exactly what an indexed assignment would."""
    from lockstep.kernels.batching.ragged import PooledPass

    pool = KVPool(model, 128)
    caches = [pool.allocate(12) for _ in starts]
    for cache, start in zip(caches, starts):  # place each range where the case wants it
        cache[0].span.start = start
    where = PooledPass([c[0] for c in caches], [1] * len(starts))
    assert (where.first_slot is not None) == (starts in ([7], [10, 11]))
    hkv, _, dim = pool.keys[0].shape
    keys = mx.random.normal((hkv, len(starts), dim), key=mx.random.key(1)).astype(pool.keys[0].dtype)
    values = keys * 2
    expect_k, expect_v = mx.array(pool.keys[0]), mx.array(pool.values[0])
    expect_k[:, mx.array(starts)] = keys
    expect_v[:, mx.array(starts)] = values
    pool.write_rows(0, where, keys, values)
    assert bits(pool.keys[0]) == bits(expect_k) and bits(pool.values[0]) == bits(expect_v)


# ------------------------------------------------------------------------- the allocator

def test_ranges_are_first_fit_released_once_and_merged(model):
    pool = KVPool(model, 100)
    a, b, c = pool.allocate(30), pool.allocate(30), pool.allocate(30)
    assert [x[0].span.start for x in (a, b, c)] == [0, 30, 60]
    pool.release(b)
    pool.release(b)  # idempotent: a request dropped twice gives its range back once
    assert pool.free_slots == 40
    d = pool.allocate(20)
    assert d[0].span.start == 30  # first fit: the hole b left
    pool.release(a)
    pool.release(d)
    pool.release(c)
    assert pool.free_slots == pool.capacity == 100
    assert pool.allocate(100)[0].span.start == 0  # merged back into one range


def test_the_pool_grows_when_no_range_fits_and_keeps_what_it_holds(model):
    pool = KVPool(model, 16)
    first = pool.allocate(10)
    model(mx.array([[3, 4, 5, 6]]), cache=first)
    before = [bits(c.state[0]) + bits(c.state[1]) for c in first]
    second = pool.allocate(40)  # does not fit in 16: the pool doubles (at least)
    assert pool.capacity >= 50 and second[0].span.start >= 10
    assert [bits(c.state[0]) + bits(c.state[1]) for c in first] == before


def test_a_request_cannot_write_past_its_reservation(model):
    pool = KVPool(model, 64)
    cache = pool.allocate(3)
    with pytest.raises(ValueError, match="outgrew its reservation"):
        model(mx.array([[1, 2, 3, 4]]), cache=cache)


def test_prefix_copies_and_clones_are_bit_exact(model):
    from mlx_lm.models.cache import make_prompt_cache

    pool = KVPool(model, 64)
    plain = make_prompt_cache(model)
    model(mx.array([[7, 8, 9, 10, 11]]), cache=plain)
    pooled = pool.allocate(20)
    fill_prefix(pooled, plain, 4)
    assert pooled[0].offset == 4
    for p, q in zip(pooled, plain):
        assert bits(p.state[0]) == bits(q.keys[..., :4, :]) and bits(p.state[1]) == bits(q.values[..., :4, :])
    twin = pool.clone(pooled)
    assert twin[0].span.start != pooled[0].span.start
    assert all(bits(a.state[0]) == bits(b.state[0]) for a, b in zip(twin, pooled))


def test_a_request_in_a_pool_range_takes_a_cached_prefix_and_leaves_the_entry_as_it_was(model):
    """RequestState given a pool range copies a prefix hit's KV in (bit for bit) straight from the
    entry; its own prefill and decoding write the range, never the entry."""
    from mlx_lm.models.cache import make_prompt_cache

    from lockstep.server.engine.cache.prefix_cache import PrefixCache
    from lockstep.server.engine.decoding.request_state import GenerationRequest, RequestState
    from lockstep.server.engine.decoding.sampling import SamplingParams
    from tests.deterministic_fixtures import TinyLoaded

    loaded = TinyLoaded(model)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    plain = make_prompt_cache(model)
    model(mx.array([prompt[:5]]), cache=plain)
    mx.eval([c.state for c in plain])
    pc = PrefixCache(4)
    pc.store(prompt[:5], plain)
    entry = pc.find(prompt[:5], private=False).cache  # the entry's own arrays
    before = [(bits(c.keys[..., :5, :]), bits(c.values[..., :5, :])) for c in entry]
    pool = KVPool(model, 64)
    state = RequestState(loaded, GenerationRequest(prompt_tokens=prompt, max_tokens=2,
                                                   sampling=SamplingParams(temperature=0.0)),
                         prefix_cache=pc, cache=pool.allocate(16))
    assert state.cached_tokens == 5 and state.cache[0].offset == 5
    for p, c in zip(state.cache, entry):
        assert bits(p.state[0]) == bits(c.keys[..., :5, :]) and bits(p.state[1]) == bits(c.values[..., :5, :])
    model(mx.array([prompt[5:]]), cache=state.cache)  # the range grows past the prefix
    pool.write(0, state.cache[0].span.start, mx.zeros_like(state.cache[0].state[0][0]),
               mx.zeros_like(state.cache[0].state[1][0]))  # and its start overwritten
    mx.eval([p.state for p in state.cache])
    assert [(bits(c.keys[..., :5, :]), bits(c.values[..., :5, :])) for c in entry] == before


def test_what_a_shared_pass_evaluates_is_each_pools_arrays_once_and_other_caches_layers(model):
    """written_kv: the pool's per-layer arrays once for all its ranges (their writes, not 2 views a
    layer a request), each layer's state for a cache outside a pool."""
    from mlx_lm.models.cache import make_prompt_cache

    pool, other = KVPool(model, 64), KVPool(model, 64)
    a, b, c = pool.allocate(8), pool.allocate(8), other.allocate(8)
    model(mx.array([[5, 6, 7]]), cache=a)
    model(mx.array([[8, 9]]), cache=b)
    plain = make_prompt_cache(model)
    model(mx.array([[5, 6]]), cache=plain)
    got = written_kv([a, b, c, plain])
    want = pool.keys + pool.values + other.keys + other.values
    rest = [x for x in got if isinstance(x, tuple)]  # a layer's state: (keys, values)
    pooled = [x for x in got if not isinstance(x, tuple)]
    assert len(pooled) == len(want) and all(x is y for x, y in zip(sorted(pooled, key=id), sorted(want, key=id)))
    assert len(rest) == len(plain) and all(r[0] is layer.keys and r[1] is layer.values for r, layer in zip(rest, plain))
    mx.eval(got)
    for cache, n in ((a, 3), (b, 2)):  # every range holds what its pass wrote
        assert all(layer.offset == n and layer.state[0].shape[2] == n for layer in cache)


# ----------------------------------------------------------- the kernel's order of work

@pytest.mark.parametrize("length", [1, 31, 32, 33, 127, 128, 129, 200, 513])
def test_the_tile_schedule_covers_every_key_once_in_an_order_fixed_by_the_length(length):
    schedule = tile_schedule(length)
    keys = [j for tiles in schedule for tile in tiles for j in tile]
    assert sorted(keys) == list(range(length))
    for w, tiles in enumerate(schedule):
        assert [t.start // TILE % WARPS for t in tiles] == [w] * len(tiles)
        assert [t.start for t in tiles] == sorted(t.start for t in tiles)
    assert schedule == tile_schedule(length)


def test_the_order_model_the_loader_and_both_kernel_sources_agree_on_the_warp_count():
    from pathlib import Path

    from lockstep.kernels.custom import attention

    assert attention.ATT_WARPS == WARPS and attention.THREADS == 32 * WARPS
    folder = Path(attention.__file__).parent
    assert f"constexpr int ATT_WARPS = {WARPS};" in (folder / "pooled_attention.cu").read_text()
    assert f"constant constexpr int ATT_WARPS = {WARPS};" in (folder / "pooled_attention.metal").read_text()


@pytest.mark.parametrize("length", [1, 31, 33, 129, 513])
def test_the_kernels_online_softmax_and_warp_combination_compute_attention(length):
    rng = np.random.default_rng(length)
    q, k, v = rng.normal(size=64), rng.normal(size=(length, 64)), rng.normal(size=(length, 64))
    scale = 64 ** -0.5
    s = k @ q * scale
    p = np.exp(s - s.max())
    want = (p / p.sum()) @ v
    assert np.allclose(attention_row(q, k, v, scale), want, rtol=1e-4, atol=1e-5)


def test_without_a_gpu_the_reference_form_runs_and_says_why():
    assert kernel_unavailable_reason() is not None  # the CPU has no custom-kernel API
    q = mx.random.normal((1, 4, 3, 16), key=mx.random.key(1))
    k = mx.random.normal((2, 40, 16), key=mx.random.key(2))
    v = mx.random.normal((2, 40, 16), key=mx.random.key(3))
    rows = PoolRows([0, 10, 10], [5, 7, 8])
    out = pooled_attention(q, k, v, rows, 0.25)
    for r, (start, length) in enumerate(zip(rows.base, rows.lens)):
        kk = np.repeat(np.array(k[:, start:start + length]), 2, axis=0)
        vv = np.repeat(np.array(v[:, start:start + length]), 2, axis=0)
        s = np.einsum("hd,hjd->hj", np.array(q[0, :, r]), kk) * 0.25
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("hj,hjd->hd", p / p.sum(-1, keepdims=True), vv)
        assert np.allclose(np.array(out[0, :, r]), want, atol=1e-5)


# ------------------------------------------------------------- pooled passes, bit for bit

def prefilled(pool, model, prompt, reserve=64):
    cache = pool.allocate(reserve)
    model(mx.array(prompt)[None], cache=cache)
    return cache


@pytest.mark.reference_blas
def test_a_pooled_pass_gives_each_request_its_solo_bits_and_the_model_its_own_function(model):
    from mlx_lm.models.cache import make_prompt_cache

    pool = KVPool(model, 256, use_kernel=False)
    prompts = [[1, 50, 2, 8], [5, 6, 7, 8, 9, 10, 11], [42]]
    rows = [[100], [101, 102, 103], [104]]
    caches = [prefilled(pool, model, p) for p in prompts]
    alone = [ragged_forward(model, [(pool.clone(c), r)])[0] for c, r in zip(caches, rows)]
    together = ragged_forward(model, list(zip(caches, rows)))
    for i in range(3):
        assert bits(together[i]) == bits(alone[i])
        plain = make_prompt_cache(model)
        model(mx.array(prompts[i])[None], cache=plain)
        assert mx.allclose(alone[i], model(mx.array(rows[i])[None], cache=plain)[0], atol=1e-4).item()


def test_the_ragged_proof_over_the_pool_passes_with_canonical_forms_and_fails_natively(model):
    with shape_variant_backend():
        native = prove_ragged(model, LIMIT, kv_pool="reference")
        assert not native and "differ" in native.reason  # negative control: the double varies
        invariance = set_batch_invariant_limit(model, LIMIT)
        assert invariance.guaranteed
        assert prove_ragged(model, LIMIT, kv_pool="reference")
    set_batch_invariant_limit(model, 0)


def test_pool_mode_on_the_cpu(model):
    assert pool_mode(model, "auto") == "off"  # no kernel here: today's per-request caches
    assert pool_mode(model, "on") == "reference"
    assert pool_mode(model, "off") == "off"
    with pytest.raises(ValueError, match="--kv-pool"):
        pool_mode(model, "always")


# ----------------------------------------------------- measuring as the engine decodes

def test_speculation_over_the_engine_path_is_exact_and_gives_its_ranges_back(model):
    from lockstep.server.tools.speed_ratios import decode
    from lockstep.server.engine.runner.model_runner import ModelRunner
    from lockstep.server.engine.decoding.speculative import measure_pass_costs

    path = ModelRunner.as_engine_runs(model, "reference")
    prompt = [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12]
    plain, _, _ = decode(model, prompt, 12, runner=path)
    spec, _, stats = decode(model, prompt, 12, "prompt_lookup", 3, runner=path)
    assert spec == plain and stats.drafted > 0
    costs = measure_pass_costs(model, 4, context=8, repeats=1, runner=path)
    assert len(costs) == 4 and costs == sorted(costs)
    assert path.kv_pool.free_slots == path.kv_pool.capacity


def test_the_kernels_smoke_test_refuses_a_wrong_kernel(monkeypatch):
    """On a GPU the kernel is checked per element type and head size against the reference
    form before the pool uses it; here a stand-in plays the kernel."""
    import lockstep.kernels.custom.attention as attention

    right = lambda q, k, v, rows, scale: attention.reference_attention(q, k, v, rows, scale)  # noqa: E731
    monkeypatch.setattr(attention, "kernel_attention", right)
    assert attention._smoke_test(mx.bfloat16, 128) is None
    monkeypatch.setattr(attention, "kernel_attention", lambda *a: right(*a) * 1.1)
    assert "disagrees" in attention._smoke_test(mx.float16, 64)


# ------------------------------------------------------------------- growth and memory

def test_the_pool_doubles_up_to_its_most_and_says_when_no_range_fits(model):
    from lockstep.kernels.batching.kv_pool import PoolFull

    pool = KVPool(model, 64, use_kernel=False, max_capacity=200)
    a = pool.allocate(100)
    assert pool.capacity == 164  # one request's need past a doubling
    pool.allocate(30)
    assert pool.can_allocate(60)  # 34 free at the end + 36 it may still grow
    pool.allocate(60)
    assert pool.capacity == 200  # doubling would pass the most: it stops there
    assert not pool.can_allocate(20)
    with pytest.raises(PoolFull):
        pool.allocate(20)
    pool.release(a)
    assert pool.can_allocate(100) and not pool.can_allocate(101)
    assert KVPool(model, 64, use_kernel=False).can_allocate(10_000)  # no most: it may always grow


def test_what_a_pass_wrote_is_read_out_of_the_pool_as_a_copy_not_a_view_of_its_buffer(model):
    """A view would keep the whole pool layer alive after the pool moves on: a proof holding
    each request's rows (one per width) then held a pool's worth of memory per request."""
    import gc

    from lockstep.kernels.invariance.selftest import new_state

    pool = KVPool(model, 100_000, use_kernel=False)
    cache = prefilled(pool, model, [1, 2, 3, 4])
    rows = new_state(cache, 2)
    mx.eval(rows)
    pool_bytes = sum(k.nbytes + v.nbytes for k, v in zip(pool.keys, pool.values))
    held = mx.get_active_memory()
    del cache, pool
    gc.collect()
    assert held - mx.get_active_memory() >= 0.9 * pool_bytes


def test_the_ragged_proof_over_the_pool_gives_back_each_widths_copies_and_never_grows_it(model, monkeypatch):
    grown = []
    real = KVPool._grow

    def counted(self, capacity):
        grown.append((self.capacity, capacity))
        real(self, capacity)

    monkeypatch.setattr(KVPool, "_grow", counted)
    assert set_batch_invariant_limit(model, LIMIT).guaranteed
    try:
        assert prove_ragged(model, LIMIT, kv_pool="reference", pass_rows=24)
    finally:
        set_batch_invariant_limit(model, 0)
    assert [g for g in grown if g[0]] == []  # only each pool's first sizing
