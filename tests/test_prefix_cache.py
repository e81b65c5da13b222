"""The prefix cache (server/engine/cache/prefix_cache.py) and prefix reuse inside generate().

A deterministic request's hit must not change a single bit: under the shape-variant double
(rows reduce differently when a call has several), generate() with a cached prefix, whole or
ending mid-chunk, gives the tokens, logprobs and decode logits of a cold run, with and without
batch invariance. A plain request's hit resumes where it ends.
"""
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

import lockstep.kernels.invariance.prefill as prefill_module
import lockstep.server.engine.generate as generate_module
import lockstep.server.engine.runner.model_runner as model_runner
from tests.doubles.shape_variant import shape_variant_backend
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.selftest import bits_equal
from lockstep.server.engine.guarantee.decode_plan import plan_request
from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.guarantee.guarantee import Guarantee
from lockstep.server.engine.generate import GenerationRequest
from lockstep.server.engine.cache.prefix_cache import PrefixCache
from lockstep.server.engine.decoding.request_state import RequestState
from tests.deterministic_fixtures import GREEDY, SEEDED, TinyLoaded, rows_bit_identical, run_generate
from tests.tiny_models import tiny_llama

CHUNK = 8


def lookup(pc: PrefixCache, tokens: list[int], namespace: str | None = None, **kwargs):
    """`PrefixCache.find`'s hit as (KV copy, length), or (None, 0)."""
    hit = pc.find(tokens, namespace, **kwargs)
    return (hit.cache, hit.length) if hit else (None, 0)


def filled_cache(n_layers=2, length=10, seed=0):
    """A KVCache list holding `length` positions of random K/V (B=1, 2 heads, dim 4)."""
    mx.random.seed(seed)
    cache = [KVCache() for _ in range(n_layers)]
    for c in cache:
        c.update_and_fetch(mx.random.normal((1, 2, length, 4)), mx.random.normal((1, 2, length, 4)))
    mx.eval([c.state for c in cache])
    return cache


# ------------------------------------------------------------------ PrefixCache itself

def test_empty_cache_misses():
    pc = PrefixCache(2)
    assert lookup(pc, [1, 2, 3]) == (None, 0)
    assert (pc.hits, pc.misses) == (0, 1)


def test_lookup_returns_a_private_copy_of_the_longest_shared_prefix():
    pc = PrefixCache(4)
    tokens = list(range(10))
    source = filled_cache(length=10)
    pc.store(tokens, source)
    pc.store([0, 1, 2, 99], filled_cache(length=4, seed=1))

    copy, n = lookup(pc, [0, 1, 2, 3, 4, 5, 7, 7])  # shares 6 with the first, 3 with the second
    assert n == 6 and (pc.hits, pc.misses) == (1, 0)
    for got, want in zip(copy, source):
        assert type(got) is KVCache and got.offset == 6
        assert got.keys.shape[2] % KVCache.step == 0  # buffer sized like a cold prefill's
        assert bits_equal(got.keys[..., :6, :], want.keys[..., :6, :])
        assert bits_equal(got.values[..., :6, :], want.values[..., :6, :])

    # writing into the copy leaves the stored snapshot untouched
    copy[0].keys[..., :6, :] = 0.0
    again, n2 = lookup(pc, tokens)
    assert n2 == 10 and bits_equal(again[0].keys[..., :10, :], source[0].keys[..., :10, :])

    # and the snapshot does not alias the cache it was stored from
    source[0].keys[..., :10, :] = 7.0
    third, _ = lookup(pc, tokens)
    assert not bits_equal(third[0].keys[..., :10, :], source[0].keys[..., :10, :])


