"""An interrupted ragged proof keeps the widths it proved (kernels/batching/ragged_selftest.py
`prove_ragged_cached`): each width is stored once its comparisons passed, so a start stopped
mid-proof leaves them to the next start, which puts them in force before any pass and proves only
the wider ones. A record of another key, or a damaged one, gives no credit. The embedded model,
its real proofs; proof passes are counted by width (the passes the proof runs in blocks)."""
import json
import logging
import threading
from dataclasses import replace

import httpx2 as httpx
import pytest

import lockstep.kernels.batching.ragged_selftest as ragged_selftest
from lockstep.kernels.verdict_cache import ROOT_ENV, VerdictCache
from tests.doubles.ragged_proof_passes import counted_widths

LIMIT, WIDEST = 2, 4



def records(store: VerdictCache) -> list[dict]:
    return [json.loads(p.read_text())["value"] for p in store.dir.glob("*.json")
            if json.loads(p.read_text())["key"].get("what") == "ragged pass proof"]


# ------------------------------------------------------------------ a server stopped mid-proof

def start(verdicts):
    from lockstep.server.runtime import Options, build_runtime
    from lockstep.server.startup_work import GuaranteeWork

    runtime = build_runtime(Options(model="default", batch_invariant_limit=LIMIT, max_batch_rows=WIDEST),
                            defer_guarantee=True)
    (work,) = [w for w in runtime.pending if isinstance(w, GuaranteeWork)]
    return runtime, work


def engine_for(runtime):
    from lockstep.server.engine import Engine

    return Engine(runtime.loaded, deployment=runtime.deployment, guarantee=runtime.guarantee,
                  audited=runtime.audited, max_active=4, max_batch_rows=WIDEST)


def test_a_restart_after_a_stop_mid_proof_starts_in_force_for_the_widths_proven_and_proves_only_wider(
        tmp_path, monkeypatch, caplog):
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.server.api.app import create_app
    from lockstep.server.engine.guarantee.guarantee_state import IN_FORCE
    from tests.http_server import running

    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "verdicts"))  # a first start: nothing proven yet
    store = VerdictCache("selftest")
    stop_after = 3  # not a multiple of L: a first proof had put only 1..2 in force

    # first start: stopped (Engine.stop, as a launchd restart or Ctrl-C) once width 3 is proven
    runtime, work = start(tmp_path)
    engine = engine_for(runtime)
    proven_widths, stopper, stopping = work._proven_widths, threading.Thread(target=lambda: engine.stop()), \
        threading.Event()

    def stopping_after(invariance, pass_costs):
        proven = proven_widths(invariance, pass_costs)

        def hook(width):
            proven(width)
            if width == stop_after:  # the proof's next step_done() ends it, as a stop does
                stopper.start()
                with engine._wake:
                    assert engine._wake.wait_for(lambda: engine._stopping, timeout=600)
                stopping.set()
        return hook
    work._proven_widths = stopping_after
    try:
        with counted_widths() as first:
            engine.start(runtime.pending)
            assert stopping.wait(600)
            stopper.join(timeout=600)
        assert not stopper.is_alive()
    finally:
        engine.stop()
    assert first == [1, 2, 3]
    assert records(store) == [{"partial": True, "proven_widths": 3, "seconds": records(store)[0]["seconds"]}]

    # the restart: 1..3 in force before any proof pass; only width 4 runs
    runtime, work = start(tmp_path)
    engine = engine_for(runtime)
    at_first_pass, checked, settled, seen = threading.Event(), threading.Event(), threading.Event(), []
    settle = work.settle
    work.settle = lambda: (settle(), settled.set())  # the whole proof's deployment is installed

    def hold_first(width):
        if not at_first_pass.is_set():
            seen.append((runtime.guarantee.state, engine.deployment.guarantee.pass_rows))
            at_first_pass.set()
            assert checked.wait(600)

    try:
        with counted_widths(on_pass=hold_first) as again, caplog.at_level(logging.INFO):
            engine.start(runtime.pending)
            with running(create_app(engine, model_extras=runtime.model_info, guarantee_timeout=20)) as base:
                try:
                    assert at_first_pass.wait(600)
                    health = httpx.get(base + "/health").json()
                finally:
                    checked.set()
                assert health["guarantee"] == IN_FORCE and health["deterministic_pass_rows"] == 3
                assert seen == [(IN_FORCE, 3)]
                assert settled.wait(600)
                assert engine.deployment.guarantee.pass_rows == WIDEST
                proven_health = in_force_fields(httpx.get(base + "/health").json())
                assert proven_health["deterministic_pass_rows"] == WIDEST
        proven_deployment = engine.deployment
    finally:
        checked.set()
        engine.stop()
        set_batch_invariant_limit(runtime.loaded.model, 0)
    assert again == [4]
    assert "1..3 rows were proven by an earlier start" in caplog.text
    assert "1..3 rows kept from an earlier proof" in caplog.text
    (finished,) = records(store)  # the finished proof replaced the partial record
    assert finished["passed"] is True and "partial" not in finished

    # a third start, every width recorded: no proof pass or setup, the same guarantee and /health
    runtime, work = start(tmp_path)
    engine, settled, setup = engine_for(runtime), threading.Event(), {}
    settle = work.settle
    work.settle = lambda: (settle(), settled.set())
    try:
        with counted_widths(setup=setup) as third:
            engine.start(runtime.pending)
            with running(create_app(engine, model_extras=runtime.model_info, guarantee_timeout=20)) as base:
                assert settled.wait(600)
                assert in_force_fields(httpx.get(base + "/health").json()) == proven_health
        # the batched-sampling proof runs after this one, on its own record: whether it has
        # settled when a start is looked at is not what this test is about
        assert replace(engine.deployment.guarantee, sampling_rows=0) == \
            replace(proven_deployment.guarantee, sampling_rows=0)
        assert engine.deployment.fingerprint == proven_deployment.fingerprint
    finally:
        engine.stop()
        set_batch_invariant_limit(runtime.loaded.model, 0)
    assert third == [] and setup == {"caches": 0, "prefills": 0, "solo": [], "members": set()}


