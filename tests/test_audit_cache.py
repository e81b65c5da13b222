"""The kernel audit at O(K) cost (probes on a slice of the output rows) and its per-machine
verdict cache: same verdicts as the full-size audit, keys, corrupt files, atomic writes."""
import json
import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import load_model as mlx_load_model

import lockstep.kernels.audit.patch as audit
from lockstep.kernels.audit import audit_model, audit_verdict_cache, format_table, slicing
from tests.doubles.faulty_kernels import faulty_tiled_qmm
from lockstep.kernels.verdict_cache import VerdictCache
from tests.synthetic import build_llama_dir

PROMPT_ROWS = 40  # reaches the tiled path (>= 33) and keeps the probes cheap on 2 cores


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    return build_llama_dir(tmp_path_factory.mktemp("nvfp4"), q_mode="nvfp4")


@pytest.fixture
def model(nvfp4_dir):
    return mlx_load_model(nvfp4_dir)[0]


@pytest.fixture
def cache(tmp_path):
    return audit_verdict_cache(tmp_path / "verdicts")


def whole_layer_audit(model, monkeypatch, **kwargs):
    """The audit as it was before slicing: every probe on every output row."""
    with monkeypatch.context() as m:
        m.setattr(audit, "sliced_rows", lambda n, backend: n)
        return audit_model(model, prompt_rows=PROMPT_ROWS, **kwargs)


def outcome(report) -> list:
    """Per configuration: verdict, failing (path, rows), and the workarounds tried."""
    return [(c.config, c.verdict, sorted((p.path, p.rows) for p in c.failing),
             [name for name, _ in c.attempts]) for c in report.configs]


# ------------------------------------------------------------------ the slice

@pytest.mark.parametrize("kind", ["linear", "embedding", "switch"])
def test_a_slice_of_output_rows_computes_exactly_those_rows(kind):
    from mlx_lm.models.switch_layers import SwitchLinear

    mx.random.seed(3)
    if kind == "linear":
        layer = nn.Linear(1040, 300, bias=True).to_quantized(group_size=16, bits=4, mode="nvfp4")
        whole, part = layer(x := mx.random.normal((5, 1040))), slicing.sliced_layer(layer, 44)(x)
    elif kind == "embedding":
        layer = nn.Embedding(300, 1040).to_quantized(group_size=16, bits=4, mode="nvfp4")
        whole = layer.as_linear(x := mx.random.normal((5, 1040)))
        part = slicing.sliced_layer(layer, 44).as_linear(x)
    else:
        layer = SwitchLinear(1040, 300, 4, bias=True).to_quantized(16, 4, "nvfp4")
        x, idx = mx.random.normal((3, 1, 1040)), mx.array([[0, 2], [1, 3], [2, 0]])
        whole, part = layer(x[:, None], idx), slicing.sliced_layer(layer, 44)(x[:, None], idx)
    assert part.shape[-1] == 44
    np.testing.assert_array_equal(np.array(part), np.array(whole[..., :44]))


def test_slice_keeps_the_residue_that_dispatch_can_see():
    for n in (1040, 2064, 49152, 384, 80, 300):
        for backend, m in (("cpu", 32), ("cuda", 128), ("metal", 128)):
            rows = slicing.sliced_rows(n, backend)
            assert rows == n or (rows % m == n % m and m <= rows < 2 * m), (n, backend, rows)
    assert slicing.sliced_rows(49152, "cpu") == 32
    assert slicing.sliced_rows(40, "cuda") == 40  # small layers are probed whole


def test_full_size_checks_only_where_the_backend_dispatches_on_n():
    paths = [("matmul decode", 1), ("matmul tiled", 33), ("as_linear prompt", 96),
             ("lookup odd", 3), ("gather short", 5)]
    assert not any(slicing.full_size(p, r, 49152, "cpu") for p, r in paths)
    assert [slicing.full_size(p, r, 49152, "cuda") for p, r in paths] == [True, False, False,
                                                                            False, False]
    assert not slicing.full_size("matmul decode", 1, 16384, "cuda")  # qmv below the bound
    assert [slicing.full_size(p, r, 49152, "metal") for p, r in paths] == [True, True, True,
                                                                             False, True]


def test_probes_run_on_a_slice_on_the_cpu(model):
    report = audit_model(model, prompt_rows=PROMPT_ROWS)
    for c in report.configs:
        n = c.config.shape[-2]
        assert {p.out_rows for p in c.paths} == {slicing.sliced_rows(n, "cpu")}, c.config
    embed = next(c for c in report.configs if c.config.kind == "embedding")
    assert embed.config.shape[0] == 384 and embed.paths[0].out_rows == 32
    assert " 32 " in format_table(report)  # the N column shows what was probed


def test_a_path_dispatched_on_n_also_runs_on_the_whole_layer(model, monkeypatch):
    monkeypatch.setattr(audit, "backend_kind", lambda: "metal")
    report = audit_model(model, prompt_rows=PROMPT_ROWS)
    embed = next(c for c in report.configs if c.config.kind == "embedding")
    by_path = {(p.path, p.rows): p.out_rows for p in embed.paths}
    assert by_path[("lookup odd", 3)] == slicing.sliced_rows(384, "metal")
    assert by_path[("as_linear tiled", 33)] == 384
    assert [(p.path, p.rows) for p in embed.paths] == audit.probe_paths("embedding", PROMPT_ROWS)


