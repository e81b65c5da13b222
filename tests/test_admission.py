"""server/engine/scheduling/admission.py: --max-active / --max-batch-rows sized from the KV budget on a
GPU, fixed on the CPU, explicit flags first; and the serve assembly serving with it."""
import threading

import pytest

from lockstep.server.engine.scheduling.admission import MAX_SIZED_ACTIVE, TYPICAL_REQUEST_TOKENS, admission_limits
from lockstep.server.engine.scheduling.passes import DEFAULT_MAX_ACTIVE, DEFAULT_MAX_BATCH_ROWS


def test_the_cpu_keeps_the_fixed_defaults_whatever_the_budget():
    admission = admission_limits(10**9, gpu=False)
    assert (admission.max_active, admission.max_batch_rows) == (DEFAULT_MAX_ACTIVE, DEFAULT_MAX_BATCH_ROWS)
    assert "CPU" in admission.reason


def test_a_gpu_admits_what_the_budget_holds_at_a_typical_context_within_the_bounds():
    # an 8B model's 128 KiB a token: half an H200's free memory holds ~490k tokens
    assert admission_limits(490_000, gpu=True).max_active == MAX_SIZED_ACTIVE
    held = admission_limits(40 * TYPICAL_REQUEST_TOKENS + 5, gpu=True)
    assert (held.max_active, held.max_batch_rows) == (40, 40)  # one pass takes every request's row
    assert f"holds 40 of {TYPICAL_REQUEST_TOKENS}" in held.reason
    small = admission_limits(3 * TYPICAL_REQUEST_TOKENS, gpu=True)  # the budget still gates each request
    assert (small.max_active, small.max_batch_rows) == (DEFAULT_MAX_ACTIVE, DEFAULT_MAX_BATCH_ROWS)
    assert admission_limits(None, gpu=True).max_active == MAX_SIZED_ACTIVE


def test_explicit_flags_win_on_either_backend():
    for gpu in (False, True):
        admission = admission_limits(490_000, gpu=gpu, max_active=7, max_batch_rows=5)
        assert (admission.max_active, admission.max_batch_rows) == (7, 5)
        assert "--max-active given" in admission.reason and "--max-batch-rows given" in admission.reason
    assert admission_limits(490_000, gpu=True, max_batch_rows=8).max_active == MAX_SIZED_ACTIVE
    assert admission_limits(490_000, gpu=True, max_active=48).max_batch_rows == 48


def test_serve_sizes_its_engine_and_its_pending_proof_from_the_budget(monkeypatch):
    """The real serve assembly with a stubbed GPU and KV figure: the engine admits the sized
    number, the ragged proof (run by the engine thread) covers the sized pass width, and
    /v1/models says both and why."""
    import lockstep.server.commands.serve as serve
    import lockstep.server.engine.guarantee.guarantee as guarantee
    import lockstep.server.engine.scheduling.kv_budget as kv_budget
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.server import cli

    proven_widths, proved = [], threading.Event()

    def decide(model, plan, kv_pool="off", proofs=None, pass_rows=None, **_):
        proven_widths.append(pass_rows)
        proved.set()
        return guarantee.Guarantee(plan.call_rows, False, "not proven here")

    monkeypatch.setattr(serve, "on_gpu", lambda: True)
    monkeypatch.setattr(kv_budget, "default_kv_tokens", lambda model: 40 * TYPICAL_REQUEST_TOKENS)
    monkeypatch.setattr(guarantee, "decide_guarantee", decide)
    args = cli.build_parser().parse_args(["serve", "--model", "default", "--batch-invariant-limit", "1"])
    serve.check_engine_arguments(args)
    runtime, engine = serve.start_engine(args)
    try:
        assert proved.wait(300), "the engine thread did not run the proofs"
        assert proven_widths == [40]
        assert (engine.scheduler.max_active, engine.scheduler.max_batch_rows) == (40, 40)
        card = runtime.model_info()["admission"]
        assert (card["max_active"], card["max_batch_rows"]) == (40, 40) and "KV budget" in card["reason"]
    finally:
        engine.stop()
        set_batch_invariant_limit(engine.loaded.model, 0)


def test_a_per_request_share_above_the_sized_number_is_refused():
    from types import SimpleNamespace

    from lockstep.server.commands.serve import check_per_request, serve_admission

    check_per_request(40, None)  # not known before the budget: checked at startup
    args = SimpleNamespace(max_active=None, max_batch_rows=None, max_active_per_request=40)
    with pytest.raises(ValueError, match=r"1..--max-active \(16\)"):
        serve_admission(args, SimpleNamespace(set_admission=lambda a: None), 10**9, gpu=False)
