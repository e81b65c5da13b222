"""What a start costs and re-uses: startup phases, `--audit cached|fresh|off`, the CPU
default (`--cpu-blas auto`, `--weights auto`). The verdict cache is a temporary dir."""
import dataclasses
import logging

import pytest

from lockstep.kernels.verdict_cache import ROOT_ENV
from lockstep.models import resolve
from lockstep.server import cli
from lockstep.server.commands.runtime_args import auto_cpu_blas, options_from_args
from lockstep.server.runtime import Options, build_runtime
from tests.synthetic import build_llama_dir, write_tiny_tokenizer

PHASES = {"import", "load", "audit", "self_test", "warm_up"}


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    path = build_llama_dir(tmp_path_factory.mktemp("nvfp4"), q_mode="nvfp4")
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def aligned_dir(tmp_path_factory):
    """nvfp4 with every dim a multiple of 32: no CPU fault, so it runs unaudited too."""
    path = build_llama_dir(tmp_path_factory.mktemp("aligned"), q_mode="nvfp4", hidden=1024,
                           intermediate=2048, heads=8)
    write_tiny_tokenizer(path)
    return path


@pytest.fixture
def verdicts(tmp_path, monkeypatch):
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "verdicts"))
    return tmp_path / "verdicts"


def start(model_dir, **options):
    # passes of at most L rows: the ragged proof covers 1..L only (no test here is about wide passes)
    return build_runtime(Options(model=str(model_dir), batch_invariant_limit=2, max_batch_rows=2, **options))


def test_restart_reuses_audit_verdicts_and_the_proof(nvfp4_dir, verdicts):
    first = start(nvfp4_dir).model_info()
    again = start(nvfp4_dir).model_info()
    assert first["audit"]["cached"] == 0 and first["audit"]["mode"] == "cached"
    assert again["audit"]["cached"] == again["audit"]["configurations"] == 5
    assert again["audit"]["workarounds"] == first["audit"]["workarounds"] != {}
    assert not first["startup"]["self_test_cached"] and again["startup"]["self_test_cached"]
    assert again["batch_invariance"] == first["batch_invariance"]
    assert again["batch_invariance"]["guaranteed"]
    assert {p.name for p in verdicts.iterdir()} == {"audit", "selftest"}


def test_fresh_redoes_both(nvfp4_dir, verdicts):
    start(nvfp4_dir)
    info = start(nvfp4_dir, audit="fresh").model_info()
    assert info["audit"]["cached"] == 0 and info["audit"]["mode"] == "fresh"
    assert not info["startup"]["self_test_cached"]


def test_startup_phases_are_reported(nvfp4_dir, verdicts):
    runtime = start(nvfp4_dir, quantize=None)
    phases = runtime.model_info()["startup"]["phases_s"]
    assert PHASES <= set(phases) and all(v >= 0 for v in phases.values())
    assert phases["import"] > 0  # the interpreter and imports ran before build_runtime
    assert runtime.model_info()["startup"]["total_s"] == pytest.approx(sum(phases.values()), abs=0.05)


def test_the_engines_construction_is_a_phase_of_serves_start(nvfp4_dir, verdicts):
    from lockstep.server.commands import serve

    args = cli.build_parser().parse_args(["serve", "--model", str(nvfp4_dir), "--batch-invariant-limit", "0"])
    runtime, engine = serve.start_engine(args)
    try:
        startup = runtime.model_info()["startup"]
        phases = list(startup["phases_s"])
        assert phases.index("engine") == phases.index("warm_up") + 1  # after the runtime's own phases
        assert startup["phases_s"]["engine"] >= 0
        assert startup["total_s"] == pytest.approx(sum(startup["phases_s"].values()), abs=0.05)
    finally:
        engine.stop()


def test_quantize_is_its_own_phase(nvfp4_dir, verdicts, tmp_path_factory):
    plain = build_llama_dir(tmp_path_factory.mktemp("float"))
    write_tiny_tokenizer(plain)
    info = build_runtime(Options(model=str(plain), quantize="nvfp4")).model_info()
    assert "quantize" in info["startup"]["phases_s"] and info["audit"]["workarounds"]


