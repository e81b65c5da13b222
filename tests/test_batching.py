"""Continuous batching: many requests' rows in one forward pass, each deterministic request
still bit-identical to running alone.

The backend is the shape-variant double (tests/doubles/shape_variant.py: on the CPU, calls with
several rows reduce in another order, as CUDA's do), so batching *would* change bits
unless the scheduler keeps deterministic rows in passes of at most L canonical rows. The
model is a tiny random llama (tests/tiny_models.py) whose token ids read back from the
text; requests go through the official openai client to a live uvicorn.
"""
import struct
import threading
import time

import httpx2 as httpx
import mlx.core as mx
import pytest
from openai import OpenAI

from lockstep.kernels.batching.ragged import enable_ragged, ragged_forward
from lockstep.kernels.batching.ragged_selftest import prove_ragged
from tests.doubles.shape_variant import shape_variant_backend
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.guarantee.guarantee import Guarantee
from lockstep.server.engine.scheduling.passes import Demand, compose_passes
from lockstep.server.engine.cache.prefix_cache import PrefixCache
from tests.deterministic_fixtures import TinyLoaded
from tests.http_server import running, wait_until
from tests.test_deterministic_double import peaked_llama

LIMIT = 8
TOKENS = 16


# ------------------------------------------------------------------- pass composition

def demand(name, rows, det):
    return Demand(name, rows, "shared" if det else "none")


def test_deterministic_passes_hold_at_most_l_rows_and_are_topped_up_with_free_rows():
    demands = [demand("a", 1, True), demand("b", 4, True), demand("x", 1, False), demand("c", 4, True),
               demand("y", 3, False), demand("z", 2, False)]
    passes = compose_passes(demands, shared_rows=6, max_rows=32)
    for group in passes:
        if any(d.determinism == "shared" for d in group):
            assert sum(d.rows for d in group) <= 6
    assert [[d.owner for d in g] for g in passes] == [["a", "b", "x"], ["c", "z"], ["y"]]


def test_free_rows_alone_may_be_wider_than_l_up_to_max_rows():
    demands = [demand(i, 1, False) for i in range(40)]
    passes = compose_passes(demands, shared_rows=4, max_rows=16)
    assert [len(g) for g in passes] == [16, 16, 8]
    assert [d.owner for g in passes for d in g] == list(range(40))  # order kept, none split


def test_a_deterministic_demand_wider_than_l_is_refused():
    with pytest.raises(ValueError, match="at most 4 may share"):
        compose_passes([demand("a", 5, True)], shared_rows=4, max_rows=32)


# ------------------------------------------------------------------- ragged forward itself

@pytest.fixture(scope="module")
def tiny_model():
    model = peaked_llama()
    enable_ragged(model)
    return model


@pytest.mark.reference_blas
def test_a_ragged_pass_gives_each_request_its_solo_bits_on_the_embedded_model(embedded_model):
    from mlx_lm.models.cache import make_prompt_cache

    model = embedded_model.model
    enable_ragged(model)
    prompts = [[1, 504, 2, 8], [5, 6, 7, 8, 9, 10, 11], [42]]
    rows = [[100], [101, 102, 103], [104]]

    def prefilled(i):
        cache = make_prompt_cache(model)
        model(mx.array(prompts[i])[None], cache=cache)
        return cache

    together = ragged_forward(model, [(prefilled(i), rows[i]) for i in range(3)])
    for i in range(3):
        alone = ragged_forward(model, [(prefilled(i), rows[i])])[0]
        plain = model(mx.array(rows[i])[None], cache=prefilled(i))[0]
        assert together[i].shape == (len(rows[i]), embedded_model.model.args.vocab_size)
        assert mx.array_equal(together[i], alone).item()
        assert mx.allclose(alone, plain, atol=1e-4).item()  # the same model, computed per request


