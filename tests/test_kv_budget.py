"""server/engine/scheduling/kv_budget.py: the device-memory line of the startup log (a GPU only)."""
import types

import mlx.core as mx
import pytest

from lockstep.server.engine.scheduling import kv_budget


def test_the_device_memory_line_is_only_for_a_gpu(monkeypatch):
    assert kv_budget.device_memory() is None  # the CPU: MLX counts no device memory there
    monkeypatch.setattr(kv_budget.mx, "default_device", lambda: types.SimpleNamespace(type=mx.gpu))
    monkeypatch.setattr(kv_budget.mx, "get_active_memory", lambda: 5 << 30)
    monkeypatch.setattr(kv_budget.mx, "get_cache_memory", lambda: 3 << 29)
    monkeypatch.setattr(kv_budget.mx, "get_peak_memory", lambda: 9 << 30)
    monkeypatch.setattr(kv_budget.mx, "get_memory_limit", lambda: 76 << 30)
    assert kv_budget.device_memory() == "active 5.0 GB, cache 1.5 GB, peak 9.0 GB of a 76.0 GB limit"


def test_the_engine_logs_device_memory_after_each_piece_of_startup_work(monkeypatch, caplog):
    import logging

    import lockstep.server.engine.engine as engine_module
    from lockstep.server.engine import Engine
    from tests.deterministic_fixtures import TinyLoaded
    from tests.http_server import wait_until
    from tests.tiny_models import tiny_llama

    class Fails:
        def run(self):
            raise RuntimeError("out of memory")

    class Done:
        def run(self):
            return engine.deployment

        def settle(self):
            pass

    monkeypatch.setattr(engine_module, "device_memory", lambda: "active 1.0 GB")
    engine = Engine(TinyLoaded(tiny_llama(seed=3)))
    with caplog.at_level(logging.INFO, logger=engine_module.log.name):
        engine.start([Fails(), Done()])
        try:
            wait_until(lambda: not engine.starting, what="the startup work")
        finally:
            engine.stop()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("device memory")]
    assert lines == ["device memory after Fails: active 1.0 GB", "device memory after Done: active 1.0 GB"]


def test_memory_limit_holds_mlx_and_its_cache_and_the_default_budget_follows():
    from tests.tiny_models import tiny_llama

    model = tiny_llama(seed=1)
    mx.eval(model.parameters())
    old_memory, old_cache = mx.get_memory_limit(), mx.set_cache_limit(0)
    mx.set_cache_limit(old_cache)
    limit = mx.get_active_memory() + (64 << 20)
    try:
        kv_budget.hold_device_memory(limit)
        assert mx.get_memory_limit() == limit and mx.set_cache_limit(limit) == limit
        per_token = kv_budget.kv_bytes_per_token(model)
        free = limit - mx.get_active_memory()
        assert kv_budget.default_kv_tokens(model) == int(0.5 * free) // per_token
        kv_budget.check_memory_left(limit)  # room left: no error
        with pytest.raises(ValueError, match="leaves nothing for the KV cache"):
            kv_budget.check_memory_left(mx.get_active_memory())
    finally:
        mx.set_memory_limit(old_memory)
        mx.set_cache_limit(old_cache)


def test_serve_with_a_memory_limit_below_the_model_exits_1_and_says_so(tmp_path):
    import subprocess
    import sys

    from tests.synthetic import build_llama_dir, write_tiny_tokenizer
    from tests.test_serve import ENV, ROOT, free_port

    model_dir = build_llama_dir(tmp_path / "model")
    write_tiny_tokenizer(model_dir)
    done = subprocess.run([sys.executable, "-m", "lockstep.server.cli", "serve", "--model", str(model_dir),
                           "--port", str(free_port()), "--memory-limit", "64K"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "device memory held to 0.00 GB (--memory-limit)" in done.stderr
    assert "--memory-limit 0.00 GB leaves nothing for the KV cache" in done.stderr