def test_a_lookup_for_a_caller_that_copies_gets_the_entrys_own_arrays():
    """find(private=False) is for a KV pool range, which copies the hit in: no copy is made, and
    the arrays are the entry's, which later lookups still find unchanged."""
    pc = PrefixCache(4)
    tokens = list(range(10))
    source = filled_cache(length=10)
    pc.store(tokens, source)
    shared, n = lookup(pc, [0, 1, 2, 3, 4, 5, 7], private=False)
    private, _ = lookup(pc, [0, 1, 2, 3, 4, 5, 7])
    assert n == 6 and pc.hits == 2
    again, _ = lookup(pc, tokens, private=False)
    assert all(a is b for a, b in zip(shared, again))  # the entry itself, both times
    assert not any(a is b for a, b in zip(shared, private))  # the default: a copy of its own
    for got, want in zip(shared, source):
        assert bits_equal(got.keys[..., :6, :], want.keys[..., :6, :])


def test_lookup_with_nothing_in_common_misses():
    pc = PrefixCache(4)
    pc.store([5, 6, 7], filled_cache(length=3))
    assert lookup(pc, [1, 2, 3]) == (None, 0)
    copy, n = lookup(pc, [5, 6])  # a request shorter than the stored prompt
    assert n == 2 and copy[0].offset == 2


def test_lru_evicts_the_least_recently_used():
    pc = PrefixCache(2)
    pc.store([1, 1], filled_cache(length=2))
    pc.store([2, 2], filled_cache(length=2))
    lookup(pc, [1, 1, 5])  # [1, 1] is now the most recently used
    pc.store([3, 3], filled_cache(length=2))  # evicts [2, 2]
    assert lookup(pc, [2, 2])[1] == 0
    assert lookup(pc, [1, 1])[1] == 2 and lookup(pc, [3, 3])[1] == 2


def test_storing_the_same_prompt_again_refreshes_it():
    pc = PrefixCache(2)
    pc.store([1], filled_cache(length=1))
    pc.store([2], filled_cache(length=1))
    pc.store([1], filled_cache(length=1, seed=3))  # refresh, no growth
    pc.store([3], filled_cache(length=1))  # evicts [2]
    assert lookup(pc, [2])[1] == 0 and lookup(pc, [1])[1] == 1


def test_what_is_never_stored():
    off = PrefixCache(0)
    off.store([1, 2], filled_cache(length=2))
    assert lookup(off, [1, 2]) == (None, 0)
    pc = PrefixCache(2)
    pc.store([], filled_cache(length=0))
    rotating = [RotatingKVCache(max_size=8) for _ in range(2)]
    assert not PrefixCache.storable(rotating) and PrefixCache.storable(filled_cache(length=1))
    pc.store([1, 2], rotating)
    assert lookup(pc, [1, 2]) == (None, 0)


def test_an_entry_not_written_in_canonical_chunks_is_for_plain_requests_only():
    pc = PrefixCache(4)
    pc.store([1, 2, 3], filled_cache(length=3), canonical_length=0)
    assert lookup(pc, [1, 2, 3], canonical_only=True) == (None, 0)
    assert lookup(pc, [1, 2, 3])[1] == 3
    pc.store([1, 2], filled_cache(length=2, seed=4))
    assert lookup(pc, [1, 2, 3], canonical_only=True)[1] == 2  # the canonical one, though shorter


def test_a_request_that_writes_canonical_kv_reads_only_an_entrys_canonical_positions():
    """An entry written after a plain request's resume mid-chunk is canonical up to there: a
    deterministic request gets that far of it, a plain one all of it, and each hit says how
    far it is canonical."""
    pc = PrefixCache(4)
    pc.store([1, 2, 3, 4, 5], filled_cache(length=5), canonical_length=3)
    assert lookup(pc, [1, 2, 3, 4, 5, 6], canonical_only=True)[1] == 3
    hit = pc.find([1, 2, 3, 4, 5, 6])
    assert (hit.length, hit.canonical_length) == (5, 3)
    assert pc.find([1, 2, 9]).canonical_length == 2  # the common prefix, all of it canonical
    pc.store([1, 2, 3, 4], filled_cache(length=4, seed=4))  # shorter, all canonical: wins the canonical lookup
    assert lookup(pc, [1, 2, 3, 4, 5, 6], canonical_only=True)[1] == 4
    assert lookup(pc, [1, 2, 3, 4, 5, 6])[1] == 5


