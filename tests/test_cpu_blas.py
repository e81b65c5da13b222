"""The OpenBLAS shim: builds, is correct, is really active, and is shape-variant.

Everything that needs the shim runs in a subprocess (LD_PRELOAD acts only at
process start). On Linux a shim that cannot be built FAILS with the reason:
CI has gcc and scipy-openblas32, so a skip there would hide a broken backend.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lockstep.kernels import cpu_blas

ROOT = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux")
pytestmark = pytest.mark.skipif(not LINUX, reason="LD_PRELOAD shim is Linux-only (macOS uses Accelerate)")

# (K, N) weight shapes of SmolLM2-135M (q/o_proj 576x576, down_proj 1536->576)
# for which OpenBLAS gives rows of an M=8 block that differ bitwise from the
# same rows computed one at a time (M=1); reference BLAS never does.
# Measured on SkylakeX kernels: 576x576 differs for M>=3, 1536x576 for M>=2.
VARYING_SHAPES = [(576, 576), (1536, 576)]
BLOCK_M = 8


def _shim_env() -> dict[str, str]:
    try:
        return cpu_blas.preload_env()
    except cpu_blas.ShimUnavailable as e:
        pytest.fail(f"OpenBLAS shim cannot be built on this Linux machine: {e}")


def _run(code: str, env: dict[str, str]) -> dict:
    """Run code in a fresh interpreter at the repo root; it prints one JSON line last."""
    env = {**env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


MATMUL = """
    import json, numpy as np, mlx.core as mx
    from lockstep.kernels import cpu_blas
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 576)).astype(np.float32)
    w = rng.standard_normal((576, 576)).astype(np.float32)
    got = np.array(mx.matmul(mx.array(a), mx.array(w)))
    want = a.astype(np.float64) @ w.astype(np.float64)
    print(json.dumps({"active": cpu_blas.active(), "describe": cpu_blas.describe(),
                      "max_rel": float(np.abs(got - want).max() / np.abs(want).max())}))
"""

VARIANCE = f"""
    import json, numpy as np, mlx.core as mx
    from lockstep.kernels import cpu_blas
    rng = np.random.default_rng(0)
    out = {{"active": cpu_blas.active()}}
    for k, n in {VARYING_SHAPES!r}:
        x = mx.array(rng.standard_normal(({BLOCK_M}, k)).astype(np.float32))
        w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
        block = np.array(x @ w.T)  # the nn.Linear layout mlx-lm uses
        rows = np.concatenate([np.array(x[i:i + 1] @ w.T) for i in range({BLOCK_M})])
        out[f"{{k}}x{{n}}"] = int((block != rows).sum())
    print(json.dumps(out))
"""


def test_shim_builds_and_is_cached():
    env = _shim_env()
    first = cpu_blas.build_shim()
    assert first.exists() and str(first) in env["LD_PRELOAD"]
    assert cpu_blas.build_shim() == first  # second call reuses the cached build
    assert env["OPENBLAS_NUM_THREADS"] == str(cpu_blas.default_threads())


def test_openblas_matmul_correct_and_reported():
    r = _run(MATMUL, _shim_env())
    assert r["active"] == "openblas", r
    assert r["describe"].startswith("openblas (OpenBLAS "), r
    assert r["max_rel"] < 1e-5, r


ONE_ROW = """
    import json, numpy as np, mlx.core as mx
    rng = np.random.default_rng(1)
    errors = {}
    x = rng.standard_normal((1, 577)).astype(np.float32)
    xt = np.ascontiguousarray(rng.standard_normal((577, 1)).astype(np.float32))
    w = rng.standard_normal((577, 301)).astype(np.float32)    # (K, N)
    wt = np.ascontiguousarray(w.T)                             # (N, K), as nn.Linear stores it
    cases = {"x @ w": (mx.array(x) @ mx.array(w), x @ w.astype(np.float64)),
             "x @ wt.T": (mx.array(x) @ mx.array(wt).T, x @ w.astype(np.float64)),
             "xt.T @ w": (mx.array(xt).T @ mx.array(w), xt.T @ w.astype(np.float64)),
             "xt.T @ wt.T": (mx.array(xt).T @ mx.array(wt).T, xt.T @ w.astype(np.float64))}
    for name, (got, want) in cases.items():
        errors[name] = float(np.abs(np.array(got) - want).max() / np.abs(want).max())
    print(json.dumps(errors))
