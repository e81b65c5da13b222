"""The shim's large calls (prefill chunks) and the invariant kernel's calls (M <= L) in
fixed column blocks on idle cores.

Calls of >= LOCKSTEP_BLAS_LARGE_ROWS rows run as LOCKSTEP_BLAS_LARGE_THREADS column
blocks, each one single-threaded OpenBLAS sgemm; the invariant kernel's calls as finer
blocks, each one kernel call. Helper threads take blocks only when /proc/loadavg shows an
idle core. The bits must depend on the call's shape alone, never on whether a helper ran
(a fake loadavg file, LOCKSTEP_BLAS_LOADAVG, makes both cases happen on any machine);
small OpenBLAS calls are not split.
Speed is the bench's business (bench/cpu_default.py), not asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from lockstep.kernels import cpu_blas

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="LD_PRELOAD shim is Linux-only (macOS uses Accelerate)")

IDLE = "0.00 0.00 0.00 1/90 4242\n"  # only the caller runnable: every other core idle
BUSY = "3.00 3.00 3.00 64/90 4242\n"  # every core busy: the caller runs all blocks


def _env(tmp_path: Path, load: str | None, **extra: str) -> dict[str, str]:
    try:
        env = cpu_blas.preload_env({k: v for k, v in os.environ.items()
                                    if not k.startswith(("OPENBLAS_", "LOCKSTEP_BLAS_"))})
    except cpu_blas.ShimUnavailable as e:
        pytest.fail(f"OpenBLAS shim cannot be built on this Linux machine: {e}")
    env.update({"OPENBLAS_NUM_THREADS": "1", "LOCKSTEP_BLAS_LARGE_THREADS": "2",
                "LOCKSTEP_BLAS_LARGE_ROWS": "64", "PYTHONPATH": str(ROOT)})
    if load is not None:
        fake = tmp_path / f"loadavg-{abs(hash(load))}"
        fake.write_text(load)
        env["LOCKSTEP_BLAS_LOADAVG"] = str(fake)
    env.update(extra)
    return env


def _run(code: str, env: dict[str, str], *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# (M, N, K, weight stored transposed as nn.Linear keeps it, addmm with C): model shapes,
# an N that is no multiple of 16, one too narrow to split, an addmm (beta = 1).
PRODUCTS = """
    import json, sys, numpy as np, mlx.core as mx
    from lockstep.kernels import cpu_blas
    rng = np.random.default_rng(7)
    cases = [(64, 576, 576, True, False), (130, 1536, 576, True, False),
             (99, 576, 1536, False, False), (77, 33, 2048, True, False),
             (70, 5, 16384, False, False), (96, 200, 256, False, True),
             (200, 20, 64, True, False)]  # the last under the work floor: run whole
    outs, errs = [], []
    for m, n, k, transposed, add in cases:
        a = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.standard_normal((n, k) if transposed else (k, n)).astype(np.float32)
        c = rng.standard_normal((m, n)).astype(np.float32)
        wm = mx.array(w).T if transposed else mx.array(w)
        got = np.array(mx.addmm(mx.array(c), mx.array(a), wm) if add else mx.matmul(mx.array(a), wm))
        want = a.astype(np.float64) @ (w.T if transposed else w).astype(np.float64) + (c if add else 0)
        errs.append(float(np.abs(got - want).max() / np.abs(want).max()))
        outs.append(got.ravel())
    np.save(sys.argv[1], np.concatenate(outs))
    big = mx.array(rng.standard_normal((256, 576)).astype(np.float32))
    head = mx.array(rng.standard_normal((576, 1536)).astype(np.float32))
    for _ in range(10):  # chances for a helper to take a block, however slow it wakes
        mx.eval(big @ head)
    print(json.dumps({"errs": errs, "counts": cpu_blas.split_counts(),
                      "threads": cpu_blas.threads(), "describe": cpu_blas.describe()}))