def in_force_fields(health: dict) -> dict:
    """What /health says of the guarantee (not the request counts)."""
    return {k: health[k] for k in ("guarantee", "deterministic_pass_rows", "audited_rows")}


# ------------------------------------------------------------------ the record, proof by proof

class Stop(Exception):
    """What a stop raises at the proof's next step."""


def install_limit(loaded):
    """Batch invariance for L on the embedded model, its self-test kept in the session's
    verdict cache (tests/conftest.py): made once."""
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.kernels.invariance.selftest import ProofCache

    session = ProofCache(VerdictCache("selftest"), {"model": "embedded", "weights": loaded.weights})
    assert set_batch_invariant_limit(loaded.model, LIMIT, proof_cache=session).guaranteed


@pytest.fixture(scope="module")
def loaded(embedded_model):
    from lockstep.kernels.batching.ragged import enable_ragged
    from lockstep.kernels.invariance import set_batch_invariant_limit

    install_limit(embedded_model)
    enable_ragged(embedded_model.model)
    yield embedded_model
    set_batch_invariant_limit(embedded_model.model, 0)


@pytest.fixture
def model(loaded):
    return loaded.model


def proofs(tmp_path, weights="digest-a", fresh=False):
    from lockstep.kernels.invariance.selftest import ProofCache

    return ProofCache(VerdictCache("selftest", tmp_path), {"weights": weights}, fresh)


def interrupted(model, proof_cache, at: int, **options) -> None:
    def stop(width):
        if width == at:
            raise Stop
    with pytest.raises(Stop):
        ragged_selftest.prove_ragged_cached(model, LIMIT, proof_cache, pass_rows=WIDEST, on_width=stop, **options)


def test_a_resumed_proof_reports_the_kept_widths_first_and_proves_the_rest(model, tmp_path, monkeypatch):
    interrupted(model, proofs(tmp_path), at=2)
    called = []
    with counted_widths(on_pass=lambda w: called.append(("pass", w))) as widths:
        proof = ragged_selftest.prove_ragged_cached(model, LIMIT, proofs(tmp_path), pass_rows=WIDEST,
                                                    on_width=lambda w: called.append(("proven", w)))
    assert proof.passed and proof.resumed == 2 and not proof.cached
    assert widths == [3, 4]
    assert called == [("proven", 2), ("pass", 3), ("proven", 3), ("pass", 4), ("proven", 4)]
    again = ragged_selftest.prove_ragged_cached(model, LIMIT, proofs(tmp_path), pass_rows=WIDEST)
    assert again.passed and again.cached  # finished: nothing proven again
    with counted_widths() as widths:  # fresh proofs take no credit either
        assert ragged_selftest.prove_ragged_cached(model, LIMIT, proofs(tmp_path, fresh=True), pass_rows=WIDEST)
    assert widths == [1, 2, 3, 4]