def test_audit_off_warns_and_shows_in_models_and_fingerprint(aligned_dir, verdicts, caplog):
    audited = start(aligned_dir)
    with caplog.at_level(logging.WARNING):
        unaudited = start(aligned_dir, audit="off")
    assert "NOT audited" in caplog.text
    info = unaudited.model_info()
    assert info["audit"]["mode"] == "off" and "NOT audited" in info["audit"]["warning"]
    assert info["transform"].endswith(";audit=off")
    assert unaudited.deployment.fingerprint != audited.deployment.fingerprint
    assert unaudited.audit is None and "audit" not in info["startup"]["phases_s"]


def test_audit_off_on_a_faulty_model_fails_at_start_naming_why(nvfp4_dir, verdicts):
    from lockstep.models.errors import ModelError

    with pytest.raises(ModelError, match=r"warm-up forward pass failed.*reshape.*--audit off"):
        build_runtime(Options(model=str(nvfp4_dir), audit="off"))


def test_serve_flags(monkeypatch):
    parser = cli.build_parser()
    defaults = parser.parse_args(["serve"])
    assert defaults.audit == "cached" and defaults.cpu_blas == "auto"
    assert options_from_args(defaults).audit == "cached"
    assert options_from_args(parser.parse_args(["serve", "--audit", "off"])).audit == "off"
    assert parser.parse_args(["audit", "m", "--fresh"]).fresh
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--audit", "sometimes"])


def test_cpu_default_is_openblas_with_float32(monkeypatch):
    assert auto_cpu_blas() == "openblas"  # this CI host: Linux, MLX on the CPU
    import lockstep.models.backend as backend

    monkeypatch.setattr(backend, "cpu_blas_in_use", lambda: "reference")
    assert resolve.auto_weights() == "q4"  # float32 without OpenBLAS decodes ~3x slower
    monkeypatch.setattr(backend, "cpu_blas_in_use", lambda: "openblas")
    assert resolve.auto_weights() == "float32"
    assert resolve.resolve_weights("auto") == "float32"


def test_a_deferred_guarantee_is_proven_by_the_engine_after_serving_starts(aligned_dir, verdicts):
    """`serve`'s start: the runtime is ready with its proofs left to do; the engine runs them,
    and only then is the deployment guaranteed, as one proven before serving is."""
    from lockstep.server.engine import Engine
    from tests.http_server import wait_until

    deferred = build_runtime(Options(model=str(aligned_dir), batch_invariant_limit=2, max_batch_rows=2),
                             defer_guarantee=True)
    assert deferred.pending is not None and deferred.guarantee.state == "proving"
    assert not deferred.deployment.guarantee.guaranteed and deferred.deployment.guarantee.call_rows == 2
    before = deferred.model_info()
    assert before["batch_invariance"]["state"] == "proving" and "self_test" not in before["startup"]["phases_s"]
    pending_fingerprint = deferred.deployment.fingerprint

    engine = Engine(deferred.loaded, deployment=deferred.deployment, guarantee=deferred.guarantee)
    engine.start(deferred.pending)
    try:
        # settled once 1..L are proven (widths in order); the whole proof ends with its deployment installed
        wait_until(lambda: deferred.guarantee.settled and deferred.guarantee_seconds is not None
                   and not engine.starting and engine.deployment is deferred.deployment, timeout=300,
                   what="the deferred proofs")
    finally:
        engine.stop()
    after = deferred.model_info()
    assert deferred.guarantee.state == "in_force" and engine.deployment is deferred.deployment
    assert engine.scheduler.deployment is engine.runner.deployment is deferred.deployment
    assert deferred.deployment.guarantee.guaranteed and deferred.deployment.guarantee.shared_passes
    assert after["batch_invariance"]["state"] == "in_force" and after["startup"]["guarantee_s"] >= 0
    assert {"self_test", "ragged_proof"} <= set(after["startup"]["phases_s"])
    assert deferred.deployment.fingerprint != pending_fingerprint
    # the batched-sampling proof ran last, for the widest pass deterministic rows share
    assert deferred.deployment.guarantee.sampling_rows == deferred.deployment.guarantee.pass_rows == 2
    assert "sampling_proof" in after["startup"]["phases_s"]

    proven = start(aligned_dir)  # proven before serving, proofs from the verdict cache
    assert proven.guarantee.state == "in_force" and proven.pending is None
    assert proven.deployment.fingerprint == deferred.deployment.fingerprint
    assert proven.invariance.strategy == deferred.invariance.strategy != "pending"
    assert proven.deployment.guarantee.sampling_rows == 2  # proven in place (verify, bench), from the cache


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    path = build_llama_dir(tmp_path_factory.mktemp("float32"))
    write_tiny_tokenizer(path)
    return path