"""


def test_one_row_products_take_the_gemv_path_correctly():
    """A single row goes to sgemv in the shim: every transpose combination stays correct."""
    r = _run(ONE_ROW, _shim_env())
    assert len(r) == 4 and all(err < 1e-5 for err in r.values()), r


def test_reference_blas_reported_without_shim():
    r = _run(MATMUL, cpu_blas.reference_env(_shim_env()))
    assert r["active"] == "reference", r
    assert r["max_rel"] < 1e-5, r


def test_openblas_is_shape_variant_reference_is_not():
    """The real negative control: block vs single-row fp32 matmul differs only with OpenBLAS."""
    shim = _run(VARIANCE, _shim_env())
    ref = _run(VARIANCE, cpu_blas.reference_env())
    assert shim.pop("active") == "openblas" and ref.pop("active") == "reference"
    assert all(v > 0 for v in shim.values()), f"OpenBLAS expected shape-variant, got {shim}"
    assert all(v == 0 for v in ref.values()), f"reference BLAS expected invariant, got {ref}"


REEXEC = """
    import json, sys
    from lockstep.kernels import cpu_blas
    cpu_blas.ensure_preloaded(choice=sys.argv[1])
    print(json.dumps({"active": cpu_blas.active()}))
"""


def _reexec(choice: str, env: dict[str, str]) -> str:
    env = {**env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(REEXEC), choice], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])["active"]


def test_ensure_preloaded_switches_both_ways():
    assert _reexec("openblas", cpu_blas.reference_env(_shim_env())) == "openblas"
    assert _reexec("reference", _shim_env()) == "reference"


def test_ensure_preloaded_does_not_loop():
    # The marker says "already re-exec'd": a shim that did not take must not exec again.
    env = {**cpu_blas.reference_env(_shim_env()), "LOCKSTEP_CPU_BLAS_REEXEC": "1"}
    assert _reexec("openblas", env) == "reference"


def test_ensure_preloaded_called_again_after_a_reexec_that_did_not_take_does_not_loop(monkeypatch):
    """`serve` asks twice (early, from the raw command line, then from its parsed arguments):
    after a re-exec whose shim did not take, the second call must not re-exec either."""
    execs = []
    monkeypatch.setattr(cpu_blas.os, "execve", lambda *a: execs.append(a))
    monkeypatch.setattr(cpu_blas, "active", lambda: "reference")
    monkeypatch.setattr(cpu_blas, "_reexeced", set())
    monkeypatch.setenv("LOCKSTEP_CPU_BLAS_REEXEC", "1")
    cpu_blas.ensure_preloaded(choice="openblas")
    cpu_blas.ensure_preloaded(choice="openblas")
    assert execs == []


LOGITS = """
    import json, numpy as np, mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache
    from lockstep.kernels import cpu_blas
    args = llama.ModelArgs(model_type="llama", hidden_size=576, num_hidden_layers=2,
                           num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                           vocab_size=1024, rms_norm_eps=1e-5, rope_theta=100000.0,
                           tie_word_embeddings=True)
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    tokens = mx.array([[5, 17, 300, 42, 9, 1000, 77, 3]])
    block = np.array(model(tokens, cache=make_prompt_cache(model)))[0]  # prefill, M=8
    cache = make_prompt_cache(model)
    steps = np.concatenate([np.array(model(tokens[:, i:i + 1], cache=cache))[0] for i in range(8)])
    print(json.dumps({"active": cpu_blas.active(), "rows_differing": int((block != steps).any(-1).sum())}))