def test_a_canonical_entry_is_kept_when_a_plain_request_stores_the_same_prompt():
    pc = PrefixCache(4)
    canonical = filled_cache(length=3, seed=1)
    pc.store([1, 2, 3], canonical)
    pc.store([1, 2, 3], filled_cache(length=3, seed=2), canonical_length=1)
    copy, n = lookup(pc, [1, 2, 3], canonical_only=True)
    assert n == 3 and bits_equal(copy[0].keys[..., :3, :], canonical[0].keys[..., :3, :])
    pc.store([1, 2, 3], filled_cache(length=3, seed=3))  # as canonical: replaces it
    copy, n = lookup(pc, [1, 2, 3], canonical_only=True)
    assert n == 3 and not bits_equal(copy[0].keys[..., :3, :], canonical[0].keys[..., :3, :])


# ------------------------------------------------------------------ generate() with a hit

PROMPT = [(7 * i + 3) % 256 for i in range(29)]  # prompt[:-1] is 28 tokens: 3.5 chunks
# Shares 15 tokens: the hit ends mid-chunk (15 % 8 = 7) and a resumed prefill would feed
# position 15 alone (M = 1), where a cold prefill computes it in an 8-row chunk: under the
# double those differ, so only the rewind to the chunk start keeps the bits.
SHARED = PROMPT[:15] + [(5 * i + 1) % 256 for i in range(14)]
TOKENS = 10


@pytest.fixture(scope="module")
def tiny():
    return TinyLoaded(tiny_llama(seed=3))


@pytest.fixture
def invariance(tiny):
    """Install L on the tiny model inside the double (so the self-test has to prove a
    canonical strategy); back to native afterwards."""
    def install(limit):
        with shape_variant_backend():
            installed = set_batch_invariant_limit(tiny.model, limit)
        assert installed.guaranteed == (limit > 0), installed.reason
        return installed

    yield install
    set_batch_invariant_limit(tiny.model, 0)


def same_run(a, b):
    return (a.tokens == b.tokens and a.logprob_bits() == b.logprob_bits()
            and a.top_bits() == b.top_bits() and a.text == b.text
            and rows_bit_identical(sorted_rows(a), sorted_rows(b)))


def sorted_rows(run):
    return [run.decode_logits[p][-1] for p in sorted(run.decode_logits)]


def plans(deployment):
    """(deterministic plan, plain plan) under `deployment`."""
    det = plan_request(deployment, deterministic=True, speculative=None, num_draft_tokens=None)
    plain = plan_request(deployment, deterministic=False, speculative=None, num_draft_tokens=None)
    assert det.determinism != "none" and plain.determinism == "none"
    return det, plain


def cold_and_cached(tiny, prompt, sampling, warm_with, *, deployment, plan=None, warm_plan=None, calls=None):
    """(cold run, run after `warm_with` was prefilled into a prefix cache, cache stats); the
    warming request under `warm_plan` (default `plan`); `calls` (`prompt_calls`) cleared
    before the cached run."""
    cold = run_generate(tiny, prompt, TOKENS, sampling, plan=plan, deployment=deployment)
    pc = PrefixCache(4)
    run_generate(tiny, warm_with, 1, sampling, plan=warm_plan or plan, deployment=deployment, prefix_cache=pc)
    if calls is not None:
        calls.clear()
    cached = run_generate(tiny, prompt, TOKENS, sampling, plan=plan, deployment=deployment, prefix_cache=pc)
    return cold, cached, pc