@pytest.mark.parametrize("pooled", [False, True])
def test_a_pass_evaluated_in_layer_chunks_gives_the_bits_of_one_built_whole(embedded_model, monkeypatch, pooled):
    """ragged_logits(eval_every=N) hands the pass to the device every N layers while it is
    built: the same ops, so every logit is the same bit for bit, and the hand-offs happen."""
    from mlx_lm.models.cache import make_prompt_cache

    from lockstep.kernels.batching.kv_pool import KVPool
    from lockstep.kernels.batching.ragged import ragged_logits

    model = embedded_model.model
    enable_ragged(model)
    pool = KVPool(model, 256, use_kernel=False) if pooled else None
    prompts, rows = [[1, 504, 2, 8], [5, 6, 7, 8, 9, 10, 11], [42]], [[100], [101, 102, 103], [104]]

    def prefilled(i):
        cache = pool.allocate(32) if pooled else make_prompt_cache(model)
        ragged_logits(model, [(cache, prompts[i])])
        mx.eval([c.state for c in cache])
        return cache

    whole = ragged_logits(model, [(prefilled(i), rows[i]) for i in range(3)])
    mx.eval(whole)
    handed = []
    real_async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: (handed.append(len(arrays)), real_async_eval(*arrays)))
    layers = len(model.layers)
    for every in (4, 7):
        handed.clear()
        chunked = ragged_logits(model, [(prefilled(i), rows[i]) for i in range(3)], eval_every=every)
        assert len(handed) == (layers - 1) // every  # at layers every, 2 * every, ...
        assert mx.array_equal(chunked, whole).item()


@pytest.mark.reference_blas
def test_ragged_proof_passes_with_canonical_forms_and_fails_natively(tiny_model):
    assert prove_ragged(tiny_model, LIMIT)  # CPU: natively invariant
    with shape_variant_backend():
        native = prove_ragged(tiny_model, LIMIT)
        assert not native and "differ" in native.reason  # negative control
        invariance = set_batch_invariant_limit(tiny_model, LIMIT)
        assert invariance.guaranteed and invariance.strategy != "native"
        assert prove_ragged(tiny_model, LIMIT)
    set_batch_invariant_limit(tiny_model, 0)


@pytest.mark.parametrize("proof", ["ragged", "per_request"])
def test_a_proof_lets_its_caller_serve_after_every_pass_it_evaluates(tiny_model, monkeypatch, proof):
    """Issue 54: a restart whose ragged proof was not cached held a plain request ~13 s on the
    CPU: the proof ran its pool's prefills and solo passes (two per member, 34 members at 32
    pass rows) before its first step, where the engine serves requests. Every pass the proofs
    evaluate is a step now: no two evaluations without a step between them."""
    from lockstep.kernels.batching.ragged_selftest import per_request_self_test
    from lockstep.kernels.proof_steps import between_steps

    assert set_batch_invariant_limit(tiny_model, LIMIT).guaranteed  # the proofs pass: every width runs
    events = []
    evaluate = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *arrays: events.append("e") or evaluate(*arrays))
    try:
        with between_steps(lambda: events.append("s")):
            if proof == "ragged":
                assert prove_ragged(tiny_model, LIMIT, pass_rows=16)
            else:
                assert per_request_self_test(tiny_model, LIMIT, prefixes=(3, 9))
    finally:
        monkeypatch.undo()
        set_batch_invariant_limit(tiny_model, 0)
    runs = "".join(events)
    assert runs.count("e") > 2 * LIMIT and "ee" not in runs


# ------------------------------------------------------------- the engine under load (HTTP)

class PassLog:
    """Engine observer: rows and requests of every decode pass."""

    def __init__(self):
        self.passes = []

    def on_pass(self, rows, requests):
        self.passes.append((rows, requests))

    def on_admit(self, waited):
        pass


