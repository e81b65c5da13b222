"""A guarantee proven after serving starts (server/engine/guarantee/guarantee_state.py, the engine's
proofs, server/startup_work.py GuaranteeWork): plain requests are served while it is proven,
deterministic ones wait for it or get a 503 with Retry-After, and none is planned before it
settles. The held-back proof steps like a real one (`step_done` between its steps). A proof that
fails leaves the deployment serving with its guarantee refused, and every report says so."""
import asyncio
import threading

import httpx2 as httpx
import pytest

from lockstep.kernels.proof_steps import between_steps, step_done
from lockstep.server.engine.guarantee.guarantee_state import (IN_FORCE, OFF, PROVING, REFUSED, GuaranteeState,
                                                   settled_state)
from tests.test_service import fake_launchctl, mac  # noqa: F401 (fixtures: a macOS host, its launchctl)

PROMPT = [{"role": "user", "content": "Name a colour."}]


def test_a_state_settles_once_and_wakes_its_waiters():
    state = GuaranteeState(PROVING)

    async def scenario():
        early = await state.wait(0.05)  # nobody settles it: the wait runs out
        waiter = asyncio.ensure_future(state.wait(30))
        while not state._waiters:  # until the waiter is registered (it runs on this loop)
            await asyncio.sleep(0)
        assert not waiter.done()
        threading.Thread(target=state.settle, args=(IN_FORCE,)).start()  # from another thread, as the engine's
        return early, await asyncio.wait_for(waiter, 10)

    assert asyncio.run(scenario()) == (False, True)
    assert state.settled and state.describe() == {"state": IN_FORCE}
    with pytest.raises(ValueError):
        state.settle(PROVING)
    assert GuaranteeState(REFUSED).settled and GuaranteeState(OFF).settled and not GuaranteeState(PROVING).settled


def test_step_done_runs_the_callers_work_only_inside_between_steps_and_never_nested():
    calls = []

    def work():
        calls.append("work")
        step_done()  # what runs at a step must not start another round of itself

    step_done()
    with between_steps(work):
        step_done()
        step_done()
    step_done()
    assert calls == ["work", "work"]


class HeldProof:
    """Proofs that step (serving between steps) until released, then prove L for real."""

    def __init__(self, loaded, limit):
        self.loaded, self.limit = loaded, limit
        self.release = threading.Event()
        self.steps = 0

    def run(self):
        from lockstep.kernels.invariance import set_batch_invariant_limit
        from lockstep.kernels.invariance.selftest import ProofCache
        from lockstep.kernels.verdict_cache import VerdictCache
        from lockstep.server.engine.guarantee.deployment import proven_deployment

        while not self.release.is_set():
            step_done()
            self.steps += 1
            self.release.wait(0.01)  # a proof step's worth of work
        proofs = ProofCache(VerdictCache("selftest"),
                            model_identity={"model": str(self.loaded.path), "weights": self.loaded.weights})
        invariance = set_batch_invariant_limit(self.loaded.model, self.limit, proof_cache=proofs)
        self.deployment = proven_deployment(self.loaded.model, invariance, proofs=proofs, prefill_chunk=4)
        return self.deployment

    def settle(self):
        self.state.settle(settled_state(self.deployment))  # the product's mapping, as GuaranteeWork's