def test_default_quantized_on_the_cpu_loads_no_draft_and_says_why(float_dir, verdicts, caplog):
    """On the CPU a 4-bit copy decodes slower than the target: none is loaded, and requests
    asking for drafts get the plain answer with the reason."""
    from lockstep.server.engine.guarantee.decode_plan import plan_request

    with caplog.at_level(logging.WARNING, logger="lockstep.runtime"):
        runtime = build_runtime(Options(model=str(float_dir), draft_model="default-quantized"), defer_guarantee=True)
    assert runtime.pending is None and runtime.deployment.draft_model is None
    assert "draft_load" not in runtime.timings
    reason = runtime.deployment.draft_refusal
    assert "no draft cheaper than the target" in reason and reason in caplog.text
    assert runtime.model_info()["draft_model_state"] == f"not drafted from: {reason}"
    plan = plan_request(runtime.deployment, deterministic=False, speculative="draft", num_draft_tokens=2)
    assert plan.method == "none" and reason in plan.note
    # verify and bench check drafting itself: they load it whatever it costs
    checked = build_runtime(Options(model=str(float_dir), draft_model="default-quantized", draft_where_it_pays=False))
    assert checked.deployment.draft_model is not None and checked.deployment.draft_refusal == ""


def test_a_deferred_draft_model_is_loaded_after_the_guarantee_and_drafts_wait_for_it(float_dir, verdicts,
                                                                                      monkeypatch):
    from lockstep.server import draft_assessment
    from lockstep.server.engine import Engine
    from lockstep.server.engine.decoding import draft_costs, speculative
    from lockstep.server.engine.guarantee.decode_plan import RequestRejected, plan_request
    from tests.http_server import wait_until

    # as on a GPU: the 4-bit copy is the cheap draft, measured far cheaper than the target
    monkeypatch.setattr(draft_assessment, "no_cheap_draft", lambda options: "")
    monkeypatch.setattr(draft_costs, "measure_draft_costs",
                        lambda target, draft: draft_costs.DraftCosts(0.01, 0.001, 0.001))
    # and a verification pass of k + 1 rows costing about one pass (measured here, this CPU's
    # wider passes decided whether drafting pays: the test failed on a loaded machine)
    monkeypatch.setattr(speculative, "measure_pass_costs", lambda model, widths, **k: [0.010] * widths)
    runtime = build_runtime(Options(model=str(float_dir), batch_invariant_limit=2, max_batch_rows=2,
                                    draft_model="default-quantized"), defer_guarantee=True)
    assert [type(w).__name__ for w in runtime.pending] == ["GuaranteeWork", "DraftWork", "SamplingWork"]
    assert runtime.deployment.draft_loading and runtime.deployment.draft_model is None
    assert "draft_load" not in runtime.timings and runtime.model_info()["draft_model_state"] == "loading"
    waiting = plan_request(runtime.deployment, deterministic=False, speculative="draft", num_draft_tokens=2)
    assert waiting.method == "none" and "still being loaded" in waiting.note

    engine = Engine(runtime.loaded, deployment=runtime.deployment, guarantee=runtime.guarantee)
    engine.start(runtime.pending)
    try:
        wait_until(lambda: not engine.deployment.draft_loading, timeout=300, what="the draft model")
    finally:
        engine.stop()
    deployment = engine.deployment
    assert runtime.guarantee.state == "in_force" and deployment.guarantee.guaranteed  # the proofs' result is kept
    assert deployment.draft_model is not None and "draft_model_state" not in runtime.model_info()
    assert {"draft_load", "draft_quantize", "draft_audit", "draft_costs"} <= set(runtime.timings)
    assert deployment.draft_refusal == "" and deployment.draft_prefill_tokens == 200
    drafting = plan_request(deployment, deterministic=True, speculative="draft", num_draft_tokens=1)
    assert drafting.method == "draft" and drafting.guaranteed

    failed = dataclasses.replace(deployment, draft_model=None, draft_problem="ValueError: other tokenizer")
    with pytest.raises(RequestRejected, match="could not be loaded: ValueError: other tokenizer"):
        plan_request(failed, deterministic=False, speculative="draft", num_draft_tokens=2)


def test_a_prefill_chunk_below_1_is_refused_before_the_model_loads():
    with pytest.raises(ValueError, match="--prefill-chunk must be >= 1"):
        build_runtime(Options(model="/nonexistent/model", prefill_chunk=0))