def test_a_proof_stopped_after_its_last_width_runs_no_pass_again(model, tmp_path, monkeypatch):
    interrupted(model, proofs(tmp_path), at=WIDEST)  # stopped at the step after the last width
    with counted_widths() as widths:
        proof = ragged_selftest.prove_ragged_cached(model, LIMIT, proofs(tmp_path), pass_rows=WIDEST)
    assert proof.passed and proof.resumed == WIDEST and widths == []
    assert ragged_selftest.prove_ragged_cached(model, LIMIT, proofs(tmp_path), pass_rows=WIDEST).cached


@pytest.mark.parametrize("change", ["weights", "limit", "pass_rows", "kv_pool", "kernel code"])
def test_a_partial_record_of_another_key_gives_no_credit(model, tmp_path, monkeypatch, change):
    interrupted(model, proofs(tmp_path), at=3)
    limit, options, cache = LIMIT, {"pass_rows": WIDEST}, proofs(tmp_path)
    if change == "weights":
        cache = proofs(tmp_path, weights="digest-b")
    elif change == "limit":
        limit = 1  # widths 1..4 still: pass_rows
    elif change == "pass_rows":
        options["pass_rows"] = WIDEST + 1
    elif change == "kv_pool":
        options["kv_pool"] = "reference"
    else:
        import lockstep.kernels.invariance.selftest as selftest

        monkeypatch.setattr(selftest, "kernels_code_version", lambda: "another kernel source")
    with counted_widths() as widths:
        proof = ragged_selftest.prove_ragged_cached(model, limit, cache, **options)
    assert proof.passed and proof.resumed == 0
    assert widths == list(range(1, max(limit, options["pass_rows"]) + 1))


@pytest.mark.parametrize("damage", ["truncated", "empty", "width out of range", "width as text", "not partial",
                                    "width zero"])
def test_a_damaged_partial_record_is_ignored_with_a_warning(model, tmp_path, monkeypatch, caplog, damage):
    cache = proofs(tmp_path)
    interrupted(model, cache, at=3)
    (path,) = cache.store.dir.glob("*.json")
    record = json.loads(path.read_text())
    if damage == "truncated":  # a write cut short
        path.write_text(path.read_text()[:40])
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        record["value"].update({"width out of range": {"proven_widths": WIDEST + 1},
                                "width as text": {"proven_widths": "3"},
                                "not partial": {"partial": False},
                                "width zero": {"proven_widths": 0}}[damage])
        path.write_text(json.dumps(record))
    with counted_widths() as widths, caplog.at_level(logging.WARNING):
        proof = ragged_selftest.prove_ragged_cached(model, LIMIT, proofs(tmp_path), pass_rows=WIDEST)
    assert proof.passed and proof.resumed == 0
    assert widths == [1, 2, 3, 4]
    assert "ignoring" in caplog.text


def test_a_width_that_fails_is_never_kept_as_proven(loaded, model, tmp_path, monkeypatch):
    """Natively on the shape-variant double width 2 differs: only width 1 is kept before it,
    then the failure replaces it."""
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from tests.doubles.shape_variant import shape_variant_backend

    cache = proofs(tmp_path)
    stored = []
    put = cache.store.put
    monkeypatch.setattr(cache.store, "put", lambda key, value: stored.append(dict(value)) or put(key, value))
    set_batch_invariant_limit(model, 0)
    try:
        with shape_variant_backend():
            proof = ragged_selftest.prove_ragged_cached(model, LIMIT, cache, pass_rows=WIDEST)
    finally:
        install_limit(loaded)
    assert not proof.passed and "ragged pass of 2 rows" in proof.reason
    assert [v.get("proven_widths") for v in stored if v.get("partial")] == [1]
    assert stored[-1]["passed"] is False


# ------------------------------------------------------------------ setup: only what is left to prove