@pytest.mark.parametrize("limit", [0, 4, CHUNK], ids=["native", "L<chunk", "L=chunk"])
@pytest.mark.parametrize("warm_with", ["same", "shared"])
def test_prefix_hit_is_bitwise_a_cold_run_under_the_double(tiny, invariance, limit, warm_with):
    installed = invariance(limit) if limit else None
    deployment = Deployment(guarantee=Guarantee.installed(installed) if installed else Guarantee(), prefill_chunk=CHUNK)
    det, _ = plans(deployment)
    warm = PROMPT if warm_with == "same" else SHARED
    with shape_variant_backend():
        cold, cached, pc = cold_and_cached(tiny, PROMPT, GREEDY, warm, deployment=deployment, plan=det)
        cold_s, cached_s, _ = cold_and_cached(tiny, PROMPT, SEEDED, warm, deployment=deployment, plan=det)
    assert pc.hits == 1 and pc.misses == 1
    assert len(cold.tokens) == TOKENS and len(set(cold.tokens)) > 1
    assert same_run(cold, cached)
    assert same_run(cold_s, cached_s)


@pytest.mark.parametrize("marked", ["as written", "all canonical"])
def test_a_plain_hit_resumes_where_it_ends_and_keeps_deterministic_requests_cold(tiny, invariance, monkeypatch, marked):
    """A plain request resumes where its hit ends (mid-chunk: nothing recomputed, its bits
    those of the narrower chunk), and the entry it leaves is canonical only up to there: a
    deterministic request with the same prompt afterwards still gets its cold bits. Negative
    control: marked canonical throughout, that entry changes the deterministic request's bits."""
    deployment = Deployment(guarantee=Guarantee.installed(invariance(4)), prefill_chunk=CHUNK)
    det, plain = plans(deployment)
    if marked == "all canonical":
        monkeypatch.setattr(RequestState, "_resumes_on_grid", lambda self, pos: True)
    with shape_variant_backend():
        cold = run_generate(tiny, PROMPT, TOKENS, GREEDY, plan=det, deployment=deployment)
        cold_plain = run_generate(tiny, PROMPT, TOKENS, GREEDY, plan=plain, deployment=deployment)
        pc = PrefixCache(4)
        run_generate(tiny, SHARED, 1, GREEDY, plan=plain, deployment=deployment, prefix_cache=pc)
        resumed = run_generate(tiny, PROMPT, TOKENS, GREEDY, plan=plain, deployment=deployment, prefix_cache=pc)
        after = run_generate(tiny, PROMPT, TOKENS, GREEDY, plan=det, deployment=deployment, prefix_cache=pc)
    assert pc.hits == 2
    assert not bits_equal(sorted_rows(resumed)[0], sorted_rows(cold_plain)[0])  # resumed at 15, not 8
    assert same_run(cold, after) == (marked == "as written")


def test_alignment_is_what_makes_a_mid_chunk_hit_exact(tiny, monkeypatch):
    """Negative control: pretend rows are canonical (no rewind to the chunk start) on the
    native model under the double, and a hit ending mid-chunk changes the bits."""
    deployment = Deployment(prefill_chunk=CHUNK)
    with shape_variant_backend():
        cold = run_generate(tiny, PROMPT, TOKENS, GREEDY, deployment=deployment)
        monkeypatch.setattr(prefill_module, "rows_are_canonical", lambda canonical, chunk: True)
        pc = PrefixCache(4)
        run_generate(tiny, SHARED, 1, GREEDY, deployment=deployment, prefix_cache=pc)
        unaligned = run_generate(tiny, PROMPT, TOKENS, GREEDY, deployment=deployment, prefix_cache=pc)
    assert pc.hits == 1
    assert not same_run(cold, unaligned)
    assert not bits_equal(sorted_rows(cold)[0], sorted_rows(unaligned)[0])


def prompt_calls(monkeypatch):
    """Records each prompt chunk's (start, rows); returns the list."""
    calls = []
    original = model_runner.prompt_forward

    def counting(model, cache, tokens):
        calls.append((cache[0].offset, len(tokens)))
        return original(model, cache, tokens)

    monkeypatch.setattr(model_runner, "prompt_forward", counting)
    return calls