# ------------------------------------------------------- same verdicts as full size

def test_same_verdicts_as_the_full_size_audit_real_cpu_fault(model, monkeypatch):
    sliced = audit_model(model, prompt_rows=PROMPT_ROWS)
    whole = whole_layer_audit(model, monkeypatch)
    assert outcome(sliced) == outcome(whole)
    embed = next(c for c in sliced.configs if c.config.kind == "embedding")
    assert embed.verdict == "pad32" and {p.rows for p in embed.failing} == {1, 3, 23}


def test_same_verdicts_as_the_full_size_audit_faulty_tiled_double(model, monkeypatch):
    with faulty_tiled_qmm():
        sliced = audit_model(model, prompt_rows=PROMPT_ROWS)
        whole = whole_layer_audit(model, monkeypatch)
    assert outcome(sliced) == outcome(whole)
    for c in sliced.configs:
        assert c.verdict == "pad32", c.config.label()
        tiled = {p.rows for p in c.failing if p.path.startswith(("matmul", "as_linear"))}
        assert tiled == {33, 64, PROMPT_ROWS}


# ------------------------------------------------------------------ the cache

def test_restart_reuses_the_verdicts(model, cache):
    first = audit_model(model, prompt_rows=PROMPT_ROWS, cache=cache)
    again = audit_model(model, prompt_rows=PROMPT_ROWS, cache=cache)
    assert first.cached == 0 and again.cached == len(again.configs) == 5
    assert outcome(again) == outcome(first)
    strip = lambda t: t.rsplit("\n", 1)[0]  # the last line says how long and how many cached
    assert strip(format_table(again)) == strip(format_table(first))
    assert "5 from the audit cache" in format_table(again)
    fresh = audit_model(model, prompt_rows=PROMPT_ROWS, cache=cache, fresh=True)
    assert fresh.cached == 0 and outcome(fresh) == outcome(first)


def test_patched_model_from_cached_verdicts_runs(model, cache, nvfp4_dir):
    audit_model(model, prompt_rows=PROMPT_ROWS, cache=cache)
    fresh_model = mlx_load_model(nvfp4_dir)[0]
    report = audit.audit_and_patch(fresh_model, prompt_rows=PROMPT_ROWS, cache=cache)
    assert report.cached == 5
    logits = fresh_model(mx.array([[5, 6, 7]]))  # 3 rows: the odd lookup that raises unpatched
    assert bool(mx.isfinite(logits).all())


@pytest.mark.parametrize("change", [
    {"mlx": "0.0.1"}, {"backend": "metal"}, {"device": "Apple M9"}, {"architecture": "arm64"},
    {"blas": "openblas (x; threads=1)"},
])
def test_a_different_environment_misses(model, cache, monkeypatch, change):
    audit_model(model, prompt_rows=PROMPT_ROWS, cache=cache)
    real = audit.environment
    monkeypatch.setattr(audit, "environment", lambda: {**real(), **change})
    assert audit_model(model, prompt_rows=PROMPT_ROWS, cache=cache).cached == 0


def test_key_names_the_config_code_and_probed_ops(model):
    (cfg, _), *_ = audit.quantized_layers(model).items()
    key = audit.verdict_key(cfg, 0, PROMPT_ROWS)
    assert key["config"] == {"kind": cfg.kind, "shape": list(cfg.shape), "mode": "nvfp4",
                             "bits": 4, "group_size": 16, "dtype": "float32",
                             "transpose": True, "has_bias": False}
    assert set(key["environment"]) == {"mlx", "backend", "device", "architecture", "blas"}
    assert key["environment"]["mlx"] == mx.__version__
    other = [audit.verdict_key(cfg, 0, PROMPT_ROWS + 1), audit.verdict_key(cfg, 1, PROMPT_ROWS),
             audit.verdict_key(type(cfg)(**{**cfg.__dict__, "dtype": "float16"}), 0, PROMPT_ROWS)]
    files = {VerdictCache("x", "/tmp")._file(k)[0] for k in [key, *other]}
    assert len(files) == 4
    with faulty_tiled_qmm():
        assert audit.verdict_key(cfg, 0, PROMPT_ROWS)["ops"] != key["ops"]


def test_code_version_changes_with_the_audit_source(model, cache, monkeypatch):
    audit_model(model, prompt_rows=PROMPT_ROWS, cache=cache)
    monkeypatch.setattr(audit, "code_version", lambda *modules: "edited")
    assert audit_model(model, prompt_rows=PROMPT_ROWS, cache=cache).cached == 0


def test_a_test_double_never_meets_a_real_verdict(model, cache):
    real = audit_model(model, prompt_rows=PROMPT_ROWS, cache=cache)
    assert all(c.verdict == "ok" for c in real.configs if c.config.kind == "linear")
    with faulty_tiled_qmm():
        faulty = audit_model(model, prompt_rows=PROMPT_ROWS, cache=cache)
    assert faulty.cached == 0 and all(c.verdict == "pad32" for c in faulty.configs)