def serve_tiny(limit: int, *, claim_without_proof: int = 0, max_batch_rows: int = 32, max_kv_tokens=None,
               kv_pool: str = "off", pass_rows: int | None = None):
    """(app, engine, pass log) for the tiny model with L = `limit` installed under the double
    and its guarantee decided as at startup; `claim_without_proof`: a deployment that claims
    that many shared deterministic rows instead (the negative control)."""
    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine
    from lockstep.server.engine.guarantee.deployment import proven_deployment

    model = peaked_llama()
    draft = peaked_llama(quant="affine")
    with shape_variant_backend():
        invariance = set_batch_invariant_limit(model, limit)
        if claim_without_proof:
            deployment = Deployment(guarantee=Guarantee(claim_without_proof, proven=True, shared_passes=True),
                                    draft_model=draft, prefill_chunk=8, kv_pool=kv_pool)
        else:
            deployment = proven_deployment(model, invariance if limit else None, kv_pool=kv_pool, draft_model=draft,
                                           prefill_chunk=8, pass_rows=pass_rows)
    with shape_variant_backend():
        engine = Engine(TinyLoaded(model), max_active=16, deployment=deployment,
                        max_batch_rows=max_batch_rows, max_kv_tokens=max_kv_tokens,
                        prefix_cache=PrefixCache(4))
    log = PassLog()
    engine.observers.append(log)
    return create_app(engine), engine, log


PROMPTS = [[11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12], [30, 31, 32, 33, 30, 31, 32],
           [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 50, 51, 52], [70, 71, 70, 71, 70]]
# deterministic requests: (prompt index, speculative, k, seed or None, streamed)
DETERMINISTIC = [(0, "none", None, None, True), (1, "none", None, 7, False), (2, "prompt_lookup", 3, None, False),
                 (3, "prompt_lookup", 2, 9, True), (0, "draft", 3, None, False), (1, "draft", 4, 5, True),
                 (2, "none", None, 11, True)]
OTHERS = [(1, "none", None, 3, True), (3, "prompt_lookup", 5, None, False), (2, "draft", 6, 8, False),
          (0, "none", None, 2, False)]


def completion(client, prompt, speculative, k, seed, stream, deterministic, max_tokens=TOKENS):
    """(token ids, logprob bits, top-logprob bits) of one /v1/completions call."""
    body = {"deterministic": deterministic, "speculative": speculative}
    if k is not None:
        body["num_draft_tokens"] = k
    kwargs = dict(model="default", prompt=PROMPTS[prompt], max_tokens=max_tokens, logprobs=3,
                  temperature=0.8 if seed is not None else 0.0, extra_body=body)
    if seed is not None:
        kwargs["seed"] = seed
    if stream:
        text, lps, tops = "", [], []
        for chunk in client.completions.create(stream=True, **kwargs):
            if chunk.choices:
                c = chunk.choices[0]
                text += c.text
                if c.logprobs:
                    lps += c.logprobs.token_logprobs
                    tops += c.logprobs.top_logprobs
    else:
        c = client.completions.create(**kwargs).choices[0]
        text, lps, tops = c.text, c.logprobs.token_logprobs, c.logprobs.top_logprobs
    ids = [ord(ch) - 0x4E00 for ch in text]
    bits = [struct.pack(">d", x) for x in lps]
    top_bits = [sorted((t, struct.pack(">d", v)) for t, v in top.items()) for top in tops]
    return ids, bits, top_bits


def run_mixed_load(url, cancel_one=True):
    """The deterministic requests beside the others, staggered, one cancelled midway."""
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    results, errors = {}, []

    def det(i, spec):
        try:
            time.sleep(0.02 * i)
            p, method, k, seed, stream = spec
            results[i] = completion(client, p, method, k, seed, stream, True)
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    def other(i, spec):
        try:
            time.sleep(0.015 * i)
            p, method, k, seed, stream = spec
            completion(client, p, method, k, seed, stream, False, max_tokens=TOKENS + 8)
        except Exception as exc:
            errors.append(exc)

    def cancelled():
        time.sleep(0.03)
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": "default", "prompt": PROMPTS[2], "max_tokens": 3000, "stream": True}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 4:
                    break  # the client goes away midway

    threads = [threading.Thread(target=det, args=(i, s)) for i, s in enumerate(DETERMINISTIC)]
    threads += [threading.Thread(target=other, args=(i, s)) for i, s in enumerate(OTHERS)]
    if cancel_one:
        threads.append(threading.Thread(target=cancelled))
    run_all(threads, errors)
    return results