def test_canonical_rows_skip_the_rewind(tiny, invariance, monkeypatch):
    """A deterministic request's hit resumes exactly where the cached prefix ends with L >=
    chunk (nothing is recomputed); with L < chunk or with no guarantee settled it resumes at the
    chunk start. A plain request's resumes where it ends, whatever L (native forms included)."""
    calls = prompt_calls(monkeypatch)

    def resume_point(deployment, *, deterministic=True):
        """Where the first prompt chunk after a prefix hit (SHARED cached) starts, and its rows."""
        plan = plans(deployment)[0 if deterministic else 1]
        pc = PrefixCache(2)
        run_generate(tiny, SHARED, 1, GREEDY, plan=plan, deployment=deployment, prefix_cache=pc)
        calls.clear()
        list(generate_module.generate(tiny, GenerationRequest(PROMPT, 1, GREEDY), plan=plan,
                                      deployment=deployment, prefix_cache=pc))
        return calls[0]

    def installed(limit, **settings):
        return Deployment(guarantee=Guarantee.installed(invariance(limit)), prefill_chunk=CHUNK, **settings)

    assert resume_point(installed(CHUNK)) == (15, 1)  # resumes at 15, fills up to the boundary at 16
    assert resume_point(installed(4)) == (8, 8)  # rewound to the chunk start, whole chunk recomputed
    # The model's forms are installed for L = chunk, but the deployment guarantees nothing (its
    # proofs have not settled): alignment follows the deployment's guarantee.
    invariance(CHUNK)
    assert resume_point(Deployment(guarantee=Guarantee(CHUNK), prefill_chunk=CHUNK)) == (8, 8)
    for deployment in (installed(4), installed(CHUNK, plain_prompt_native=True), Deployment(prefill_chunk=CHUNK)):
        assert resume_point(deployment, deterministic=False) == (15, 1)


# A chunk of 64 puts grid points at 16 and 32 (kernels/invariance/prefill.py): a prompt of 60
# (59 prefilled) runs [0, 16), [16, 32), [32, 59); one of 41 (40 prefilled) runs [0, 16), [16, 40).
WIDE = 64
LONG = [(11 * i + 5) % 256 for i in range(60)]
SHARES_40 = LONG[:40] + [(3 * i + 2) % 256 for i in range(20)]
SHORT_40 = LONG[:41]


