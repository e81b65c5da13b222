"""kernels/audit/widths.py and the staged audit behind it: `serve` audits the calls a first plain
answer takes (one row, prompt chunks of 33+ rows, lookups) before it serves and the narrow ones
(2..32 rows) on the engine thread afterwards (server/startup_work.py AuditWork); until then the
scheduler runs no call of an unaudited width, and a fault found late is routed around before any
pass takes it. Over HTTP with the official client; the background audit is held back by an event."""
import collections
import threading

import httpx2 as httpx
import mlx.core as mx
import pytest
from openai import OpenAI

from lockstep.kernels.audit import audit_model
from lockstep.kernels.audit import patch as audit_patch
from lockstep.kernels.audit.widths import (FIRST, NARROW, WIDE, AuditedRows, deferred_stages, row_ranges,
                                          stage_of)
from lockstep.kernels.proof_steps import step_done
from lockstep.kernels.verdict_cache import ROOT_ENV
from lockstep.server.api.app import create_app
from lockstep.server.engine import Engine
from lockstep.server.runtime import Options, build_runtime
from tests.http_server import running, wait_until
from tests.synthetic import build_llama_dir, write_tiny_tokenizer

PARTIAL = [[1, 1], [33, None]]
PROMPTS = [f"w{5 + i} w{9 + i} w{13 + i} w{40 + i}" for i in range(4)]  # short: chunks under 33 rows


@pytest.fixture(scope="module")
def affine_dir(tmp_path_factory):
    """Affine 4-bit with every dim a multiple of 64: no CPU fault of its own."""
    path = build_llama_dir(tmp_path_factory.mktemp("affine"), q_mode="affine", hidden=1024,
                           intermediate=2048, heads=8)
    write_tiny_tokenizer(path)
    return path


@pytest.fixture
def verdicts(tmp_path, monkeypatch):
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "verdicts"))
    return tmp_path / "verdicts"


def test_the_partial_audit_allows_one_row_and_wide_calls_and_splits_the_rest():
    partial = AuditedRows([FIRST, WIDE])
    assert not partial.complete and not partial.completed.is_set()
    assert [w for w in range(1, 40) if partial.allows(w)] == [1, *range(33, 40)]
    assert partial.split(16) == [1] * 16 and partial.split(40) == [40] and partial.widest(32) == 1
    assert partial.describe() == {"audited_rows": PARTIAL, "audit_complete": False}
    partial.add(NARROW)
    assert partial.complete and partial.completed.is_set() and partial.split(16) == [16]
    assert row_ranges([NARROW]) == [[2, 32]] and row_ranges([FIRST, WIDE, NARROW]) == [[1, None]]
    assert stage_of("matmul short", 5) == stage_of("matmul short", 24) == NARROW
    assert stage_of("lookup odd", 3) == stage_of("matmul decode", 1) == FIRST
    assert stage_of("matmul tiled", 33) == stage_of("as_linear prompt", 96) == WIDE


def test_before_the_wide_stage_only_one_row_calls_run():
    first = AuditedRows([FIRST])
    assert [w for w in range(1, 80) if first.allows(w)] == [1]
    assert first.split(40) == [1] * 40 and first.describe()["audited_rows"] == [[1, 1]]
    first.add(WIDE)
    assert first.split(40) == [40] and first.split(34) == [34] and first.split(20) == [1] * 20
    assert deferred_stages("cuda") == (WIDE, NARROW) and deferred_stages("cpu") == (NARROW,)
    assert deferred_stages("metal") == (NARROW,)


def test_the_stages_together_are_the_whole_audit_and_cached_apart(affine_dir, verdicts):
    from mlx_lm.utils import load_model as mlx_load_model

    from lockstep.kernels.audit import audit_verdict_cache, merge_reports

    whole = audit_model(mlx_load_model(affine_dir)[0])
    model = mlx_load_model(affine_dir)[0]
    first = audit_model(model, cache=audit_verdict_cache(), defer=(WIDE, NARROW))  # as on CUDA
    assert first.deferred == (WIDE, NARROW)
    assert all(stage_of(p.path, p.rows) == FIRST for c in first.configs for p in c.paths)
    merged = first
    for stage in first.deferred:  # as AuditWork runs them, a stage at a time
        merged = merge_reports(merged, audit_model(model, cache=audit_verdict_cache(), stages=(stage,)))
    assert merged.deferred == () and [c.config for c in merged.configs] == [c.config for c in whole.configs]
    assert [[(p.path, p.rows) for p in c.paths] for c in merged.configs] == \
        [[(p.path, p.rows) for p in c.paths] for c in whole.configs]
    restart = audit_model(mlx_load_model(affine_dir)[0], cache=audit_verdict_cache(), defer=(WIDE, NARROW))
    assert restart.deferred == () and restart.cached == len(whole.configs)  # nothing left for later


