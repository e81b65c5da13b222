"""RequestReport (server/engine/decoding/request_report.py): typed fields, rendered as the `lockstep`
object byte for byte as the string-keyed dict it replaces."""
import json

from lockstep.server.engine.guarantee.decode_plan import PREDICTION, DecodePlan, Determinism, plan_request
from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.generate import GenerationRequest, generate
from lockstep.server.engine.guarantee.guarantee import Guarantee
from lockstep.server.engine.decoding.request_report import RequestReport, rendered
from lockstep.server.engine.decoding.sampling import SamplingParams
from tests.deterministic_fixtures import TinyLoaded
from tests.test_deterministic_double import peaked_llama

PROVEN = Deployment(guarantee=Guarantee(6, proven=True, shared_passes=True), num_draft_tokens=4)
RECEIPT = {"version": "1", "model": None, "answer": "sha256:00", "answer_tokens": 9, "logprobs": None}


def dict_as_before(plan: DecodePlan, deployment: Deployment, drafted: int, accepted: int, passes: int,
                   receipt: dict) -> dict:
    """The `lockstep` object as DecodePlan.extension and RequestState built it before the report."""
    info = {"deterministic": plan.deterministic, "batch_invariant_limit": deployment.guarantee.call_rows,
            "guaranteed": plan.guaranteed, "speculative": plan.method, "num_draft_tokens": plan.num_draft_tokens}
    if plan.seed is not None:
        info["seed"] = plan.seed
    if plan.adaptive:
        info["adaptive_draft_tokens"] = True
    if plan.note:
        info["note"] = plan.note
    return {**info, "drafted_tokens": drafted, "accepted_tokens": accepted, "forward_passes": passes,
            "receipt": receipt}


def test_a_deterministic_speculative_report_renders_the_same_bytes_as_the_dict_before():
    plan = DecodePlan(Determinism.SHARED, "prompt_lookup", 3, guaranteed=True, note="clipped", adaptive=True, seed=7)
    report = RequestReport.planned(plan, PROVEN).finished(drafted=12, accepted=5, passes=6, receipt=RECEIPT)
    assert json.dumps(report.render()) == json.dumps(dict_as_before(plan, PROVEN, 12, 5, 6, RECEIPT))
    assert (report.deterministic, report.guaranteed, report.speculative, report.seed) == (True, True,
                                                                                          "prompt_lookup", 7)


def test_a_plain_report_leaves_out_what_it_does_not_have():
    plan = plan_request(PROVEN, deterministic=False, speculative="none", num_draft_tokens=None)
    report = RequestReport.planned(plan, PROVEN).finished(drafted=0, accepted=0, passes=3, receipt=RECEIPT)
    assert json.dumps(report.render()) == json.dumps(dict_as_before(plan, PROVEN, 0, 0, 3, RECEIPT))
    assert "seed" not in report.render() and "note" not in report.render()
    assert rendered(None) is None


def test_prediction_counts_come_from_a_prediction_only():
    assert RequestReport(speculative=PREDICTION, drafted_tokens=9, accepted_tokens=6).prediction_tokens == (6, 3)
    assert RequestReport(speculative="prompt_lookup", drafted_tokens=9, accepted_tokens=6).prediction_tokens == (0, 0)


def test_a_finished_request_reports_its_own_counts_on_its_final_delta():
    plan = plan_request(PROVEN, deterministic=True, speculative="prompt_lookup", num_draft_tokens=3)
    prompt = [3, 14, 15, 92, 65, 35, 3, 14, 15, 92, 65]
    greedy = SamplingParams(temperature=0.0)
    deltas = [d for d in generate(TinyLoaded(peaked_llama()), GenerationRequest(prompt, 10, greedy), plan=plan,
                                  deployment=PROVEN) if d]
    assert all(d.report is None for d in deltas[:-1])
    report = deltas[-1].report
    assert report.forward_passes >= 1 and report.drafted_tokens >= report.accepted_tokens >= 0
    assert report.receipt["answer_tokens"] == deltas[-1].completion_tokens == 10
    assert json.dumps(report.render()) == json.dumps(dict_as_before(
        plan, PROVEN, report.drafted_tokens, report.accepted_tokens, report.forward_passes, report.receipt))
