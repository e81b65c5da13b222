"""server/warm_ahead.py: children that compile a first answer's kernels while the server starts.
On the CPU MLX compiles no lookup or row-write kernel, but it does compile fused activations
(into its own cache, named by graph as on CUDA): that the children's are the server's is
checked here by name; that the lookups' and row writes' are, on the GPU (bench/fresh_kernels.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

from lockstep.kernels.audit import compile_ahead
from lockstep.models.load import load_model
from lockstep.server import warm_ahead
from lockstep.server.runtime import Options, build_runtime
from lockstep.server.warm_ahead import (ACTIVATION, LOOKUPS, ROW_WRITES, TRACED_ACTIVATION, WarmAhead,
                                        forward_facts, recipes)
from tests.synthetic import build_llama_dir, write_tiny_tokenizer


@pytest.fixture(scope="module")
def affine_model(tmp_path_factory):
    path = build_llama_dir(tmp_path_factory.mktemp("warm-affine"), q_mode="affine", hidden=256,
                           intermediate=512, heads=4, kv_heads=2, layers=2)
    write_tiny_tokenizer(path)
    return load_model(str(path))


def test_the_recipes_are_the_embeddings_lookups_the_kv_row_writes_and_the_mlps_activation(affine_model):
    jobs = recipes(affine_model.model)
    assert [stage for stage, _ in jobs] == [LOOKUPS, LOOKUPS, ROW_WRITES, ACTIVATION, TRACED_ACTIVATION]
    assert [spec["dtype"] for stage, spec in jobs if stage == LOOKUPS] == ["float32", "uint32"]  # scales, packed
    assert [spec["dtype"] for stage, spec in jobs if stage == ROW_WRITES] == ["float32"]
    call = {"function": "swiglu", "args": [["float32", False], ["float32", False]]}
    assert dict(jobs)[ACTIVATION] == {"recipe": ACTIVATION, **call}
    assert dict(jobs)[TRACED_ACTIVATION] == {"recipe": TRACED_ACTIVATION, **call}
    model_module = sys.modules[type(affine_model.model).__module__]
    from mlx_lm.models.activations import swiglu
    assert model_module.swiglu is swiglu  # the recorder is gone


def test_a_model_whose_lazy_forward_fails_gets_its_lookups_only(affine_model, monkeypatch):
    model_class = type(affine_model.model)
    monkeypatch.setattr(model_class, "__call__", lambda self, *a, **k: 1 / 0)
    assert forward_facts(affine_model.model) == ([], [])
    assert [stage for stage, _ in recipes(affine_model.model)] == [LOOKUPS, LOOKUPS]


def test_a_cache_without_keys_has_no_row_writes(affine_model, monkeypatch):
    import mlx_lm.models.cache as cache_module

    class Recurrent:  # a recurrent layer's state: no keys
        state = None
    monkeypatch.setattr(cache_module, "make_prompt_cache", lambda model: [Recurrent()])
    module = sys.modules[type(affine_model.model).__module__]
    monkeypatch.setattr(type(affine_model.model), "__call__",
                        lambda self, *a, **k: module.swiglu(mx.zeros(2), mx.zeros(2)))
    calls, kv = forward_facts(affine_model.model)
    assert kv == [] and [call["function"] for call in calls] == ["swiglu"]  # the rest still found


def fused_kernels(tmp_dir, code: str, *args, stdin: str | None = None) -> set:
    """The fused kernels MLX's CPU backend compiled while `code` ran in a process of its own
    (it keeps them under the temporary directory, named by graph)."""
    tmp_dir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_dir)}
    ran = subprocess.run([sys.executable, *code, *args], input=stdin, text=True, env=env, capture_output=True)
    assert ran.returncode == 0, ran.stderr[-2000:]
    return {p.name for p in tmp_dir.rglob("lib*.so")}


SERVED = """
import sys
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from lockstep.models.load import load_model
model = load_model(sys.argv[1]).model
mx.eval(model(mx.array([[1, 2, 3]]), cache=make_prompt_cache(model)))  # the warm-up's forward
mlp = model.layers[0].mlp  # traced into one call, as in a compiled pass (matmuls on both sides)
mx.eval(mx.compile(lambda x: mlp(x))(mx.zeros((1, 1, model.args.hidden_size))))
"""


def test_the_activation_child_compiles_the_fused_kernels_the_server_takes(affine_model, tmp_path):
    served = fused_kernels(tmp_path / "served", ["-c", SERVED], str(affine_model.path))
    assert len(served) == 2  # called alone (the warm-up) and traced into a compiled pass
    jobs = dict(recipes(affine_model.model))
    alone, traced = (fused_kernels(tmp_path / stage.replace(" ", "-"), ["-m", warm_ahead.__name__],
                                   stdin=json.dumps(jobs[stage])) for stage in (ACTIVATION, TRACED_ACTIVATION))
    assert len(alone) == len(traced) == 1 and alone | traced == served


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_children_run_every_recipe_then_the_cache_is_stamped(affine_model, kernel_cache):
    jobs = recipes(affine_model.model)
    assert WarmAhead.needed(jobs)
    ahead = WarmAhead.start(jobs)
    try:
        assert ahead.wait(LOOKUPS) and ahead.wait_all()
    finally:
        ahead.close()
    made = {(c.stage, c.what): c.report for c in ahead.ahead.children}
    assert all(c.process.returncode == 0 for c in ahead.ahead.children), made
    assert set(made) == {(LOOKUPS, "float32"), (LOOKUPS, "uint32"), (ROW_WRITES, "float32"),
                         (ACTIVATION, "swiglu(float32, float32)"), (TRACED_ACTIVATION, "swiglu(float32, float32)")}
    assert made[(LOOKUPS, "uint32")]["rows"] == 2 and made[(ACTIVATION, "swiglu(float32, float32)")]["seconds"] > 0
    assert ahead.done.exists() and ahead.done.parent == kernel_cache
    assert not WarmAhead.needed(jobs)  # a restart on this cache spawns none
    assert WarmAhead.needed([(ROW_WRITES, {"recipe": ROW_WRITES, "dtype": "bfloat16"})])  # another model's
    assert not WarmAhead.needed([])


def test_a_child_that_fails_leaves_the_cache_unstamped(affine_model, kernel_cache):
    jobs = [(stage, {**spec, "dtype": "no_such_dtype"} if stage == ROW_WRITES else spec)
            for stage, spec in recipes(affine_model.model)]
    ahead = WarmAhead.start(jobs)
    try:
        assert ahead.wait_all()  # done, one of them with an error
    finally:
        ahead.close()
    assert [c.stage for c in ahead.ahead.children if c.process.returncode != 0] == [ROW_WRITES]
    assert not ahead.done.exists() and WarmAhead.needed(jobs)


class SpyAhead:
    """Stands in for the children: records when the server waits for them."""

    def __init__(self, events):
        self.events = events

    def wait(self, stage, timeout=0.0):
        self.events.append(f"wait {stage}")
        return True

    def wait_all(self, timeout=0.0):
        self.events.append("wait all")
        return True

    def close(self):
        self.events.append("close")


def test_serve_waits_for_the_lookups_before_the_audit_the_activation_before_the_warm_up_then_the_rest(
        affine_model, kernel_cache, monkeypatch):
    import lockstep.kernels.audit as audit

    events = []
    monkeypatch.setattr(compile_ahead, "pays", lambda backend: True)  # as on CUDA
    monkeypatch.setattr(compile_ahead.CompileAhead, "for_report", classmethod(lambda cls, model, report: None))
    monkeypatch.setattr(WarmAhead, "start", classmethod(lambda cls, jobs: events.append("start")
                                                         or SpyAhead(events)))
    real_audit = audit.audit_and_patch
    monkeypatch.setattr(audit, "audit_and_patch", lambda *a, **k: events.append("audit") or real_audit(*a, **k))
    model_class = type(affine_model.model)
    real_call = model_class.__call__
    monkeypatch.setattr(model_class, "__call__", lambda self, *a, **k: events.append("forward") or real_call(self, *a, **k))
    options = Options(model=str(affine_model.path))
    build_runtime(options, defer_guarantee=True)
    events.append("runtime built")
    assert events.index("start") < events.index(f"wait {LOOKUPS}") < events.index("audit")
    assert events.index("audit") < events.index(f"wait {ACTIVATION}") < events.index("wait all")
    assert events[events.index(f"wait {ACTIVATION}") + 1] == "forward"  # the warm-up's pass
    assert events.index("wait all") < events.index("runtime built")  # before the engine is built

    events.clear()
    monkeypatch.setattr(WarmAhead, "needed", staticmethod(lambda jobs: False))
    build_runtime(options, defer_guarantee=True)
    assert "start" not in events and "wait all" not in events and "audit" in events  # a stamped cache