def _cache_files(cache) -> list:
    return sorted(cache.dir.glob("*.json"))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other key", "bad verdict", "directory"])
def test_corrupt_or_unreadable_cache_is_ignored_with_a_warning(model, cache, caplog, damage):
    first = audit_model(model, prompt_rows=PROMPT_ROWS, cache=cache)
    files = _cache_files(cache)
    assert len(files) == 5
    for path in files:
        text = path.read_text()
        if damage == "garbage":
            path.write_bytes(b"\x00\xff not json")
        elif damage == "truncated":
            path.write_text(text[: len(text) // 2])
        elif damage == "other key":
            record = json.loads(text)
            record["key"]["seed"] = 99
            path.write_text(json.dumps(record))
        elif damage == "bad verdict":
            record = json.loads(text)
            record["value"]["verdict"] = "ok" if record["value"]["verdict"] != "ok" else "pad32"
            path.write_text(json.dumps(record))
        else:
            path.unlink()
            path.mkdir()
    with caplog.at_level(logging.WARNING):
        again = audit_model(model, prompt_rows=PROMPT_ROWS, cache=cache)
    assert again.cached == 0 and outcome(again) == outcome(first)
    assert "cache" in caplog.text and ("corrupt" in caplog.text or "malformed" in caplog.text
                                       or "unreadable" in caplog.text)
    if damage != "directory":  # rewritten whole: the next start hits again
        assert audit_model(model, prompt_rows=PROMPT_ROWS, cache=cache).cached == 5


def test_writes_are_atomic_and_leave_no_temporary_files(tmp_path, monkeypatch):
    store = VerdictCache("atomic", tmp_path)
    store.put({"a": 1}, {"verdict": "ok"})
    assert store.get({"a": 1}) == {"verdict": "ok"} and store.get({"a": 2}) is None
    path = store._file({"a": 1})[0]

    def interrupted(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("lockstep.kernels.verdict_cache.os.replace", interrupted)
    store.put({"a": 1}, {"verdict": "changed"})  # a warning, not a crash
    assert json.loads(path.read_text())["value"] == {"verdict": "ok"}  # the old file is intact
    assert [p.name for p in store.dir.iterdir()] == [path.name]  # no temporary left behind


def test_unwritable_cache_root_is_a_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("lockstep.kernels.verdict_cache._write_failure_said", False)  # said once a process
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = VerdictCache("audit", blocker)
    with caplog.at_level(logging.WARNING):
        store.put({"a": 1}, {"v": 1})
        assert store.get({"a": 1}) is None
    assert "could not write cache file" in caplog.text


def test_default_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_VERDICT_CACHE_DIR", str(tmp_path))
    assert audit_verdict_cache().dir == tmp_path / "audit"


def test_cli_audit_reuses_verdicts_unless_fresh(nvfp4_dir, tmp_path, monkeypatch, capsys):
    from lockstep.server.cli import main as cli_main
    from tests.synthetic import write_tiny_tokenizer

    write_tiny_tokenizer(nvfp4_dir)  # `lockstep audit` loads through models.load
    monkeypatch.setenv("LOCKSTEP_VERDICT_CACHE_DIR", str(tmp_path))
    runs = {}
    for name, extra in (("first", []), ("restart", []), ("fresh", ["--fresh"])):
        assert cli_main(["audit", str(nvfp4_dir), "--prompt-rows", str(PROMPT_ROWS), *extra]) == 0
        runs[name] = capsys.readouterr().out
    assert "from the audit cache" not in runs["first"] + runs["fresh"]
    assert "(5 from the audit cache)" in runs["restart"]
    assert all("pad32" in out and "lookup odd" in out for out in runs.values())


# ------------------------------------------------------- the paths this model takes

def test_an_untied_embedding_is_audited_on_its_lookups_only(tmp_path, cache):
    untied = mlx_load_model(build_llama_dir(tmp_path / "untied", q_mode="nvfp4",
                                            tie_word_embeddings=False))[0]
    report = audit_model(untied, prompt_rows=PROMPT_ROWS, cache=cache)
    embed = next(c for c in report.configs if c.config.kind == "embedding")
    untied_config = embed.config
    assert {p.path for p in embed.paths} == {"lookup odd", "lookup even"}
    assert embed.verdict == "pad32"  # the real CPU lookup fault is still found
    head = next(c for c in report.configs if "lm_head" in c.layers)
    assert any(p.path == "matmul decode" for p in head.paths)

    tied = mlx_load_model(build_llama_dir(tmp_path / "tied", q_mode="nvfp4"))[0]
    report = audit_model(tied, prompt_rows=PROMPT_ROWS, cache=cache)
    embed = next(c for c in report.configs if c.config.kind == "embedding")
    assert embed.config == untied_config
    assert report.cached == len(report.configs) - 1  # its verdict is not the head-less embedding's
    assert any(p.path.startswith("as_linear") for p in embed.paths)
