"""server/engine/scheduling/kv_budget.py: the device-memory line of the startup log (a GPU only)."""
import types

import mlx.core as mx

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
