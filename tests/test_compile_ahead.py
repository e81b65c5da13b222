"""kernels/audit/compile_ahead.py: children that run the deferred audit stages' probes on random
layers of the model's configurations (MLX compiles the kernels they take), a few widths each, and
whose compiled modules reach MLX's kernel cache whole; and `serve` with the wide and narrow
stages deferred (as on CUDA): no call of a width before its stage is audited, requests served
while the audit waits for the children."""
import os
import threading

import httpx2 as httpx
import pytest

from lockstep.kernels.audit import compile_ahead
from lockstep.kernels.audit import widths as audit_widths
from lockstep.kernels.audit.compile_ahead import CompileAhead, child_widths, publish
from lockstep.kernels.audit.patch import quantized_layers
from lockstep.kernels.audit.probes import probe_paths
from lockstep.kernels.audit.report import LayerConfig
from lockstep.kernels.audit.widths import FIRST, NARROW, WIDE, stage_of
from lockstep.kernels.verdict_cache import ROOT_ENV
from lockstep.server.runtime import AuditWork, Options, build_runtime
from tests.http_server import running, wait_until
from tests.synthetic import build_llama_dir, write_tiny_tokenizer
from tests.test_audit_widths import WidthSpy, affine_dir, ask_together, serving  # noqa: F401 (a fixture)


def module_files(root, name, code=b"code"):
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}.txt").write_text("kernel\tmangled\n")
    (root / f"{name}.cu").write_text("source")
    (root / f"{name}.ptx").write_bytes(code)


def test_publish_moves_each_module_whole_its_code_last_and_keeps_modules_already_there(tmp_path, monkeypatch):
    source, target = tmp_path / "child", tmp_path / "cache"
    module_files(source, "qmm_m16")
    module_files(source / ("x" * 245), "tail")  # MLX splits a long module name into directories
    module_files(source, "qmm_m64", b"the child's")
    module_files(target, "qmm_m64", b"already here")
    renamed = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: renamed.append(os.path.basename(b)) or replace(a, b))

    assert publish(source, target) == 2
    assert (target / "qmm_m16.ptx").read_bytes() == b"code"
    assert (target / "qmm_m16.txt").read_text() == "kernel\tmangled\n"
    assert (target / ("x" * 245) / "tail.ptx").exists()
    assert (target / "qmm_m64.ptx").read_bytes() == b"already here"  # never overwritten
    for name in ("qmm_m16", "tail"):  # the kernel names are in place before MLX can find the code
        assert renamed.index(f"{name}.txt") < renamed.index(f"{name}.ptx")
    assert not list(target.rglob("*.part"))


def test_the_wide_widths_go_to_one_child_and_each_narrow_width_to_its_own():
    rows = {WIDE: {33, 64, 96}, NARROW: {2, 5, 8, 24}, FIRST: {1}}
    assert child_widths((WIDE, NARROW), rows.get) == [
        (WIDE, (33, 64, 96)), (NARROW, (2,)), (NARROW, (5,)), (NARROW, (8,)), (NARROW, (24,))]
    assert compile_ahead.pays("cuda") and not compile_ahead.pays("cpu") and not compile_ahead.pays("metal")


def test_the_children_probe_their_widths_of_every_configuration_and_publish(affine_dir, tmp_path, monkeypatch):
    from mlx_lm.utils import load_model as mlx_load_model

    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "cache"))
    configs = list(quantized_layers(mlx_load_model(affine_dir)[0]))
    ahead = CompileAhead.start(configs, (WIDE, NARROW))
    try:
        assert ahead.ready(WIDE, timeout=300) and ahead.ready(NARROW, timeout=300)
    finally:
        ahead.close()
    for child in ahead.children:
        assert child.process.returncode == 0 and child.report, child
        assert [r["config"] for r in child.report] == [c.label() for c in configs]
        ran = {(p, r) for entry in child.report for p, r in entry["paths"]}
        assert {r for _, r in ran} == set(child.widths) and {stage_of(p, r) for p, r in ran} == {child.stage}
    expected = {r for c in configs for p, r in probe_paths(c.kind, 96) if stage_of(p, r) in (WIDE, NARROW)}
    assert {w for child in ahead.children for w in child.widths} == expected
    assert not any(child.directory.exists() for child in ahead.children)  # the children's dirs are gone


class HeldChildren:
    """Stands in for the children: not ready until released; counts the polls."""

    def __init__(self, configs=(), stages=()):
        self.configs, self.stages = list(configs), tuple(stages)
        self.release, self.polls, self.closed = threading.Event(), 0, False

    def ready(self, stage, timeout=0.0):
        self.polls += 1
        return self.release.wait(timeout)

    def close(self):
        self.closed = True


PROMPT = " ".join(f"w{5 + i}" for i in range(100))  # 100 tokens: on the prefill grid, a chunk [64, 99) of over 32 rows


