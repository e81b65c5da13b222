"""The one `Guarantee` (server/engine/guarantee/guarantee.py) and what reads it through
`deployment.guarantee`: the settled state, the request plan, the prefill alignment bound and
the scheduler's description. No model is loaded: the installed invariance is a stand-in."""
import dataclasses

from lockstep.kernels.invariance.limit import InstalledInvariance
from lockstep.server.engine.guarantee.decode_plan import Determinism, plan_request
from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.guarantee.guarantee import Guarantee, decide_guarantee
from lockstep.server.engine.guarantee.guarantee_state import IN_FORCE, OFF, REFUSED, settled_state
from lockstep.server.engine.decoding.request_report import RequestReport


def installed(limit: int, guaranteed: bool, request_rows: int | None = None) -> InstalledInvariance:
    return InstalledInvariance(limit, "rowwise", "cpu", guaranteed, "self-test passed" if guaranteed else "failed",
                               request_rows=limit if request_rows is None else request_rows)


def test_a_refused_limit_keeps_l_and_says_refused():
    """L stays as configured when the self-test fails: the state is refused, not off, and the
    response still names L, while nothing is guaranteed."""
    guarantee = decide_guarantee(model=None, invariance=installed(4, guaranteed=False))
    assert (guarantee.call_rows, guarantee.proven, guarantee.guaranteed) == (4, False, False)
    assert guarantee.reason == "failed" and guarantee.canonical_rows == 0
    deployment = Deployment(guarantee=guarantee)
    assert settled_state(deployment) == REFUSED
    plan = plan_request(deployment, deterministic=True, speculative=None, num_draft_tokens=None)
    assert plan.determinism == Determinism.ALONE and not plan.guaranteed
    assert RequestReport.planned(plan, deployment).render()["batch_invariant_limit"] == 4


def test_no_limit_is_off_and_a_proven_one_in_force():
    assert settled_state(Deployment()) == OFF
    assert decide_guarantee(model=None, invariance=None) == Guarantee(reason="no batch-invariant limit")
    assert settled_state(Deployment(guarantee=Guarantee(4, proven=True))) == IN_FORCE


def test_the_installed_invariance_is_copied_once_into_the_guarantee():
    invariance = installed(6, guaranteed=True)
    guarantee = Guarantee.installed(invariance)
    assert (guarantee.call_rows, guarantee.proven, guarantee.strategy, guarantee.reason, guarantee.request_rows) == (
        6, True, "rowwise", "self-test passed", 6)
    assert not guarantee.shared_passes and guarantee.pass_rows == 0  # only the ragged proof sets these


def test_canonical_rows_bound_prefill_chunks_by_l_and_by_a_requests_own_rows():
    """A prompt chunk's rows are canonical up to L, one row for a model with per-request state,
    none while the guarantee is unproven."""
    assert Guarantee(8, proven=True, request_rows=8).canonical_rows == 8
    assert Guarantee(8, proven=True, request_rows=1).canonical_rows == 1
    assert Guarantee(8, proven=True).canonical_rows == 8  # request_rows unknown: L
    assert Guarantee(8, proven=False, request_rows=8).canonical_rows == 0


def test_the_deployment_holds_l_in_its_guarantee_only():
    """One place: no Deployment field repeats L or what the proofs decided."""
    names = {f.name for f in dataclasses.fields(Deployment)}
    assert "guarantee" in names
    repeated = {f.name for f in dataclasses.fields(Guarantee)} & names
    assert not repeated and not names & {"limit", "guaranteed_rows", "strategy", "shared_pass_rows"}


def test_the_scheduler_describes_call_rows_only_where_proven():
    from lockstep.server.engine.scheduling.kv_budget import KVBudget
    from lockstep.server.engine.scheduling.scheduler import Scheduler

    class Runner:
        batched = True

        def describe(self):
            return {}

    def described(guarantee):
        scheduler = Scheduler(None, Runner(), deployment=Deployment(guarantee=guarantee), max_active=4,
                              active_per_request=4, max_batch_rows=32, kv_budget=KVBudget(1024))
        return scheduler.describe()

    proven = described(Guarantee(4, proven=True, shared_passes=True, pass_rows=16, shared_prefill_rows=16))
    assert (proven["deterministic_call_rows"], proven["deterministic_pass_rows"]) == (4, 16)
    assert proven["deterministic_rows_shared"] and proven["deterministic_prefill_rows"] == 16
    assert proven["deterministic_split_rows"] == 0  # the split proof not passed: the grid
    cut = described(Guarantee(4, proven=True, shared_passes=True, pass_rows=16, shared_prefill_rows=16,
                              prefill_split_rows=16))
    assert cut["deterministic_split_rows"] == 16
    refused = described(Guarantee(4, proven=False))
    assert (refused["deterministic_call_rows"], refused["deterministic_pass_rows"]) == (0, 0)