class HeldAudit:
    """The runtime's background audit, held (serving between its steps, as the real one does)
    until released."""

    def __init__(self, work):
        self.work, self.release = work, threading.Event()
        self.steps = 0

    def run(self):
        while not self.release.is_set():
            step_done()
            self.steps += 1
            self.release.wait(0.01)
        return self.work.run()

    def settle(self):
        self.work.settle()


class WidthSpy:
    """Every call width the engine's runner is given, each with whether it was audited then."""

    def __init__(self, engine):
        self.engine, self.widths, self.steps_with_passes = engine, [], []
        execute = engine.runner.execute

        def spy(output):
            audited = engine.audited
            for slot in output.prefill_alone:
                w = slot.state.next_chunk_tokens()
                self.widths.append((w, audited.allows(w)))
            if output.prefill_shared:
                w = sum(slot.state.next_chunk_tokens() for slot in output.prefill_shared)
                self.widths.append((w, audited.allows(w)))
            for p in output.passes:
                self.widths.append((p.rows, audited.allows(p.rows)))
            if output.passes:
                self.steps_with_passes.append(len(output.passes))
            return execute(output)
        engine.runner.execute = spy


def ask_together(base: str, prompts, max_tokens: int = 6) -> list[str]:
    client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
    answers = {}

    def ask(i, prompt):
        answers[i] = client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens,
                                               temperature=0).choices[0].text
    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert len(answers) == len(prompts)
    return [answers[i] for i in range(len(prompts))]


def serving(runtime):
    engine = Engine(runtime.loaded, deployment=runtime.deployment, guarantee=runtime.guarantee,
                    audited=runtime.audited, max_active=4)
    return engine, create_app(engine, model_extras=runtime.model_info)


def hold_until_busy(engine, requests: int):
    """The engine's next step waits (bounded) until `requests` are in it, so they share it."""
    execute = engine.runner.execute
    first = [True]

    def gate(output):
        if first[0]:
            first[0] = False
            wait_until(lambda: sum(engine.counts()[k] for k in ("active", "waiting")) >= requests,
                       what="the requests to arrive")
        return execute(output)
    engine.runner.execute = gate


def test_no_pass_runs_a_width_before_its_audit_then_wide_passes_do(affine_dir, verdicts):
    runtime = build_runtime(Options(model=str(affine_dir)), defer_guarantee=True)
    assert runtime.audited.describe()["audited_rows"] == PARTIAL and runtime.guarantee.state == "proving"
    (work,) = runtime.pending
    held = HeldAudit(work)
    engine, app = serving(runtime)
    spy = WidthSpy(engine)
    engine.start([held])
    try:
        with running(app) as base:
            health = httpx.get(base + "/health").json()
            assert health["audited_rows"] == PARTIAL and health["guarantee"] == "proving"
            card = httpx.get(base + "/v1/models").json()["data"][0]["lockstep"]
            assert card["audit"]["audited_rows"] == PARTIAL and card["audit"]["deferred"] == ["narrow"]
            ask_together(base, PROMPTS)
            assert not held.release.is_set() and held.steps > 0
            assert spy.widths and all(ok for _, ok in spy.widths), spy.widths
            assert {w for w, _ in spy.widths} == {1}  # prompts cut to one-row chunks, passes split
            assert max(spy.steps_with_passes) > 1  # several requests decoded in one step: split

            before = len(spy.widths)
            held.release.set()
            assert runtime.audited.completed.wait(300)
            wait_until(lambda: runtime.guarantee.settled, what="the guarantee (L = 0) to settle")
            assert httpx.get(base + "/health").json()["audited_rows"] == [[1, None]]
            hold_until_busy(engine, len(PROMPTS))
            ask_together(base, PROMPTS)
            assert max(w for w, _ in spy.widths[before:]) > 1  # wider passes once audited
            card = httpx.get(base + "/v1/models").json()["data"][0]["lockstep"]
            assert card["audit"]["audited_rows"] == [[1, None]] and "deferred" not in card["audit"]
    finally:
        engine.stop()


