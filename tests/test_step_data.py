"""What passes between the scheduler and the model runner (server/engine/runner/step_data.py) is
plain data: the scheduler says which requests run how many rows, the runner returns the
tokens it chose, and the scheduler's update alone advances the requests."""
from types import SimpleNamespace

from lockstep.server.engine.guarantee.decode_plan import PLAIN, DecodePlan, Determinism
from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.generate import generate
from lockstep.server.engine.scheduling.kv_budget import KVBudget
from lockstep.server.engine.runner.model_runner import ModelRunner
from lockstep.server.engine.decoding.request_state import GenerationRequest, RequestState
from lockstep.server.engine.decoding.sampling import Sampled, SamplingParams
from lockstep.server.engine.scheduling.scheduler import Scheduler, Slot
from lockstep.server.engine.runner.step_data import (DecodeRows, ModelRunnerOutput, PassOutput, PrefillResult,
                                              SampledTokens, ScheduledPass, SchedulerOutput)
from tests.deterministic_fixtures import TinyLoaded
from tests.test_deterministic_double import peaked_llama

GREEDY = SamplingParams(temperature=0.0)
DEPLOYMENT = Deployment()
LOOKUP = DecodePlan(Determinism.NONE, "prompt_lookup", 3)


class _NoRunner:
    """What the scheduler asks of a runner outside a step; it never runs anything here."""

    batched = True
    kv_pool = None

    @staticmethod
    def release(cache):
        pass

    @staticmethod
    def describe():
        return {}


def scheduler_with(loaded, runner, plans: list[DecodePlan], prompt=(1, 2, 3), max_tokens=4):
    """A scheduler whose requests (one per plan) have their prompts prefilled: by `runner`
    where it has a model, else by hand-built results (nothing reads the KV then)."""
    scheduler = Scheduler(loaded, runner, deployment=DEPLOYMENT, max_active=4, active_per_request=4,
                          max_batch_rows=16, kv_budget=KVBudget(None))
    failed = []
    scheduler.on_fail = lambda handle, exc: failed.append((handle, exc))
    for plan in plans:
        handle = SimpleNamespace(cancelled=False, leader=None, client_cancelled=False)
        cache = runner.new_cache(64) if loaded.model is not None else []
        state = RequestState(loaded, GenerationRequest(list(prompt), max_tokens, GREEDY), plan=plan,
                             deployment=DEPLOYMENT, cache=cache)
        scheduler.active.append(Slot(handle, state, 0))
    while any(slot.state.prefilling for slot in scheduler.active):
        output = scheduler.schedule_prefill()
        if loaded.model is None:
            done = ModelRunnerOutput(prefill_alone=[PrefillResult(slot.state.next_chunk_tokens(), "target")
                                                    for slot in output.prefill_alone],
                                     prefill_shared=[slot.state.next_chunk_tokens() for slot in output.prefill_shared])
        else:
            done = runner.execute(output)
        scheduler.update_from_output(output, done)
    return scheduler, failed


def test_a_hand_built_runner_output_advances_requests_by_exactly_its_tokens():
    loaded = TinyLoaded(model=None)
    scheduler, failed = scheduler_with(loaded, _NoRunner(), [PLAIN, LOOKUP])
    plain, lookup = scheduler.active

    output = scheduler.schedule_decode()
    (scheduled,) = output.passes
    assert [(m.slot, m.token) for m in scheduled.members] == [(plain, 3), (lookup, 3)]
    assert scheduled.members[0].k == 0 and scheduled.members[1].k >= 0  # how many drafts: the scheduler's word

    ran = PassOutput(rows=3, members=[SampledTokens([Sampled(7)]),
                                      SampledTokens([Sampled(8), Sampled(9)], drafts=[8, 5])])
    posts = scheduler.update_from_output(output, ModelRunnerOutput(passes=[ran]))
    assert plain.state.token_ids == [7] and lookup.state.token_ids == [8, 9]
    assert (lookup.state.stats.drafted, lookup.state.stats.accepted, lookup.state.stats.passes) == (2, 1, 1)
    assert [("".join(d.text for d in deltas)) for _, deltas in posts] == [loaded.tokenizer.decode([7]),
                                                                         loaded.tokenizer.decode([8, 9])]
    assert not failed

    # the next pass starts from each request's last token, and a request at max_tokens finishes
    output = scheduler.schedule_decode()
    assert [m.token for m in output.passes[0].members] == [7, 9]
    ran = PassOutput(rows=2, members=[SampledTokens([Sampled(4)]), SampledTokens([Sampled(6), Sampled(5)], [6])])
    scheduler.update_from_output(output, ModelRunnerOutput(passes=[ran]))
    assert plain.state.token_ids == [7, 4] and lookup.state.token_ids == [8, 9, 6, 5]
    assert lookup.state.finished and scheduler.active == [plain]


def test_a_member_whose_drafting_or_sampling_failed_fails_alone():
    scheduler, failed = scheduler_with(TinyLoaded(model=None), _NoRunner(), [PLAIN, PLAIN])
    first, second = scheduler.active
    output = scheduler.schedule_decode()
    boom = RuntimeError("drafter failed")
    scheduler.update_from_output(output, ModelRunnerOutput(passes=[PassOutput(1, [boom, SampledTokens([Sampled(7)])])]))
    assert failed == [(first.handle, boom)] and scheduler.active == [second]
    assert first.state.token_ids == [] and second.state.token_ids == [7]


def test_the_runner_returns_the_tokens_it_chose_and_leaves_the_requests_as_they_were():
    loaded = TinyLoaded(peaked_llama())
    runner = ModelRunner(loaded.model, DEPLOYMENT, pool_tokens=256)
    prompt = [3, 14, 15, 92, 65, 35, 3, 14, 15, 92, 65]
    scheduler, failed = scheduler_with(loaded, runner, [PLAIN, LOOKUP], prompt=prompt, max_tokens=8)
    plain, lookup = scheduler.active
    output = SchedulerOutput(passes=[ScheduledPass([DecodeRows(plain, prompt[-1]), DecodeRows(lookup, prompt[-1], 3)])])
    result = runner.execute(output)

    (ran,) = result.passes
    first, second = ran.members
    assert isinstance(first, SampledTokens) and isinstance(second, SampledTokens)
    assert all(type(c) is Sampled and type(c.token) is int for c in first.chosen + second.chosen)
    assert first.drafts == [] and len(first.chosen) == 1
    assert second.drafts == [35, 3, 14]  # prompt lookup's guess after "3 14 15 92 65", asked for by the runner
    assert 1 <= len(second.chosen) <= 4 and ran.rows == 1 + 4
    assert plain.state.token_ids == lookup.state.token_ids == []  # only the scheduler's update advances them

    solo = [d for d in generate(loaded, GenerationRequest(prompt, 1, GREEDY)) if d]
    assert first.tokens == list(solo[-1].token_ids)
    scheduler.update_from_output(output, result)
    assert plain.state.token_ids == first.tokens and lookup.state.token_ids == second.tokens and not failed