@pytest.mark.parametrize("record", ["finished", "every width kept"])
def test_a_record_of_every_width_sets_up_nothing(model, tmp_path, monkeypatch, record):
    """Over the KV pool (the proof's setup then makes a pool too): no cache, prefill, solo or
    width pass; the proof holds for every width."""
    options = {"pass_rows": WIDEST, "kv_pool": "reference"}
    if record == "finished":
        assert ragged_selftest.prove_ragged_cached(model, LIMIT, proofs(tmp_path), **options)
    else:
        interrupted(model, proofs(tmp_path), at=WIDEST, kv_pool="reference")
    setup, called = {}, []
    with counted_widths(setup=setup) as widths:
        proof = ragged_selftest.prove_ragged_cached(model, LIMIT, proofs(tmp_path), on_width=called.append, **options)
    assert proof.passed and proof.widths == tuple(range(1, WIDEST + 1))
    assert widths == [] and setup == {"caches": 0, "prefills": 0, "solo": [], "members": set()}
    assert called == ([] if record == "finished" else [WIDEST])  # the kept widths in force at once


def test_a_resumed_proof_sets_up_only_the_members_of_the_widths_left(model, tmp_path, monkeypatch):
    """Each request the remaining widths' passes hold is prefilled and run alone once; no other."""
    interrupted(model, proofs(tmp_path), at=WIDEST - 1)
    setup = {}
    with counted_widths(setup=setup) as widths:
        assert ragged_selftest.prove_ragged_cached(model, LIMIT, proofs(tmp_path), pass_rows=WIDEST)
    assert widths == [WIDEST]
    assert sorted(setup["solo"]) == sorted(setup["members"])
    assert setup["prefills"] == len(setup["members"]) and setup["caches"] == 1


# ------------------------------------------------------------------ the fallback to 1..L credits the wider proof

def test_a_failed_wider_proof_keeps_its_proven_widths_and_the_fallback_to_them_runs_no_pass(
        loaded, model, tmp_path, monkeypatch, caplog):
    """decide_guarantee as a start runs it: passes of 1..WIDEST fail at WIDEST (a kernel broken
    there), so the guarantee falls back to passes of the widths the wider proof passed (1..WIDEST-1,
    wider than L): no pass or setup of the fallback runs. A restart reads both records: nothing runs."""
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.kernels.invariance.selftest import ProofCache
    from lockstep.server.engine.guarantee.guarantee import decide_guarantee

    session = ProofCache(VerdictCache("selftest"), {"model": "embedded", "weights": loaded.weights})
    invariance = set_batch_invariant_limit(model, LIMIT, proof_cache=session)  # already installed: cached

    def decide():
        return decide_guarantee(model, invariance, "off", proofs(tmp_path), pass_rows=WIDEST, shared_prefill=False)

    setup = {}
    with counted_widths(broken_width=WIDEST, setup=setup) as widths, caplog.at_level(logging.INFO):
        guarantee = decide()
    assert widths == list(range(1, WIDEST + 1))  # the fallback's widths 1..L not again
    assert setup["caches"] == 1  # the wider proof's; the fallback's set up nothing
    assert guarantee.shared_passes and guarantee.pass_rows == WIDEST - 1 > LIMIT
    assert f"passes of 1..{WIDEST - 1} rows were proven by the proof of 1..{WIDEST} rows" in caplog.text
    wider, fallback = sorted(records(proofs(tmp_path).store), key=lambda r: "proven_widths" not in r)
    assert wider["passed"] is False and wider["proven_widths"] == WIDEST - 1
    assert fallback["passed"] is True
    with counted_widths(broken_width=WIDEST, setup=setup) as widths:
        assert decide() == guarantee
    assert widths == [] and setup["caches"] == 0


def test_a_wider_proof_failing_below_l_falls_back_to_passes_of_l_rows(loaded, model, tmp_path, monkeypatch):
    """The wider proof fails at width 1: the fallback is to L (which then fails too), never narrower."""
    with counted_widths(broken_width=1) as widths:
        guarantee = decide_from_wider(loaded, model, tmp_path)
    assert widths == [1, 1] and not guarantee.shared_passes


def test_a_distributed_fallback_is_to_l_whatever_widths_a_rank_passed(loaded, model, tmp_path, monkeypatch):
    """Under `agreed_proofs` a failed wider proof's widths are one rank's own: every rank falls
    back to passes of L rows and proves them itself (the same passes, so the same collectives)."""
    import types

    import lockstep.server.distributed.proofs as distributed_proofs

    monkeypatch.setattr(distributed_proofs, "gather_bytes", lambda group, blob: [blob])  # one rank
    with distributed_proofs.agreed_proofs(types.SimpleNamespace(group=None)), \
            counted_widths(broken_width=WIDEST) as widths:
        guarantee = decide_from_wider(loaded, model, tmp_path)
    assert widths == [*range(1, WIDEST + 1), *range(1, LIMIT + 1)]
    assert guarantee.shared_passes and guarantee.pass_rows == LIMIT


