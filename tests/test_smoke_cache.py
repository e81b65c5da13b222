"""Custom kernels' smoke-test verdicts kept per machine (kernels/custom/smoke_cache.py): a pass
is re-used for the same kernel sources and machine, a failure never is, and `--audit fresh`
runs them again. The kernels themselves cannot run on this CPU; their loaders are driven
with the smoke test replaced by a counter."""
import pytest

from lockstep.kernels.custom import attention, gemv_rows, skinny, smoke_cache


@pytest.fixture
def verdicts(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_VERDICT_CACHE_DIR", str(tmp_path))
    smoke_cache.prove_afresh(False)
    yield tmp_path
    smoke_cache.prove_afresh(False)


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "k.cu"
    path.write_text("one")
    return path


def counting(result):
    calls = []

    def run():
        calls.append(1)
        return result
    return run, calls


def test_a_pass_is_kept_and_reused(verdicts, source):
    run, calls = counting(None)
    assert smoke_cache.smoke_verdict("k", run, source) is None
    assert smoke_cache.smoke_verdict("k", run, source) is None
    assert len(calls) == 1
    assert list((verdicts / smoke_cache.NAMESPACE).glob("*.json"))


def test_a_failure_is_never_kept(verdicts, source):
    run, calls = counting("rows differ")
    assert smoke_cache.smoke_verdict("k", run, source) == "rows differ"
    assert smoke_cache.smoke_verdict("k", run, source) == "rows differ"
    assert len(calls) == 2


def test_an_edited_source_or_another_kernel_runs_again(verdicts, source):
    run, calls = counting(None)
    smoke_cache.smoke_verdict("k", run, source)
    smoke_cache.smoke_verdict("other", run, source)
    source.write_text("two")
    from lockstep.kernels import verdict_cache

    verdict_cache._source_digest.cache_clear()
    smoke_cache.smoke_verdict("k", run, source)
    assert len(calls) == 3


def test_audit_fresh_runs_every_smoke_test_again(verdicts, source):
    run, calls = counting(None)
    smoke_cache.smoke_verdict("k", run, source)
    smoke_cache.prove_afresh(True)
    smoke_cache.smoke_verdict("k", run, source)
    assert len(calls) == 2


@pytest.mark.parametrize("loader,call", [
    (gemv_rows, lambda: gemv_rows._availability.__wrapped__("cuda")),
    (skinny, lambda: skinny._availability.__wrapped__("cuda")),
])
def test_the_kernel_loaders_keep_their_smoke_verdicts(verdicts, monkeypatch, loader, call):
    run, calls = counting(None)
    monkeypatch.setattr(loader, "_smoke_test", run)
    assert call() is None and call() is None
    assert len(calls) == 1


def test_the_attention_kernel_keeps_a_verdict_per_type_and_head_size(verdicts, monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "_smoke_test", lambda dtype, dim: calls.append((dtype, dim)))
    for dim in (64, 64, 128):
        assert attention._availability.__wrapped__("cuda", "float16", dim) is None
    assert calls == [("float16", 64), ("float16", 128)]


def test_a_crash_in_the_smoke_test_is_reported_and_not_kept(verdicts, monkeypatch):
    def boom():
        raise RuntimeError("nvrtc: error")
    monkeypatch.setattr(gemv_rows, "_smoke_test", boom)
    for _ in range(2):
        assert "failed to build or run: RuntimeError: nvrtc: error" in gemv_rows._availability.__wrapped__("cuda")
    assert not list((verdicts / smoke_cache.NAMESPACE).glob("*.json"))