def test_plain_requests_are_served_while_the_proof_is_held_and_deterministic_ones_wait(embedded_model):
    from openai import APIStatusError, OpenAI

    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine
    from lockstep.server.engine.guarantee.deployment import Deployment
    from lockstep.server.engine.guarantee.guarantee import Guarantee
    from tests.http_server import running, wait_until

    proof = HeldProof(embedded_model, limit=2)
    proof.state = GuaranteeState(PROVING)
    engine = Engine(embedded_model, max_active=4, deployment=Deployment(guarantee=Guarantee(2), prefill_chunk=4),
                    guarantee=proof.state)
    planned = []  # (determinism, proof released) of every submission the engine took
    submit = engine.submit_group

    def spy(requests, plan=None):
        planned.append((plan.determinism if plan else "none", proof.release.is_set()))
        return submit(requests, plan)

    engine.submit_group = spy
    engine.start([proof])
    deterministic = dict(model="default", messages=PROMPT, max_tokens=3, temperature=0,
                         extra_body={"deterministic": True})
    try:
        # two apps over the one engine: one gives up on the proof after 0.3 s, one waits
        with running(create_app(engine, guarantee_timeout=0.3)) as impatient, \
                running(create_app(engine, guarantee_timeout=600)) as patient:
            client = OpenAI(base_url=impatient + "/v1", api_key="x", max_retries=0, timeout=600)
            assert httpx.get(impatient + "/health").json()["guarantee"] == PROVING
            plain = client.chat.completions.create(model="default", messages=PROMPT, max_tokens=3, temperature=0)
            assert plain.choices[0].message.content and plain.lockstep["deterministic"] is False
            assert not proof.release.is_set() and proof.steps > 0  # served between the held proof's steps

            with pytest.raises(APIStatusError) as refused:
                client.chat.completions.create(**deterministic)
            assert refused.value.status_code == 503
            assert refused.value.response.headers["Retry-After"].isdigit()
            assert refused.value.body["code"] == "guarantee_pending"
            card = httpx.get(impatient + "/v1/models").json()["data"][0]
            assert card["id"] == embedded_model.name

            waited = {}
            patient_client = OpenAI(base_url=patient + "/v1", api_key="x", max_retries=0, timeout=600)
            thread = threading.Thread(target=lambda: waited.update(answer=patient_client.chat.completions.create(
                **deterministic)))
            thread.start()
            wait_until(lambda: proof.state._waiters, what="the request to wait for the proof")
            assert thread.is_alive() and not waited  # still waiting for the proof
            proof.release.set()
            thread.join(timeout=600)
            assert httpx.get(patient + "/health").json()["guarantee"] == IN_FORCE
            answer = waited["answer"]
            assert answer.lockstep["deterministic"] is True and answer.lockstep["guaranteed"] is True
            wait_until(lambda: engine.counts()["active"] == 0, what="the engine to go idle")
    finally:
        engine.stop()
        set_batch_invariant_limit(embedded_model.model, 0)
    # no deterministic request reached the engine before the proof was released
    assert ("none", False) in planned
    assert any(determinism != "none" for determinism, _ in planned)
    assert all(released for determinism, released in planned if determinism != "none")


def test_metrics_show_the_startup_phases_and_the_guarantee_state(embedded_model):
    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine
    from tests.http_server import running

    state = GuaranteeState(PROVING)
    phases = {"load": 1.5}
    engine = Engine(embedded_model, guarantee=state).start()
    try:
        startup = lambda: {"startup": {"phases_s": dict(phases), "compile_s": {"self_test": 0.5}}}  # noqa: E731
        with running(create_app(engine, model_extras=startup)) as url:
            text = httpx.get(url + "/metrics").text
            assert 'lockstep_startup_phase_seconds{phase="load"} 1.5' in text
            assert 'lockstep_guarantee_state{state="proving"} 1.0' in text
            phases["self_test"] = 2.0
            state.settle(IN_FORCE)
            text = httpx.get(url + "/metrics").text
            assert 'lockstep_startup_phase_seconds{phase="self_test"} 2.0' in text
            assert 'lockstep_startup_compile_seconds{phase="self_test"} 0.5' in text
            assert 'lockstep_guarantee_state{state="in_force"} 1.0' in text
            assert 'lockstep_guarantee_state{state="proving"} 0.0' in text
            assert httpx.get(url + "/v1/models").json()["data"][0]["lockstep"]["startup"]["phases_s"] == phases
    finally:
        engine.stop()


def test_a_deployment_whose_proof_fails_serves_with_its_guarantee_refused_everywhere(
        tmp_path, monkeypatch, mac, fake_launchctl, capsys):
    """The real serve assembly and the real proofs, on a backend whose multi-row calls reduce in
    another order (tests/doubles/shape_variant.py) with the native strategy, which cannot hold
    L there: the self-test fails, and every place that reports the guarantee says so."""
    from openai import OpenAI

    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.kernels.verdict_cache import ROOT_ENV
    from lockstep.server import cli
    from lockstep.server.commands.serve import build_app_from_args
    from tests.doubles.shape_variant import shape_variant_backend
    from tests.http_server import running, wait_until
    from tests.test_service import run as service

    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "verdicts"))  # no proof re-used from a native backend
    args = cli.build_parser().parse_args(["serve", "--model", "default", "--batch-invariant-limit", "2",
                                          "--invariant-strategy", "native"])
    with shape_variant_backend():
        app, engine = build_app_from_args(args)
        try:
            with running(app) as url:
                wait_until(lambda: engine.guarantee.settled, timeout=300, what="the proofs to settle")
                assert engine.guarantee.state == REFUSED
                assert "self-test failed" in engine.guarantee.describe()["reason"]
                assert httpx.get(url + "/health").json()["guarantee"] == REFUSED
                metrics = httpx.get(url + "/metrics").text
                assert 'lockstep_guarantee_state{state="refused"} 1.0' in metrics
                assert 'lockstep_guarantee_state{state="in_force"} 0.0' in metrics
                card = httpx.get(url + "/v1/models").json()["data"][0]["lockstep"]
                assert card["batch_invariance"]["state"] == REFUSED

                assert service(mac, "install", "--port", url.rsplit(":", 1)[1]) == 0
                capsys.readouterr()
                assert service(mac, "status", "--wait-for", "ready") == 0
                assert service(mac, "status", "--wait-for", "guarantee", "--timeout", "600") == 1  # at once
                assert "guarantee: refused" in capsys.readouterr().out

                client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
                answer = client.chat.completions.create(model="default", messages=PROMPT, max_tokens=3,
                                                        temperature=0, extra_body={"deterministic": True})
                assert answer.choices[0].message.content
                assert answer.lockstep["deterministic"] is True and answer.lockstep["guaranteed"] is False
                assert "not proven" in answer.lockstep["note"]
        finally:
            engine.stop()
            set_batch_invariant_limit(engine.loaded.model, 0)