"""


def test_model_logits_prefill_vs_decode():
    """Model level, SmolLM2-shaped layers: one prefill vs 8 decode steps give bitwise equal
    logits on reference BLAS, and differ on OpenBLAS (measured: all 8 rows)."""
    shim = _run(LOGITS, _shim_env())
    ref = _run(LOGITS, cpu_blas.reference_env())
    assert (shim["active"], ref["active"]) == ("openblas", "reference")
    assert ref["rows_differing"] == 0, ref
    assert shim["rows_differing"] > 0, shim


# ---- the cached shim: damaged, or in a cache directory that cannot be written ------------

@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """The shim's cache under tmp_path (XDG_CACHE_HOME), never the user's; the fallback too."""
    from lockstep.models import cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    fallback = tmp_path / "fallback"
    fallback.mkdir()
    monkeypatch.setattr(cache_dir, "fallback_root", lambda: fallback)
    return tmp_path


def _truncated(data: bytes) -> bytes:
    return data[:len(data) // 2]


def _garbage_header(data: bytes) -> bytes:
    return b"\x7fELF" + bytes(60) + data[64:]


@pytest.mark.parametrize("damage", [_truncated, _garbage_header])
def test_a_damaged_cached_shim_is_rebuilt(private_cache, damage, caplog):
    shim = cpu_blas.build_shim()
    built = shim.read_bytes()
    shim.write_bytes(damage(built))
    with caplog.at_level("WARNING", logger="lockstep.kernels.cpu_blas"):
        assert cpu_blas.build_shim() == shim
    assert shim.read_bytes() == built  # the compiler's output is the same for the same sources
    (record,) = caplog.records
    assert record.getMessage().startswith(f"rebuilding the cached CPU BLAS shim {shim}: ")


def test_a_truncated_cached_shim_does_not_kill_the_start(private_cache):
    """Preloading a truncated .so dies of SIGBUS in the loader before Python runs: the
    re-exec must never be handed one."""
    shim = cpu_blas.build_shim()
    shim.write_bytes(_truncated(shim.read_bytes()))
    env = {**cpu_blas.reference_env(), "XDG_CACHE_HOME": str(private_cache / "xdg")}
    assert _reexec("openblas", env) == "openblas"
    assert cpu_blas.damage(shim) is None


def _refusing_writes_under(root: Path, code: int, monkeypatch):
    """A double for a read-only or full file system under `root` (root may write anywhere)."""
    import errno
    import os
    import tempfile

    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).is_relative_to(root):
            raise OSError(code, os.strerror(code), str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    return {errno.EROFS: "Read-only file system", errno.ENOSPC: "No space left on device"}[code]


def _linker_out_of_space_under(root: Path, tmp: Path, monkeypatch) -> str:
    """A double for the compiler on a full disk: the file is created, the link fails."""
    import os
    import shutil

    fake = tmp / "cc"
    fake.write_text(f"""#!/bin/sh
case "$*" in *" -o {root}/"*)
  echo "/usr/bin/ld: final link failed: No space left on device" >&2; exit 1;;
esac
exec {shutil.which("cc") or shutil.which("gcc")} "$@"
""")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    return os.strerror(28)


@pytest.mark.parametrize("problem", ["not a directory", "read-only", "full", "full at link time"])
def test_an_unusable_cache_dir_is_one_line_and_the_shim_is_built_elsewhere(private_cache, problem,
                                                                           monkeypatch, caplog):
    import errno

    xdg = private_cache / "xdg"
    if problem == "not a directory":
        xdg.write_text("a file where the cache directory should be")
        what = "Not a directory"
    elif problem == "full at link time":
        what = _linker_out_of_space_under(xdg, private_cache, monkeypatch)
    else:
        what = _refusing_writes_under(xdg, errno.EROFS if problem == "read-only" else errno.ENOSPC, monkeypatch)
    with caplog.at_level("WARNING", logger="lockstep.kernels.cpu_blas"):
        shim = cpu_blas.build_shim()
    assert shim.parent == private_cache / "fallback" / "cpu_blas" and cpu_blas.damage(shim) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"cache directory {xdg / 'lockstep' / 'cpu_blas'}: {what}; building the CPU BLAS shim in "
        f"{shim.parent} instead"]


def test_no_writable_directory_at_all_is_one_reason_naming_both(private_cache, monkeypatch):
    # ensure_preloaded logs this reason in one line and keeps reference BLAS
    import errno

    from lockstep.models import cache_dir

    (private_cache / "xdg").write_text("not a directory")

    def no_fallback():
        raise OSError(errno.EPERM, "not a private directory of this user", "/tmp/lockstep-cache-0")

    monkeypatch.setattr(cache_dir, "fallback_root", no_fallback)
    with pytest.raises(cpu_blas.ShimUnavailable) as unavailable:
        cpu_blas.preload_env({})
    reason = str(unavailable.value)
    assert "\n" not in reason and "Not a directory" in reason and "not a private directory" in reason