def test_with_the_wide_stage_deferred_prompts_go_a_row_a_step_until_it_is_audited(
        affine_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "verdicts"))
    monkeypatch.setattr(audit_widths, "deferred_stages", lambda backend: (WIDE, NARROW))
    started = []
    monkeypatch.setattr(compile_ahead, "pays", lambda backend: True)
    monkeypatch.setattr(CompileAhead, "start", classmethod(lambda cls, configs, stages, **kw:
                                                          started.append((configs, stages)) or None))
    runtime = build_runtime(Options(model=str(affine_dir)), defer_guarantee=True)
    assert started and started[0][1] == (WIDE, NARROW)  # the children were asked for both stages
    assert runtime.audited.describe()["audited_rows"] == [[1, 1]]
    wide, narrow = runtime.pending[:2]
    assert isinstance(wide, AuditWork) and (wide.stage, narrow.stage) == (WIDE, NARROW)
    held = HeldChildren()
    runtime.compile_ahead = held
    engine, app = serving(runtime)
    spy = WidthSpy(engine)
    engine.start(runtime.pending)
    try:
        with running(app) as base:
            ask_together(base, [PROMPT, "w3 w4"])
            assert held.polls > 0 and not runtime.audited.allows(33)  # answered while the audit waits
            assert spy.widths and {w for w, _ in spy.widths} == {1}
            held.release.set()
            assert runtime.audited.completed.wait(300)
            wait_until(lambda: runtime.guarantee.settled, what="the guarantee (L = 0) to settle")
            assert httpx.get(base + "/health").json()["audited_rows"] == [[1, None]]
            before = len(spy.widths)
            ask_together(base, [PROMPT])
            assert max(w for w, _ in spy.widths[before:]) >= 33
    finally:
        engine.stop()
    assert all(ok for _, ok in spy.widths), spy.widths  # no call of a width before its audit


def test_a_child_that_fails_is_done_with_its_error_logged_and_nothing_published(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "cache"))
    failing = tmp_path / "python"
    failing.write_text("#!/bin/sh\ncat > /dev/null\necho 'RuntimeError: no device' >&2\nexit 3\n")
    failing.chmod(0o755)
    config = LayerConfig(kind="linear", shape=(64, 256), mode="affine", bits=4, group_size=64, dtype="float32")
    with caplog.at_level("WARNING", logger=compile_ahead.__name__):
        ahead = CompileAhead.start([config], (NARROW,), python=str(failing))
        assert ahead.ready(NARROW, timeout=60)
    assert all(c.report is None and c.process.returncode == 3 for c in ahead.children)
    assert "exited with 3: RuntimeError: no device" in caplog.text
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.ptx"))


@pytest.fixture(scope="module")
def aligned_float_dir(tmp_path_factory):
    """float32, every dim a multiple of 64: its 4-bit copy quantizes every layer."""
    path = build_llama_dir(tmp_path_factory.mktemp("float"), hidden=1024, intermediate=2048, heads=8)
    write_tiny_tokenizer(path)
    return path


def test_a_draft_model_waits_for_its_own_children_while_requests_are_answered(aligned_float_dir, tmp_path, monkeypatch):
    """On CUDA the draft's wide and narrow calls compile tiles as the target's do: `DraftWork`
    audits them once children have compiled their kernels, the engine serving meanwhile (the
    draft's verdicts then cached stage by stage: a restart defers nothing)."""
    from lockstep.server import draft_assessment
    from lockstep.server.engine.decoding import draft_costs
    from lockstep.server.model_loading import load_draft

    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "verdicts"))
    monkeypatch.setattr(audit_widths, "deferred_stages", lambda backend: (WIDE, NARROW))
    monkeypatch.setattr(compile_ahead, "pays", lambda backend: True)
    monkeypatch.setattr(draft_assessment, "no_cheap_draft", lambda options: "")  # as on a GPU
    monkeypatch.setattr(draft_costs, "measure_draft_costs",
                        lambda target, draft: draft_costs.DraftCosts(0.01, 0.001, 0.001))
    held = []
    monkeypatch.setattr(CompileAhead, "start", classmethod(
        lambda cls, configs, stages, **kw: held.append(HeldChildren(configs, stages)) or held[-1]))
    options = Options(model=str(aligned_float_dir), draft_model="default-quantized")
    runtime = build_runtime(options, defer_guarantee=True)
    assert not held and runtime.audited.complete  # a float target: nothing of its own to compile
    engine, app = serving(runtime)
    engine.start(runtime.pending)
    try:
        with running(app) as base:
            wait_until(lambda: held and held[0].polls > 0, what="the draft's children to be polled")
            children = held[0]
            assert children.stages == (WIDE, NARROW) and children.configs
            assert {(c.mode, c.bits, c.group_size) for c in children.configs} == {("affine", 4, 32)}
            ask_together(base, ["w3 w4", "w5 w6"])  # answered while the draft waits
            assert engine.deployment.draft_loading and engine.deployment.draft_model is None
            children.release.set()
            wait_until(lambda: not engine.deployment.draft_loading, timeout=300, what="the draft model")
    finally:
        engine.stop()
    assert engine.deployment.draft_model is not None and not engine.deployment.draft_problem
    assert children.closed and len(held) == 1 and "draft_audit_after_compiles" in runtime.timings
    _, _, again = load_draft(options, runtime.loaded, runtime.timings, defer=(WIDE, NARROW))
    assert again.deferred == () and len(again.configs) == len(children.configs)