def test_a_first_ragged_proof_puts_the_guarantee_in_force_for_the_widths_proven_so_far(tmp_path, monkeypatch):
    """Widths in order: once the ragged proof has proven passes of 1..L rows (held there), deterministic
    requests are answered in passes of at most those widths; the wider widths follow."""
    from openai import OpenAI

    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.kernels.verdict_cache import ROOT_ENV
    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine
    from lockstep.server.runtime import Options, build_runtime
    from tests.http_server import running, wait_until
    from tests.synthetic import build_llama_dir, write_tiny_tokenizer

    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "verdicts"))  # a first start: nothing proven yet
    model_dir = build_llama_dir(tmp_path / "float")
    write_tiny_tokenizer(model_dir)
    runtime = build_runtime(Options(model=str(model_dir), batch_invariant_limit=2, max_batch_rows=4),
                            defer_guarantee=True)
    work, _ = runtime.pending  # the guarantee's proofs, then the batched-sampling proof
    reached, release = threading.Event(), threading.Event()
    proven_widths = work._proven_widths

    def held_at_l(plan, pass_costs):
        proven = proven_widths(plan, pass_costs)

        def hold(width):
            proven(width)
            if width == 2:  # = L: the proof waits here, serving between its steps
                reached.set()
                while not release.is_set():
                    step_done()
                    release.wait(0.01)
        return hold
    work._proven_widths = held_at_l
    engine = Engine(runtime.loaded, deployment=runtime.deployment, guarantee=runtime.guarantee,
                    audited=runtime.audited, max_active=4, max_batch_rows=4)
    canonical_widths = []
    execute = engine.runner.execute

    def spy(output):
        canonical_widths.extend(p.rows for p in output.passes if p.canonical)
        return execute(output)
    engine.runner.execute = spy
    engine.start(runtime.pending)
    try:
        with running(create_app(engine, model_extras=runtime.model_info, guarantee_timeout=20)) as base:
            assert reached.wait(300)
            assert httpx.get(base + "/health").json()["guarantee"] == IN_FORCE
            client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
            answers = {}

            def ask(i):
                answers[i] = client.completions.create(model="default", prompt=f"w{5 + i} w{9 + i} w{13 + i}",
                                                       max_tokens=4, temperature=0,
                                                       extra_body={"deterministic": True})
            threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=600)
            assert len(answers) == 3 and not release.is_set()  # answered while wider widths are unproven
            assert all(a.lockstep["deterministic"] and a.lockstep["guaranteed"] for a in answers.values())
            assert canonical_widths and max(canonical_widths) <= 2, canonical_widths
            assert engine.deployment.guarantee.pass_rows == 2
            release.set()
            wait_until(lambda: engine.deployment.guarantee.pass_rows == 4, timeout=300, what="the whole ragged proof")
            assert runtime.guarantee.state == IN_FORCE
    finally:
        release.set()
        engine.stop()
        set_batch_invariant_limit(runtime.loaded.model, 0)

class SteppingProof:
    """Proof steps that each take `step_s` of the engine's clock (advanced, not slept), until released."""

    def __init__(self, clock, step_s: float):
        self.clock, self.step_s = clock, step_s
        self.release = threading.Event()
        self.steps = 0

    def run(self):
        from lockstep.server.engine.guarantee.deployment import Deployment

        while not self.release.is_set():
            step_done()
            self.steps += 1
            self.clock.now += self.step_s
            self.release.wait(0.001)
        return Deployment()

    def settle(self):
        pass