def run_all(threads: list, errors: list) -> None:
    """Start the clients together, wait for them (a hang guard of 300 s each), surface their errors."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors


def solo_runs(url):
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    return {i: completion(client, p, m, k, s, st, True) for i, (p, m, k, s, st) in enumerate(DETERMINISTIC)}


@pytest.mark.parametrize("kv_pool", ["off", "reference"])
def test_deterministic_answers_under_mixed_batched_load_equal_their_solo_runs(kv_pool):
    """Each request its own KV caches, or all in one KV pool (kernels/batching/kv_pool.py)."""
    app, engine, log = serve_tiny(LIMIT, kv_pool=kv_pool)
    engine.start()
    try:
        with shape_variant_backend(), running(app) as url:
            solo = solo_runs(url)
            solo_passes = list(log.passes)
            loaded = run_mixed_load(url)
            wait_until(lambda: engine.counts()["active"] == 0, what="the cancelled request to leave")
            health = httpx.get(url + "/health").json()
    finally:
        engine.stop()
    assert engine.deployment.guarantee.shared_passes  # the ragged proof passed
    assert all(requests == 1 for _, requests in solo_passes)
    assert len(loaded) == len(DETERMINISTIC)
    for i, run in solo.items():
        assert len(run[0]) == TOKENS
        assert loaded[i] == run, f"deterministic request {i} {DETERMINISTIC[i]} changed under load"
    batched = log.passes[len(solo_passes):]
    assert max(requests for _, requests in batched) >= 4  # passes really held several requests
    assert all(rows <= 32 for rows, _ in batched)
    assert health["cancelled"] == 1
    assert engine.describe()["kv_pool"] == kv_pool
    assert engine.prefix_cache.hits > 0  # prompts repeat: some requests started from a cached prefix
    if kv_pool != "off":  # every range came back, the cancelled request's too
        assert engine.runner.kv_pool.free_slots == engine.runner.kv_pool.capacity


def test_choices_of_one_request_share_the_pooled_prompt_and_give_their_ranges_back():
    app, engine, log = serve_tiny(LIMIT, kv_pool="reference")
    engine.start()
    try:
        with shape_variant_backend(), running(app) as url:
            client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
            body = dict(model="default", prompt=PROMPTS[2], max_tokens=TOKENS, temperature=0.9, seed=4,
                        logprobs=1, extra_body={"deterministic": True})
            one = client.completions.create(**body).choices
            three = client.completions.create(n=3, **body).choices
    finally:
        engine.stop()
    assert [c.text for c in three][0] == one[0].text  # choice 0 is the n = 1 answer
    assert three[0].logprobs.token_logprobs == one[0].logprobs.token_logprobs
    assert len({c.text for c in three}) > 1  # the followers sampled their own streams
    assert engine.runner.kv_pool.free_slots == engine.runner.kv_pool.capacity


def test_negative_control_the_same_batching_without_invariant_kernels_diverges():
    """L installed nowhere (native kernels under the double), but the scheduler batches the
    deterministic rows as if it were proven: their answers change under load."""
    app, engine, log = serve_tiny(0, claim_without_proof=LIMIT)  # batch deterministic rows with others, unproven
    engine.start()
    try:
        with shape_variant_backend(), running(app) as url:
            solo = solo_runs(url)
            loaded = run_mixed_load(url, cancel_one=False)
    finally:
        engine.stop()
    assert max(requests for _, requests in log.passes) >= 4
    changed = [i for i in solo if loaded[i] != solo[i]]
    assert changed, "batching without invariant kernels should change some deterministic answer"


# ------------------------------------------------------------------ capacity and prefill

def test_without_a_prompt_cap_a_prompt_fills_what_the_kv_budget_holds():
    """No --max-prompt-tokens: a long prompt is answered as far as the KV budget holds it
    (max_tokens, when the request sets none, is what the budget leaves beside it), and one
    the budget cannot hold with a single token is a 400 naming the longest prompt it can."""
    app, engine, _ = serve_tiny(0, max_kv_tokens=700)
    engine.start()
    try:
        with running(app) as url:
            # 420 prompt tokens + 256 (a KV allocation step) leave 24 tokens of the 700
            fits = httpx.post(url + "/v1/completions", timeout=120,
                              json={"model": "default", "prompt": [(i % 90) + 5 for i in range(420)]})
            assert fits.status_code == 200, fits.text
            assert 1 <= fits.json()["usage"]["completion_tokens"] <= 24
            too_long = httpx.post(url + "/v1/completions", json={"model": "default",
                                                                 "prompt": [(i % 90) + 5 for i in range(450)]})
            assert too_long.status_code == 400
            error = too_long.json()["error"]
            assert error["code"] == "prompt_too_long" and error["param"] == "prompt" and "at most 443" in error["message"]
    finally:
        engine.stop()


def test_kv_budget_refuses_what_never_fits_and_queues_what_does_not_fit_yet():
    app, engine, log = serve_tiny(0, max_kv_tokens=700)
    engine.start()
    try:
        with running(app) as url:
            too_big = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": [1, 2, 3],
                                                                "max_tokens": 500})
            assert too_big.status_code == 400
            assert too_big.json()["error"]["code"] == "kv_budget_exceeded"
            # each needs 3 + 200 + 256 = 459 tokens: only one fits at a time
            done = []

            def go():
                r = httpx.post(url + "/v1/completions", timeout=120,
                               json={"model": "default", "prompt": [1, 2, 3], "max_tokens": 200})
                done.append(r.status_code)

            threads = [threading.Thread(target=go) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
    finally:
        engine.stop()
    assert done == [200, 200]
    assert all(requests == 1 for _, requests in log.passes)  # never both at once
    assert engine.kv_budget.reserved == 0


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_passes(monkeypatch):
    from lockstep.server.engine.runner.model_runner import ModelRunner

    app, engine, log = serve_tiny(0)
    events = []
    original = ModelRunner.prefill

    def logged_chunk(self, state):
        events.append("chunk")
        return original(self, state)

    monkeypatch.setattr(ModelRunner, "prefill", logged_chunk)
    engine.observers.append(type("O", (), {"on_pass": lambda s, r, n: events.append("pass"),
                                           "on_admit": lambda s, w: None})())
    engine.start()
    try:
        with running(app) as url:
            short = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "default", "prompt": [5, 6], "max_tokens": 400}))
            short.start()
            wait_until(lambda: "pass" in events, what="the short request decoding")
            long_prompt = [(i * 7) % 250 for i in range(200)]  # 25 chunks of 8
            r = httpx.post(url + "/v1/completions", timeout=120,
                           json={"model": "default", "prompt": long_prompt, "max_tokens": 2})
            short.join(timeout=120)
    finally:
        engine.stop()
    assert r.status_code == 200
    chunks = [i for i, e in enumerate(events) if e == "chunk"]
    assert len(chunks) >= 24
    between = events[chunks[0]:chunks[-1]]
    assert between.count("pass") >= len(chunks) - 1  # a decode pass after every chunk


def test_models_endpoint_reports_batching(live_server):
    info = httpx.get(live_server + "/models").json()["data"][0]["lockstep"]["batching"]
    assert info["batched"] is True and info["max_batch_rows"] >= 1 and info["max_active"] >= 1


# ------------------------------------------- the limit bounds one kernel call, not a pass

WIDE_L = 2  # far fewer rows than the deterministic requests below bring to one pass
WIDE = [(i % 4, None if i % 2 else 20 + i) for i in range(8)]  # (prompt, seed or greedy)


def wide_load(url) -> dict:
    """Every WIDE request at once, deterministic, no speculation: {i: (ids, logprob bits, tops)}."""
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    results, errors = {}, []

    def run(i):
        try:
            p, seed = WIDE[i]
            results[i] = completion(client, p, "none", None, seed, i % 3 == 0, True)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(WIDE))]
    run_all(threads, errors)
    return results


def wide_runs(monkeypatch=None, blocks=True):
    """(solo answers, answers under load, passes under load) with L = 2 and passes of up to
    16 rows proven (calls of more than L rows run in blocks of at most L)."""
    app, engine, log = serve_tiny(WIDE_L, pass_rows=16, max_batch_rows=16)
    if not blocks:  # the negative control: wide calls run natively in the engine's passes
        import contextlib

        import lockstep.server.engine.runner.model_runner as model_runner

        monkeypatch.setattr(model_runner, "calls_in_blocks", contextlib.nullcontext)
    engine.start()
    try:
        with shape_variant_backend(), running(app) as url:
            client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
            solo = {i: completion(client, p, "none", None, seed, False, True) for i, (p, seed) in enumerate(WIDE)}
            first = len(log.passes)
            loaded = wide_load(url)
    finally:
        engine.stop()
    assert engine.describe()["deterministic_pass_rows"] == 16 and engine.deployment.guarantee.call_rows == WIDE_L
    return solo, loaded, log.passes[first:]


def test_deterministic_rows_fill_passes_wider_than_l_and_keep_their_solo_bits():
    solo, loaded, passes = wide_runs()
    assert max(rows for rows, _ in passes) > WIDE_L  # passes really held more than L deterministic rows
    assert max(requests for _, requests in passes) > WIDE_L
    for i in solo:
        assert len(solo[i][0]) == TOKENS
        assert loaded[i] == solo[i], f"deterministic request {i} changed in a pass wider than L"


def test_negative_control_wide_passes_without_blocks_change_answers(monkeypatch):
    """The same passes with each wide call run whole (native, the double's batched order):
    the deterministic answers change."""
    solo, loaded, passes = wide_runs(monkeypatch, blocks=False)
    assert max(rows for rows, _ in passes) > WIDE_L
    assert any(loaded[i] != solo[i] for i in solo)


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_a_rows_rope_is_the_same_alone_and_among_others(dtype):
    """Ragged RoPE: each row at its own position. A row alone runs the model's RoPE on the row as
    it is (one row is one batch entry); among others the rows become batch entries through two
    transposes. Both give every row the same bits."""
    import mlx.nn as nn

    from lockstep.kernels.batching.ragged import RowPositions, _ragged_rope_class

    rope = nn.RoPE(64, base=10000.0)
    rope.__class__ = _ragged_rope_class(nn.RoPE)
    x = mx.random.normal((1, 4, 3, 64), key=mx.random.key(3)).astype(dtype)
    positions = [5, 37, 90]
    together = rope(x, RowPositions(mx.array(positions)))
    for r, p in enumerate(positions):
        alone = rope(x[:, :, r:r + 1], RowPositions(mx.array([p])))
        assert mx.array_equal(alone, together[:, :, r:r + 1]).item()
        assert not mx.array_equal(alone, x[:, :, r:r + 1]).item()  # it rotated
    through_transposes = nn.RoPE.__call__(rope, x[:, :, :1].transpose(2, 1, 0, 3), mx.array([5])).transpose(2, 1, 0, 3)
    assert mx.array_equal(rope(x[:, :, :1], RowPositions(mx.array([5]))), through_transposes).item()