"""


def test_preload_env_splits_large_calls_by_default():
    env = cpu_blas.preload_env({})
    assert env["LOCKSTEP_BLAS_LARGE_THREADS"] == str(cpu_blas.large_threads())
    assert env["LOCKSTEP_BLAS_LARGE_ROWS"] == str(cpu_blas.LARGE_ROWS)
    if cpu_blas.default_threads() == 1 and (os.cpu_count() or 1) > 1:
        assert cpu_blas.large_threads() == os.cpu_count()
    else:
        assert cpu_blas.large_threads() == 0
    # The caller's own setting wins (the bench's "1 thread" row relies on it).
    assert cpu_blas.preload_env({"LOCKSTEP_BLAS_LARGE_THREADS": "0"})["LOCKSTEP_BLAS_LARGE_THREADS"] == "0"


def test_split_bits_do_not_depend_on_idle_cores(tmp_path):
    idle = _run(PRODUCTS, _env(tmp_path, IDLE), str(tmp_path / "idle.npy"))
    busy = _run(PRODUCTS, _env(tmp_path, BUSY), str(tmp_path / "busy.npy"))
    whole = _run(PRODUCTS, _env(tmp_path, None, LOCKSTEP_BLAS_LARGE_THREADS="0"),
                 str(tmp_path / "whole.npy"))
    for r in (idle, busy, whole):
        assert all(e < 1e-5 for e in r["errs"]), r
    # six cases and the ten products are split (5 columns: a single block); the seventh
    # has >= 64 rows but under 4e6 multiply-adds, so it runs whole
    assert idle["counts"][0] == busy["counts"][0] == 16, (idle, busy)
    assert idle["counts"][1] > 0, f"no helper ran a block with every other core idle: {idle}"
    assert busy["counts"][1] == 0, f"a helper ran while every core was busy: {busy}"
    assert whole["counts"] == [0, 0], whole
    assert idle["threads"] == "1, 2 blocks from 64 rows", idle
    assert "threads=1, 2 blocks from 64 rows" in idle["describe"], idle
    assert whole["threads"] == "1", whole
    a, b = np.load(tmp_path / "idle.npy"), np.load(tmp_path / "busy.npy")
    assert a.shape == b.shape and np.array_equal(a, b), \
        f"{int((a != b).sum())} elements differ between helper-run and caller-run blocks"


ROWS = """
    import json, numpy as np, mlx.core as mx
    from lockstep.kernels import cpu_blas
    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal((1536, 576)).astype(np.float32))  # 9 rows: > 4e6 MACs
    counts = {}
    def calls(m):
        x = mx.array(rng.standard_normal((m, 576)).astype(np.float32))
        before = cpu_blas.split_counts()[0]
        y = x @ w.T
        mx.eval(y)
        return cpu_blas.split_counts()[0] - before, x, y
    counts["63 rows"], _, _ = calls(63)
    counts["64 rows"], _, _ = calls(64)
    cpu_blas.set_kernel_limit(8)  # strategy cpu_kernel's L: M <= 8 runs the invariant kernel
    counts["8 rows, L=8"], x, block = calls(8)
    counts["9 rows, L=8"], _, _ = calls(9)
    rows = np.concatenate([np.array(x[i:i + 1] @ w.T) for i in range(8)])
    print(json.dumps({"counts": counts, "invariant": bool(np.array_equal(np.array(block), rows))}))