def test_between_slow_proof_steps_a_request_is_served_as_long_as_a_step_took(monkeypatch):
    """A first answer on a fresh start waited a proof step per quarter second of its own
    decoding (proof steps take a second or more on a loaded CPU). Requests now get the engine
    between steps for as long as the last step took (half and half, up to a bound): a request
    whose passes take less than one step's time finishes within one or two steps."""
    import types

    import lockstep.server.engine.engine as engine_module
    from lockstep.server.engine import Engine
    from lockstep.server.engine.runner.model_runner import ModelRunner
    from lockstep.server.engine.decoding.request_state import GenerationRequest
    from lockstep.server.engine.decoding.sampling import SamplingParams
    from tests.deterministic_fixtures import TinyLoaded
    from tests.test_deterministic_double import peaked_llama

    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    execute = ModelRunner.execute

    proof = SteppingProof(clock, step_s=1.0)
    steps_seen = []  # proof steps done when each engine step ran

    def pass_costs_a_tenth(self, output):  # each engine step takes 0.1 s of the clock
        steps_seen.append(proof.steps)
        clock.now += 0.1
        return execute(self, output)

    monkeypatch.setattr(ModelRunner, "execute", pass_costs_a_tenth)
    engine = Engine(TinyLoaded(peaked_llama()), max_active=2)
    try:
        async def consume():
            handle = engine.submit(GenerationRequest([5, 6, 7], 8, SamplingParams(temperature=0.0)))
            engine.start([proof])  # the request waits from the proof's first step on
            return [delta async for delta in handle]

        deltas = asyncio.run(consume())
    finally:
        proof.release.set()
        engine.stop()
    assert deltas[-1].finish_reason == "length" and len(steps_seen) == 9  # its prompt, then 8 tokens
    # the first slice is the floor (the first step took no time), the second as long as a step: 0.9 s in all
    assert max(steps_seen) <= 1, steps_seen


def test_at_debug_a_slow_step_and_the_steps_served_between_proof_steps_are_logged(monkeypatch, caplog):
    """`--log-level DEBUG` says what held a first answer on a fresh start: each engine step of at
    least SLOW_STEP_S with what it ran (prompt chunks and their tokens, decode passes and their
    rows), and how many steps were served between two proof steps. Steps under the bound log
    nothing."""
    import logging
    import types

    import lockstep.server.engine.engine as engine_module
    from lockstep.server.engine import Engine
    from lockstep.server.engine.runner.model_runner import ModelRunner
    from lockstep.server.engine.decoding.request_state import GenerationRequest
    from lockstep.server.engine.decoding.sampling import SamplingParams
    from tests.deterministic_fixtures import TinyLoaded
    from tests.test_deterministic_double import peaked_llama

    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    execute = ModelRunner.execute

    def slow_prompt(self, output):  # a prompt chunk takes 0.15 s of the clock, a decode pass 0.01 s
        clock.now += 0.15 if output.prefill_alone or output.prefill_shared else 0.01
        return execute(self, output)

    monkeypatch.setattr(ModelRunner, "execute", slow_prompt)
    proof = SteppingProof(clock, step_s=1.0)
    engine = Engine(TinyLoaded(peaked_llama()), max_active=2)
    caplog.set_level(logging.DEBUG, logger=engine_module.__name__)
    try:
        async def consume():
            handle = engine.submit(GenerationRequest([5, 6, 7], 4, SamplingParams(temperature=0.0)))
            engine.start([proof])
            return [delta async for delta in handle]

        deltas = asyncio.run(consume())
    finally:
        proof.release.set()
        engine.stop()
    assert deltas[-1].finish_reason == "length"
    slow = [r.getMessage() for r in caplog.records if r.getMessage().startswith("a step of")]
    # the prompt's chunk (its last token is the first decode row's input); decode passes are fast
    assert slow == ["a step of 0.150 s: 1 prompt chunks alone (2 tokens), 0 shared (0 tokens), "
                    "0 decode passes (0 rows), 0 compiled passes traced"]
    served = [r.getMessage() for r in caplog.records if r.getMessage().startswith("between proof steps")]
    # 4 turns (the first runs its prompt chunk and its first decode pass), all between two proof steps
    assert served == ["between proof steps (the last took 0.000 s): 4 turns served in 0.190 s"]