def faulty_narrow(real, calls):
    """`mx.quantized_matmul` wrong for calls of 2..32 rows (a fault the first stage cannot see);
    records each call's rows and whether the audit's probes made it."""
    def quantized_matmul(x, *args, **kwargs):
        y = real(x, *args, **kwargs)
        rows = 1
        for d in x.shape[:-1]:
            rows *= d
        calls.append((rows, PROBING.on))
        return y + 1.0 if 2 <= rows <= 32 else y
    return quantized_matmul


class _Probing(threading.local):
    on = False


PROBING = _Probing()


def test_a_fault_the_background_audit_finds_is_routed_around_before_any_pass_takes_it(
        affine_dir, verdicts, monkeypatch):
    probe = audit_patch.probe

    def probing(*args, **kwargs):
        PROBING.on = True
        try:
            return probe(*args, **kwargs)
        finally:
            PROBING.on = False
    monkeypatch.setattr(audit_patch, "probe", probing)
    calls = []
    monkeypatch.setattr(mx, "quantized_matmul", faulty_narrow(mx.quantized_matmul, calls))

    runtime = build_runtime(Options(model=str(affine_dir)), defer_guarantee=True)
    assert runtime.audit.patched == []  # the first stage's widths are sound
    unpatched_fingerprint = runtime.deployment.fingerprint
    (work,) = runtime.pending
    held = HeldAudit(work)
    engine, app = serving(runtime)
    spy = WidthSpy(engine)
    engine.start([held])
    try:
        with running(app) as base:
            ask_together(base, PROMPTS[:3])
            held.release.set()
            assert runtime.audited.completed.wait(300)
            hold_until_busy(engine, 3)
            ask_together(base, PROMPTS[:3])
            card = httpx.get(base + "/v1/models").json()["data"][0]["lockstep"]
    finally:
        engine.stop()
    assert set(card["audit"]["workarounds"].values()) == {"dequantized"}  # pad32 cannot fix every width
    assert "workarounds=" in runtime.transform and engine.deployment.fingerprint != unpatched_fingerprint
    assert max(w for w, _ in spy.widths) > 1  # narrow passes ran once audited
    served_narrow = [rows for rows, probing in calls if 2 <= rows <= 32 and not probing]
    assert served_narrow == []  # never through the faulty kernel: the stand-in was in place first
    assert any(2 <= rows <= 32 and probing for rows, probing in calls)  # the audit did find it


def test_a_restart_runs_no_audit_work_for_the_configurations_cached(affine_dir, verdicts, monkeypatch):
    from lockstep.server.runtime import AuditWork

    work = collections.Counter()
    for name in ("_audit_config", "probe", "reference_weight"):
        real = getattr(audit_patch, name)
        monkeypatch.setattr(audit_patch, name, lambda *a, _real=real, _name=name, **k:
                            work.update([_name]) or _real(*a, **k))
    first = build_runtime(Options(model=str(affine_dir)), defer_guarantee=True)
    assert first.audit.cached == 0 and first.audit.deferred == (NARROW,)
    (later,) = [w for w in first.pending if isinstance(w, AuditWork)]
    later.run()  # the narrow stage, as the engine thread runs it
    configs = len(first.audit.configs)
    assert work["_audit_config"] == 2 * configs and work["probe"] and work["reference_weight"]  # now, later

    work.clear()
    restart = build_runtime(Options(model=str(affine_dir)), defer_guarantee=True)
    assert sum(work.values()) == 0, work  # no probe, no reference, no configuration audited
    assert restart.audit.cached == configs and restart.audit.deferred == ()
    assert restart.audited.complete and not any(isinstance(w, AuditWork) for w in restart.pending or ())


def test_the_audit_on_the_engine_thread_lets_requests_run_after_every_probe(affine_dir, verdicts):
    """Each probed path is a step (kernels/proof_steps.py): requests at audited widths wait for
    one probe, not for a configuration's every path (on a fresh GPU each compiles its kernels)."""
    from mlx_lm.utils import load_model as mlx_load_model

    from lockstep.kernels.proof_steps import between_steps

    steps = []
    model = mlx_load_model(affine_dir)[0]
    with between_steps(lambda: steps.append(1)):
        report = audit_model(model, stages=(NARROW,), fresh=True)
    probes = sum(len(c.paths) for c in report.configs)
    assert probes > len(report.configs)  # configurations of several narrow paths each
    assert len(steps) >= probes  # a step after each probe (and after each configuration)