"""


def test_large_calls_and_the_invariant_kernels_calls_are_split(tmp_path):
    r = _run(ROWS, _env(tmp_path, IDLE))
    # 64+ rows on OpenBLAS, and the invariant kernel's 8-row call (M <= L); 9 rows > L with
    # fewer than 64 rows: one OpenBLAS call
    assert r["counts"] == {"63 rows": 0, "64 rows": 1, "8 rows, L=8": 1, "9 rows, L=8": 0}, r
    assert r["invariant"], r
    # With the threshold at 1 row, everything OpenBLAS runs is split too.
    r = _run(ROWS, _env(tmp_path, IDLE, LOCKSTEP_BLAS_LARGE_ROWS="1"))
    assert r["counts"] == {"63 rows": 1, "64 rows": 1, "8 rows, L=8": 1, "9 rows, L=8": 1}, r
    assert r["invariant"], r
    # The default (kernels/cpu_blas.py LARGE_ROWS): plain calls of several rows above the work
    # floor use the idle cores as well, as the invariant kernel's do.
    default = _env(tmp_path, IDLE)
    default.pop("LOCKSTEP_BLAS_LARGE_ROWS")
    default = cpu_blas.preload_env(default)
    r = _run(ROWS, default)
    assert r["counts"] == {"63 rows": 1, "64 rows": 1, "8 rows, L=8": 1, "9 rows, L=8": 1}, r


KERNEL_ROWS = """
    import json, sys, numpy as np, mlx.core as mx
    from lockstep.kernels import cpu_blas
    rng = np.random.default_rng(11)
    cpu_blas.set_kernel_limit(8)
    outs = []
    # decode and verification shapes of the embedded model, N not a multiple of 16, tiny
    for m, n, k in [(1, 576, 576), (8, 1536, 576), (3, 576, 1536), (5, 49152, 576),
                    (8, 200, 100), (1, 40, 64)]:
        x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
        w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
        for _ in range(3):  # a spinning helper joins the later calls
            y = x @ w.T
            mx.eval(y)
        outs.append(np.array(y).ravel())
    np.save(sys.argv[1], np.concatenate(outs))
    print(json.dumps({"counts": cpu_blas.split_counts()}))
"""


def test_invariant_kernel_bits_do_not_depend_on_who_runs_the_blocks(tmp_path):
    idle = _run(KERNEL_ROWS, _env(tmp_path, IDLE), str(tmp_path / "idle.npy"))
    busy = _run(KERNEL_ROWS, _env(tmp_path, BUSY), str(tmp_path / "busy.npy"))
    whole = _run(KERNEL_ROWS, _env(tmp_path, None, LOCKSTEP_BLAS_LARGE_THREADS="0"),
                 str(tmp_path / "whole.npy"))
    # 5 shapes x 3 calls reach the split (the 40 x 64 one is under its work floor)
    assert idle["counts"][0] == busy["counts"][0] == 15, (idle, busy)
    assert idle["counts"][1] > 0, f"no helper ran a block with every other core idle: {idle}"
    assert busy["counts"][1] == 0, f"a helper ran while every core was busy: {busy}"
    assert whole["counts"] == [0, 0], whole
    a, b, c = (np.load(tmp_path / f"{name}.npy") for name in ("idle", "busy", "whole"))
    assert np.array_equal(a, b) and np.array_equal(a, c), \
        f"{int((a != b).sum())} / {int((a != c).sum())} elements differ by who ran the blocks"


FORK = """
    import ctypes, json, os, numpy as np
    from lockstep.kernels import cpu_blas
    lib = ctypes.CDLL(None)  # the preloaded shim's cblas_sgemm, no MLX (its threads do not fork)
    sgemm = lib.cblas_sgemm
    f, i, p = ctypes.c_float, ctypes.c_int, ctypes.c_void_p
    sgemm.argtypes = [i] * 6 + [f, p, i, p, i, f, p, i]
    rng = np.random.default_rng(5)
    a = rng.standard_normal((128, 576)).astype(np.float32)
    w = rng.standard_normal((576, 576)).astype(np.float32)
    def product():
        c = np.empty((128, 576), np.float32)
        sgemm(101, 111, 111, 128, 576, 576, 1.0, a.ctypes.data, 576, w.ctypes.data, 576, 0.0,
              c.ctypes.data, 576)
        return c
    parent = product()  # starts the helper thread
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child has no helper thread; its split calls must still finish
        os.write(wfd, b"1" if np.array_equal(product(), parent) else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    print(json.dumps({"child_equal": os.read(r, 1) == b"1", "counts": cpu_blas.split_counts(),
                      "close": bool(np.allclose(parent, a.astype(np.float64) @ w, atol=1e-3))}))
"""


def test_split_calls_work_in_a_forked_child(tmp_path):
    r = _run(FORK, _env(tmp_path, IDLE))
    assert r["child_equal"] and r["close"], r
    assert r["counts"][0] == 1, r