@pytest.mark.parametrize("grid", ["halving", "uniform chunks"])
def test_a_short_shared_prefix_resumes_at_a_grid_point_below_one_chunk(tiny, invariance, monkeypatch, grid):
    """A deterministic request sharing 40 tokens with an earlier prompt, both shorter than a
    chunk, resumes at the grid point 32 and gets its cold bits. Negative control: cold prefills
    in whole chunks (the old grid) while hits still resume at 32 changes the bits, under a
    double whose GEMMs change between calls of up to 32 rows and wider ones, as GPU tiles do."""
    import lockstep.server.engine.decoding.request_state as request_state

    if grid == "uniform chunks":
        monkeypatch.setattr(request_state, "chunk_end",
                            lambda pos, n, chunk, **_: min(n, (pos // chunk + 1) * chunk))
    deployment = Deployment(guarantee=Guarantee.installed(invariance(4)), prefill_chunk=WIDE)
    det, _ = plans(deployment)
    calls = prompt_calls(monkeypatch)
    with shape_variant_backend(dense_rows=32):
        cold, cached, pc = cold_and_cached(tiny, LONG, GREEDY, SHARES_40, deployment=deployment, plan=det, calls=calls)
    assert pc.hits == 1 and calls[0] == (32, 27)
    assert same_run(cold, cached) == (grid == "halving")


@pytest.mark.parametrize("entry", ["as written", "canonical throughout"])
def test_an_entry_is_reused_only_up_to_its_last_chunks_start(tiny, invariance, monkeypatch, entry):
    """A 40-token prefill ran [16, 40) as one chunk, so its entry is canonical only up to 16: a
    longer prompt sharing all 40 resumes there, not at its own grid point 32, and gets its cold
    bits. Negative control: the entry marked canonical throughout changes them."""
    import lockstep.server.engine.decoding.request_state as request_state

    if entry == "canonical throughout":
        monkeypatch.setattr(request_state, "exact_length", lambda length, chunk, canonical, split_rows=0: length)
    deployment = Deployment(guarantee=Guarantee.installed(invariance(4)), prefill_chunk=WIDE)
    det, _ = plans(deployment)
    calls = prompt_calls(monkeypatch)
    with shape_variant_backend():
        cold, cached, pc = cold_and_cached(tiny, LONG, GREEDY, SHORT_40, deployment=deployment, plan=det, calls=calls)
    assert pc.hits == 1 and calls[0] == ((16, 16) if entry == "as written" else (32, 27))
    assert same_run(cold, cached) == (entry == "as written")


@pytest.mark.parametrize("plain_kv", ["as written", "marked canonical"])
def test_a_plain_prompt_goes_in_whole_chunks_and_deterministic_requests_do_not_start_from_it(
        tiny, invariance, monkeypatch, plain_kv):
    """A plain request's cold prompt runs whole chunks (one call for 59 tokens, no narrow steps);
    a deterministic request after it, sharing 40 tokens, does not start from that KV and gets its
    cold bits. Negative control: that KV marked canonical changes them (a double whose GEMMs
    change between calls of up to 32 rows and wider ones)."""
    import lockstep.server.engine.decoding.request_state as request_state

    if plain_kv == "marked canonical":
        monkeypatch.setattr(request_state, "whole_chunks_are_canonical", lambda chunk, canonical, split_rows=0: True)
    deployment = Deployment(guarantee=Guarantee.installed(invariance(4)), prefill_chunk=WIDE)
    det, plain = plans(deployment)
    calls = prompt_calls(monkeypatch)
    with shape_variant_backend(dense_rows=32):
        cold = run_generate(tiny, LONG, TOKENS, GREEDY, plan=det, deployment=deployment)
        assert calls == [(0, 16), (16, 16), (32, 27)]
        pc = PrefixCache(4)
        calls.clear()
        run_generate(tiny, SHARES_40, 1, GREEDY, plan=plain, deployment=deployment, prefix_cache=pc)
        assert calls == [(0, 59)]
        after = run_generate(tiny, LONG, TOKENS, GREEDY, plan=det, deployment=deployment, prefix_cache=pc)
    assert (pc.hits == 0) == (plain_kv == "as written")
    assert same_run(cold, after) == (plain_kv == "as written")


@pytest.mark.parametrize("entry", ["its own cold prefill", "a plain prefill marked whole"])
def test_the_same_deterministic_prompt_again_has_nothing_to_prefill(tiny, invariance, monkeypatch, entry):
    """An entry of exactly a deterministic request's prompt that is that prompt's own cold
    prefill is reused whole: no prompt chunk runs, and the answer keeps its cold bits.
    Negative control: a plain request's whole chunks (one call of 59 rows) marked as the grid's
    change them (a double whose GEMMs change between calls of up to 32 rows and wider ones)."""
    import lockstep.server.engine.decoding.request_state as request_state

    own = entry == "its own cold prefill"
    if not own:  # only plain requests ask it
        monkeypatch.setattr(request_state, "whole_chunks_are_canonical", lambda chunk, canonical, split_rows=0: True)
    deployment = Deployment(guarantee=Guarantee.installed(invariance(4)), prefill_chunk=WIDE)
    det, plain = plans(deployment)
    calls = prompt_calls(monkeypatch)
    with shape_variant_backend(dense_rows=32):
        cold, again, pc = cold_and_cached(tiny, LONG, GREEDY, LONG, deployment=deployment, plan=det,
                                          warm_plan=det if own else plain, calls=calls)
    assert pc.hits == 1 and calls == []
    assert same_run(cold, again) == own


def test_a_deterministic_request_never_starts_from_a_plain_prompts_smaller_chunks(tiny):
    """A plain prompt goes in chunks smaller than --prefill-chunk (on the CPU: a long one holds
    the engine less per step), which writes other KV bits under the double: a deterministic
    request after it must still get its cold bits (it does not start from that entry), while
    a plain request reuses it."""
    deployment = Deployment(prefill_chunk=CHUNK, plain_prefill_chunk=CHUNK // 2)
    det, plain = plans(deployment)
    with shape_variant_backend():
        cold = run_generate(tiny, PROMPT, TOKENS, GREEDY, plan=det, deployment=deployment)
        pc = PrefixCache(4)
        plain_run = run_generate(tiny, PROMPT, TOKENS, GREEDY, plan=plain, deployment=deployment, prefix_cache=pc)
        after = run_generate(tiny, PROMPT, TOKENS, GREEDY, plan=det, deployment=deployment, prefix_cache=pc)
        assert pc.hits == 0  # the plain entry was not offered to it
        run_generate(tiny, PROMPT, 1, GREEDY, plan=plain, deployment=deployment, prefix_cache=pc)
    assert pc.hits == 1  # a plain request does reuse it
    assert not bits_equal(sorted_rows(plain_run)[0], sorted_rows(cold)[0])  # the small chunks' bits differ
    assert same_run(cold, after)


def test_a_deterministic_request_never_starts_from_a_plain_prompts_native_chunks(tiny, monkeypatch):
    """Where plain prompts' chunks run the model's native forms (`plain_prompt_native`: on CUDA
    their wide 4-bit calls then take another kernel), a plain request's prompt runs them and its
    entry is kept apart: a deterministic request after it neither runs them nor starts from that
    entry, while a plain request reuses it."""
    from lockstep.kernels.invariance import layers

    native = []  # per prompt chunk: whether it ran under native forms
    prompt_forward = model_runner.prompt_forward

    def recorded(*args):
        native.append(layers._local.native)
        return prompt_forward(*args)

    monkeypatch.setattr(model_runner, "prompt_forward", recorded)
    deployment = Deployment(prefill_chunk=CHUNK, plain_prompt_native=True)
    det, plain = plans(deployment)
    pc = PrefixCache(4)
    run_generate(tiny, PROMPT, 1, GREEDY, plan=plain, deployment=deployment, prefix_cache=pc)
    assert native == [True] * -(-(len(PROMPT) - 1) // CHUNK)  # every chunk of its prompt
    native.clear()
    run_generate(tiny, PROMPT, 1, GREEDY, plan=det, deployment=deployment, prefix_cache=pc)
    assert pc.hits == 0 and native and not any(native)  # not offered the plain entry; its chunks under the setting
    run_generate(tiny, PROMPT, 1, GREEDY, plan=plain, deployment=deployment, prefix_cache=pc)
    assert pc.hits == 1  # a plain request does reuse it


def test_a_chunk_cut_to_an_audited_width_is_never_stored(tiny):
    """While the kernel audit is partial the scheduler cuts a prompt chunk to an audited width
    (`RequestState.chunk_limit`): that KV is not what an aligned prefill writes, so it is never
    stored for reuse (a deterministic request would start from other bits). Control: the same
    prompt in aligned chunks is stored."""
    from lockstep.server.engine.decoding.request_state import RequestState
    from lockstep.server.engine.decoding.sampling import SamplingParams

    def prefilled(limit):
        pc = PrefixCache(4)
        request = GenerationRequest(prompt_tokens=PROMPT, max_tokens=1, sampling=SamplingParams(temperature=0))
        state = RequestState(tiny, request, prefix_cache=pc)
        chunks = 0
        while state.prefilling:
            state.chunk_limit = limit
            step = state.next_prefill()
            tiny.model(mx.array([step.tokens]), cache=step.cache)
            state.chunk_written(len(step.tokens), alone=True)
            chunks += 1
        return chunks, lookup(pc, PROMPT[:-1])[1]

    assert prefilled(None) == (1, len(PROMPT) - 1)  # control: one aligned chunk, stored
    chunks, stored = prefilled(5)
    assert chunks > 1 and stored == 0
