"""server/warm_ahead.py: children that compile a first answer's kernels while the server starts
(on the CPU they compile nothing, but run every recipe: what each made is checked here; that
their kernels are the server's is tests/gpu/'s)."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model as mlx_load_model

from lockstep.kernels.audit import compile_ahead
from lockstep.models.load import load_model
from lockstep.server import warm_ahead
from lockstep.server.runtime import Options, build_runtime
from lockstep.server.warm_ahead import (FIRST_REQUEST, FORWARD, LOOKUPS, ROW_WRITES, NoLookup, WarmAhead,
                                        keep_first_layer, recipes)
from tests.synthetic import build_llama_dir, write_tiny_tokenizer


@pytest.fixture(scope="module")
def affine_model(tmp_path_factory):
    path = build_llama_dir(tmp_path_factory.mktemp("warm-affine"), q_mode="affine", hidden=256,
                           intermediate=512, heads=4, kv_heads=2, layers=3)
    write_tiny_tokenizer(path)
    return load_model(str(path))


def test_the_recipes_are_the_embeddings_lookups_the_kv_row_writes_and_the_two_passes(affine_model):
    jobs = recipes(affine_model, Options(kv_pool="auto"))
    stages = [stage for stage, _ in jobs]
    assert stages == [LOOKUPS, LOOKUPS, ROW_WRITES, FORWARD, FIRST_REQUEST]
    assert [spec["dtype"] for stage, spec in jobs if stage == LOOKUPS] == ["float32", "uint32"]  # scales, packed
    assert [spec["dtype"] for stage, spec in jobs if stage == ROW_WRITES] == ["float32"]
    first = dict(jobs)[FIRST_REQUEST]
    assert first["path"] == str(affine_model.path) and first["kv_pool"] == "auto" and first["compiled_passes"]


def test_a_one_layer_copy_keeps_the_first_layer_and_an_embedding_that_looks_nothing_up(affine_model):
    model, _ = mlx_load_model(affine_model.path, lazy=True)
    first = model.layers[0]
    keep_first_layer(model)
    assert len(model.layers) == 1 and model.layers[0] is first
    embedding = model.model.embed_tokens
    stand_in = NoLookup(embedding)
    ids = mx.array([[3, 7, 9]], mx.int32)
    out, looked_up = stand_in(ids), embedding(ids)
    assert out.shape == looked_up.shape and out.dtype == looked_up.dtype and not mx.any(out).item()
    h = mx.ones((1, 1, 256))
    assert mx.array_equal(stand_in.as_linear(h), embedding.as_linear(h))  # a tied head still works


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_children_run_every_recipe_then_the_cache_is_stamped(affine_model, kernel_cache):
    options = Options(kv_pool="auto")
    assert WarmAhead.needed(affine_model, options)
    ahead = WarmAhead.start(affine_model, options)
    try:
        assert ahead.wait(LOOKUPS) and ahead.wait_all()
    finally:
        ahead.close()
    made = {(c.stage, c.what): c.report for c in ahead.ahead.children}
    assert all(c.process.returncode == 0 for c in ahead.ahead.children), made
    assert made[(LOOKUPS, "uint32")]["rows"] == 2 and made[(ROW_WRITES, "float32")]["dtype"] == "float32"
    assert made[(FORWARD, "one layer")]["layers"] == 1
    assert made[(FORWARD, "one layer")]["logits"] == [1, 1, affine_model.model.args.vocab_size]
    assert made[(FIRST_REQUEST, "one layer")]["tokens"] == [2, 2]  # greedy and sampled, to their end
    assert ahead.done.exists() and ahead.done.parent == kernel_cache
    assert not WarmAhead.needed(affine_model, options)  # a restart on this cache spawns none
    assert WarmAhead.needed(affine_model, Options(kv_pool="off"))  # another deployment's recipes


def test_a_child_that_fails_leaves_the_cache_unstamped(affine_model, kernel_cache, monkeypatch):
    real = recipes

    def broken(loaded, options):
        return [(stage, {**spec, "path": "/nonexistent"} if stage == FORWARD else spec)
                for stage, spec in real(loaded, options)]
    monkeypatch.setattr(warm_ahead, "recipes", broken)
    ahead = WarmAhead.start(affine_model, Options())
    try:
        assert ahead.wait_all()  # done, one of them with an error
    finally:
        ahead.close()
    assert [c.stage for c in ahead.ahead.children if c.process.returncode != 0] == [FORWARD]
    assert not ahead.done.exists() and WarmAhead.needed(affine_model, Options())


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


def test_serve_waits_for_the_lookups_before_the_audit_and_for_the_rest_before_the_warm_up(
        affine_model, kernel_cache, monkeypatch):
    import lockstep.kernels.audit as audit

    events = []
    monkeypatch.setattr(compile_ahead, "pays", lambda backend: True)  # as on CUDA
    monkeypatch.setattr(compile_ahead.CompileAhead, "for_report", classmethod(lambda cls, model, report: None))
    monkeypatch.setattr(WarmAhead, "start", classmethod(lambda cls, loaded, options: events.append("start")
                                                         or SpyAhead(events)))
    real_audit = audit.audit_and_patch
    monkeypatch.setattr(audit, "audit_and_patch", lambda *a, **k: events.append("audit") or real_audit(*a, **k))
    model_class = type(affine_model.model)
    real_call = model_class.__call__
    monkeypatch.setattr(model_class, "__call__", lambda self, *a, **k: events.append("forward") or real_call(self, *a, **k))
    options = Options(model=str(affine_model.path))
    build_runtime(options, defer_guarantee=True)
    assert events.index("start") < events.index(f"wait {LOOKUPS}") < events.index("audit") < events.index("wait all")
    assert events[events.index("wait all") + 1] == "forward"  # the warm-up's pass, once all are in

    events.clear()
    monkeypatch.setattr(WarmAhead, "needed", staticmethod(lambda loaded, options: False))
    build_runtime(options, defer_guarantee=True)
    assert "start" not in events and "wait all" not in events and "audit" in events  # a stamped cache