def decide_from_wider(loaded, model, tmp_path):
    """decide_guarantee for passes of 1..WIDEST at L, with the embedded model's installed invariance."""
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.kernels.invariance.selftest import ProofCache
    from lockstep.server.engine.guarantee.guarantee import decide_guarantee

    session = ProofCache(VerdictCache("selftest"), {"model": "embedded", "weights": loaded.weights})
    invariance = set_batch_invariant_limit(model, LIMIT, proof_cache=session)  # already installed: cached
    return decide_guarantee(model, invariance, "off", proofs(tmp_path), pass_rows=WIDEST, shared_prefill=False)


@pytest.mark.parametrize("change", ["weights", "limit", "pass_rows", "kv_pool", "kernel code", "damaged"])
def test_the_fallback_takes_no_credit_from_a_record_of_another_key(model, tmp_path, monkeypatch, caplog, change):
    """A wider proof that failed at WIDEST with 1..WIDEST-1 proven; the fallback to 1..L of another
    deployment (or against a damaged record) proves every width of its own."""
    with counted_widths(broken_width=WIDEST):
        assert not ragged_selftest.prove_ragged_cached(model, LIMIT, proofs(tmp_path), pass_rows=WIDEST)
    limit, options, cache = LIMIT, {"credit_from": WIDEST}, proofs(tmp_path)
    if change == "weights":
        cache = proofs(tmp_path, weights="digest-b")
    elif change == "limit":
        limit = 1
    elif change == "pass_rows":
        options["credit_from"] = WIDEST + 1  # a wider pass than the one whose record is kept
    elif change == "kv_pool":
        options["kv_pool"] = "reference"
    elif change == "kernel code":
        import lockstep.kernels.invariance.selftest as selftest

        monkeypatch.setattr(selftest, "kernels_code_version", lambda: "another kernel source")
    else:
        (path,) = cache.store.dir.glob("*.json")
        record = json.loads(path.read_text())
        record["value"]["proven_widths"] = "3"
        path.write_text(json.dumps(record))
    with counted_widths() as widths, caplog.at_level(logging.WARNING):
        proof = ragged_selftest.prove_ragged_cached(model, limit, cache, pass_rows=limit, **options)
    assert proof.passed and proof.resumed == 0
    assert widths == list(range(1, limit + 1))
    assert ("ignoring" in caplog.text) == (change == "damaged")


def test_the_fallback_never_credits_the_width_the_wider_proof_failed_at(model, tmp_path, monkeypatch):
    """The wider proof fails at width L: the fallback is credited 1..L-1 and proves L itself."""
    with counted_widths(broken_width=LIMIT):
        assert not ragged_selftest.prove_ragged_cached(model, LIMIT, proofs(tmp_path), pass_rows=WIDEST)
    with counted_widths() as widths:
        proof = ragged_selftest.prove_ragged_cached(model, LIMIT, proofs(tmp_path), pass_rows=LIMIT,
                                                    credit_from=WIDEST)
    assert proof.passed and proof.resumed == LIMIT - 1 and widths == [LIMIT]


def test_a_distributed_fallback_takes_no_credit(model, tmp_path, monkeypatch):
    """Each rank keeps its own widths, not the agreed ones: ranks crediting different widths would
    run different passes (collectives), so under `agreed_proofs` the fallback proves 1..L itself."""
    import types

    import lockstep.server.distributed.proofs as distributed_proofs

    with counted_widths(broken_width=WIDEST):
        assert not ragged_selftest.prove_ragged_cached(model, LIMIT, proofs(tmp_path), pass_rows=WIDEST)
    monkeypatch.setattr(distributed_proofs, "gather_bytes", lambda group, blob: [blob])  # one rank
    with distributed_proofs.agreed_proofs(types.SimpleNamespace(group=None)), counted_widths() as widths:
        proof = ragged_selftest.prove_ragged_cached(model, LIMIT, proofs(tmp_path), pass_rows=LIMIT,
                                                    credit_from=WIDEST)
    assert proof.passed and proof.resumed == 0 and widths == list(range(1, LIMIT + 1))
