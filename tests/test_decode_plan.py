"""Decode plans (server/engine/guarantee/decode_plan.py) and the limit's environment names
(server/runtime.py). No model: fast."""
import pytest

from lockstep.server.engine.guarantee.decode_plan import METHODS, DecodePlan, RequestRejected, plan_request

from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.guarantee.guarantee import Guarantee
from lockstep.server.runtime import LIMIT_ENV, limit_from_env
from lockstep.server.engine.decoding.request_report import RequestReport

DRAFT = object()  # stands in for a draft model: plan_request only checks it is there
PROVEN = Deployment(guarantee=Guarantee(6, proven=True, shared_passes=True), num_draft_tokens=4,
                    draft_model=DRAFT)


def plan(deployment=PROVEN, *, deterministic=True, speculative=None, k=None) -> DecodePlan:
    return plan_request(deployment, deterministic=deterministic, speculative=speculative, num_draft_tokens=k)


def rejected(deployment=PROVEN, **kwargs) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        plan(deployment, **kwargs)
    return info.value


# ------------------------------------------------------------------ deterministic, L proven

@pytest.mark.parametrize("method", ["draft", "prompt_lookup"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_deterministic_allows_every_k_up_to_limit_minus_one(method, k):
    p = plan(speculative=method, k=k)
    assert (p.determinism, p.method, p.num_draft_tokens, p.guaranteed, p.note) == ("shared", method, k, True, "")


@pytest.mark.parametrize("method", ["draft", "prompt_lookup"])
@pytest.mark.parametrize("k", [6, 7, 12])
def test_deterministic_refuses_k_of_limit_or_more_naming_the_param(method, k):
    error = rejected(speculative=method, k=k)
    assert error.param == "num_draft_tokens"
    assert "at most 5" in str(error) and "6" in str(error)


def test_non_deterministic_requests_are_not_bounded_by_the_limit():
    p = plan(deterministic=False, speculative="prompt_lookup", k=12)
    assert (p.determinism, p.method, p.num_draft_tokens, p.guaranteed) == ("none", "prompt_lookup", 12, False)
    assert plan(deterministic=False).method == "none"  # the deployment's default method


def test_the_deployment_default_k_is_clipped_not_refused():
    wide = Deployment(guarantee=Guarantee(6, proven=True), speculative="draft", num_draft_tokens=9, draft_model=DRAFT)
    p = plan(wide)  # neither method nor k chosen by the request
    assert (p.method, p.num_draft_tokens, p.guaranteed) == ("draft", 5, True)
    assert plan(wide, speculative="prompt_lookup").num_draft_tokens == 5
    assert rejected(wide, speculative="prompt_lookup", k=9).param == "num_draft_tokens"  # chosen: refused


def test_limit_one_leaves_no_room_for_drafts():
    one = Deployment(guarantee=Guarantee(1, proven=True), speculative="prompt_lookup", num_draft_tokens=4)
    p = plan(one)
    assert (p.method, p.num_draft_tokens, p.guaranteed) == ("none", 0, True)
    assert rejected(one, speculative="prompt_lookup", k=1).param == "num_draft_tokens"


def test_method_none_carries_no_draft_tokens():
    p = plan(speculative="none", k=3)
    assert (p.method, p.num_draft_tokens) == ("none", 0)


def test_unknown_method_and_missing_draft_model_are_refused():
    assert rejected(speculative="medusa").param == "speculative"
    no_draft = Deployment(guarantee=Guarantee(6, proven=True))
    error = rejected(no_draft, speculative="draft", k=2)
    assert error.param == "speculative" and "draft model" in str(error)
    # the refusal does not depend on determinism
    assert rejected(no_draft, deterministic=False, speculative="draft").param == "speculative"
    assert plan(no_draft, speculative="prompt_lookup", k=2).method == "prompt_lookup"  # control


# ------------------------------------------------------------------ deterministic, L off / unproven

@pytest.mark.parametrize("method, k", [(None, None), ("none", None), ("prompt_lookup", 3),
                                       ("draft", 5), ("prompt_lookup", 16)])
def test_limit_zero_runs_without_speculation_in_passes_of_its_own_with_a_note(method, k):
    off = Deployment(speculative="prompt_lookup", draft_model=DRAFT)
    p = plan(off, speculative=method, k=k)
    assert (p.determinism, p.method, p.num_draft_tokens, p.guaranteed) == ("alone", "none", 0, False)
    assert "limit is 0" in p.note and "without speculation, in passes of its own" in p.note
    info = RequestReport.planned(p, off).render()
    assert info == {"deterministic": True, "batch_invariant_limit": 0, "guaranteed": False,
                    "speculative": "none", "num_draft_tokens": 0, "note": p.note}


def test_unproven_limit_is_not_trusted():
    unproven = Deployment(guarantee=Guarantee(6), draft_model=DRAFT)
    p = plan(unproven, speculative="draft", k=3)
    assert (p.method, p.num_draft_tokens, p.determinism) == ("none", 0, "alone")
    assert "not proven" in p.note
    assert RequestReport.planned(p, unproven).render()["guaranteed"] is False
    assert RequestReport.planned(p, unproven).render()["batch_invariant_limit"] == 6


def test_extension_reports_the_guarantee_only_for_deterministic_requests():
    det = plan(speculative="prompt_lookup", k=2)
    assert RequestReport.planned(det, PROVEN).render() == {
        "deterministic": True, "batch_invariant_limit": 6, "guaranteed": True, "speculative": "prompt_lookup",
        "num_draft_tokens": 2}
    loose = plan(deterministic=False, speculative="prompt_lookup", k=2)
    assert RequestReport.planned(loose, PROVEN).render()["guaranteed"] is False
    assert "note" not in RequestReport.planned(loose, PROVEN).render()


def test_every_speculative_method_has_a_drafter():
    from lockstep.server.engine.decoding.drafters import DraftModelDrafter, PromptLookupDrafter

    assert set(METHODS) == {"none", DraftModelDrafter.name, PromptLookupDrafter.name}


# ------------------------------------------------------------------ limit_from_env

def test_limit_from_env_names_and_precedence():
    lock, alias = LIMIT_ENV
    assert (lock, alias) == ("LOCKSTEP_BATCH_INVARIANT_LIMIT", "MLX_METAL_BATCH_INVARIANT_LIMIT")
    assert limit_from_env({}) == 0
    assert limit_from_env({alias: "8"}) == 8
    assert limit_from_env({lock: "4"}) == 4
    assert limit_from_env({lock: "4", alias: "8"}) == 4  # lockstep's own name wins
    assert limit_from_env({lock: "0", alias: "8"}) == 0  # even when it turns the mode off
    assert limit_from_env({lock: " 3 ", alias: "x"}) == 3  # the alias is not even parsed
    assert limit_from_env({lock: "  ", alias: "5"}) == 5  # blank counts as unset


@pytest.mark.parametrize("value", ["abc", "1.5", "-1", "8x"])
@pytest.mark.parametrize("which", [0, 1])
def test_limit_from_env_rejects_bad_values_naming_the_variable(value, which):
    name = LIMIT_ENV[which]
    with pytest.raises(ValueError) as info:
        limit_from_env({name: value})
    assert name in str(info.value) and value in str(info.value)


def test_serve_flag_beats_environment(monkeypatch):
    import argparse

    from lockstep.server.commands.runtime_args import add_determinism_arguments, add_model_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    add_determinism_arguments(parser)
    monkeypatch.setenv("MLX_METAL_BATCH_INVARIANT_LIMIT", "8")
    monkeypatch.delenv("LOCKSTEP_BATCH_INVARIANT_LIMIT", raising=False)
    assert options_from_args(parser.parse_args([])).batch_invariant_limit == 8
    monkeypatch.setenv("LOCKSTEP_BATCH_INVARIANT_LIMIT", "3")
    assert options_from_args(parser.parse_args([])).batch_invariant_limit == 3
    assert options_from_args(parser.parse_args(["--batch-invariant-limit", "0"])).batch_invariant_limit == 0
    monkeypatch.setenv("LOCKSTEP_BATCH_INVARIANT_LIMIT", "oops")
    with pytest.raises(ValueError):
        options_from_args(parser.parse_args([]))


def test_adaptive_speculation_flag_reaches_the_deployment_with_measured_costs(monkeypatch):
    import argparse

    import lockstep.server.engine.decoding.speculative as speculative
    from lockstep.server.commands.runtime_args import add_determinism_arguments, add_model_arguments, options_from_args
    from lockstep.server.runtime import build_runtime

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    add_determinism_arguments(parser)
    monkeypatch.delenv("LOCKSTEP_BATCH_INVARIANT_LIMIT", raising=False)
    monkeypatch.delenv("MLX_METAL_BATCH_INVARIANT_LIMIT", raising=False)
    assert options_from_args(parser.parse_args([])).adaptive_speculation is False
    options = options_from_args(parser.parse_args(["--adaptive-speculation", "--max-draft-tokens", "3",
                                                   "--num-draft-tokens", "2"]))
    assert options.adaptive_speculation is True
    widths = []
    monkeypatch.setattr(speculative, "measure_pass_costs",
                        lambda model, w, runner=None: widths.append(w) or [float(i + 1) for i in range(w)])
    deployment = build_runtime(options).deployment
    assert deployment.adaptive_draft_tokens and deployment.pass_costs == (1.0, 2.0, 3.0, 4.0)
    assert widths == [4]  # passes of up to max_draft_tokens + 1 rows
    p = plan_request(deployment, deterministic=False, speculative="prompt_lookup", num_draft_tokens=None)
    assert p.adaptive and RequestReport.planned(p, deployment).render()["adaptive_draft_tokens"] is True


def test_a_proven_limit_without_shared_passes_plans_alone():
    """The self-test proved L but requests may not share passes (no ragged proof): the
    request keeps its speculation (its own rows are covered) in passes of its own."""
    own = Deployment(guarantee=Guarantee(6, proven=True, shared_passes=False), draft_model=DRAFT)
    p = plan(own, speculative="draft", k=3)
    assert (p.determinism, p.method, p.num_draft_tokens, p.guaranteed) == ("alone", "draft", 3, True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_k_above_the_server_maximum_is_refused_for_every_request(deterministic):
    small = Deployment(guarantee=Guarantee(64, proven=True), max_draft_tokens=8)
    error = rejected(small, deterministic=deterministic, speculative="prompt_lookup", k=9)
    assert error.param == "num_draft_tokens" and "at most 8" in str(error)
    assert plan(small, deterministic=deterministic, speculative="prompt_lookup", k=8).num_draft_tokens == 8
