"""Strategy `cpu_kernel`: the OpenBLAS shim's own batch-invariant float32 GEMM
(kernels/cpu_blas/invariant_gemm.c) for calls of M <= L rows.

As in tests/test_cpu_blas.py, everything that needs the shim runs in a subprocess
(LD_PRELOAD acts only at process start), and a shim that cannot be built on Linux fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lockstep.kernels import cpu_blas
from tests.test_cpu_blas import _run, _shim_env  # subprocess helpers: the shim acts at process start

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="LD_PRELOAD shim is Linux-only (macOS uses Accelerate)")
LIMIT = 8


# Odd shapes: K and N not multiples of the 8-float vector (K < 8: tail only), and the
# SmolLM2 layer shapes. "nt" is x @ W.T (nn.Linear, q @ k.T), "nn" is x @ V (scores @ V):
# the two layouts MLX passes (logged: always row-major, A not transposed).
KERNEL = f"""
    import ctypes, json, numpy as np, mlx.core as mx
    from lockstep.kernels import cpu_blas
    LIMIT = {LIMIT}
    shapes = [(5, 3), (13, 11), (577, 301), (576, 576), (1536, 576), (64, 9)]
    lib = ctypes.CDLL(None)
    portable = ctypes.c_int.in_dll(lib, "lockstep_cpu_kernel_portable")
    rng = np.random.default_rng(0)
    out = {{"isa": cpu_blas.kernel_isa(), "worst_rel": 0.0, "row_mismatches": [],
           "path_mismatches": [], "openblas_blocks_differ": 0}}
    bits = lambda a: np.ascontiguousarray(a).view(np.uint32)
    for k, n in shapes:
        x = rng.standard_normal((LIMIT, k)).astype(np.float32)
        w = rng.standard_normal((n, k)).astype(np.float32)
        v = rng.standard_normal((k, n)).astype(np.float32)
        cases = {{"nt": (lambda r: mx.array(r) @ mx.array(w).T, w.T),
                  "nn": (lambda r: mx.array(r) @ mx.array(v), v)}}
        for layout, (matmul, b) in cases.items():
            want = x.astype(np.float64) @ b.astype(np.float64)
            scale = np.abs(want).max()
            singles = {{}}
            cpu_blas.set_kernel_limit(LIMIT)
            for path in (0, 1):
                portable.value = path
                singles[path] = np.concatenate([np.array(matmul(x[i:i + 1])) for i in range(LIMIT)])
                for m in range(1, LIMIT + 1):
                    got = np.array(matmul(x[:m]))
                    out["worst_rel"] = max(out["worst_rel"], float(np.abs(got - want[:m]).max() / scale))
                    if (bits(got) != bits(singles[path][:m])).any():
                        out["row_mismatches"].append([k, n, layout, path, m])
            portable.value = 0
            if (bits(singles[0]) != bits(singles[1])).any():
                out["path_mismatches"].append([k, n, layout])
            # M > L goes to OpenBLAS: an 8-row block against the kernel's single rows
            cpu_blas.set_kernel_limit(LIMIT - 1)
            if (bits(np.array(matmul(x))) != bits(singles[0])).any():
                out["openblas_blocks_differ"] += 1
    print(json.dumps(out))
"""


def test_kernel_rows_are_correct_invariant_and_path_independent():
    r = _run(KERNEL, _shim_env())
    assert r["isa"] in ("avx2+fma", "portable"), r
    assert r["worst_rel"] < 1e-5, r  # float32 rounding against float64
    assert r["row_mismatches"] == [], r  # each row of M <= L has its M = 1 bits
    assert r["path_mismatches"] == [], r  # the portable path gives the vector path's bits
    # The control: above the limit OpenBLAS serves the call, and its rows differ somewhere
    # (K, N small enough for OpenBLAS to agree on every row are allowed, not all of them).
    assert r["openblas_blocks_differ"] > 0, r


# The shim's cblas_sgemm through ctypes (no MLX in between), kernel limit 8: the head of the
# scripts below.
SGEMM = """
    import ctypes, json, numpy as np
    from lockstep.kernels import cpu_blas
    cpu_blas.set_kernel_limit(8)
    lib = ctypes.CDLL(None)
    f = lib.cblas_sgemm
    P = ctypes.POINTER(ctypes.c_float)
    f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, P, ctypes.c_int, P, ctypes.c_int,
                                       ctypes.c_float, P, ctypes.c_int]
    ptr = lambda a: a.ctypes.data_as(P)
"""


# Argument combinations MLX does not pass today, through the shim's cblas_sgemm itself:
# column-major order, both transposes, alpha and beta.
DIRECT = SGEMM + """
    rng = np.random.default_rng(3)
    m, n, k, alpha, beta = 5, 19, 37, 0.5, -2.0
    errors = {}
    for order in (101, 102):
        for ta in (111, 112):
            for tb in (111, 112):
                a = rng.standard_normal((m, k)).astype(np.float32)
                b = rng.standard_normal((k, n)).astype(np.float32)
                c = rng.standard_normal((m, n)).astype(np.float32)
                want = alpha * (a.astype(np.float64) @ b) + beta * c
                layout = "C" if order == 101 else "F"
                sa = np.array(a.T if ta == 112 else a, order=layout)
                sb = np.array(b.T if tb == 112 else b, order=layout)
                got = np.array(c, order=layout)
                ld = lambda s: s.shape[1] if order == 101 else s.shape[0]
                f(order, ta, tb, m, n, k, alpha, ptr(sa), ld(sa), ptr(sb), ld(sb), beta,
                  ptr(got), n if order == 101 else m)
                errors[f"{order}/{ta}/{tb}"] = float(np.abs(got - want).max() / np.abs(want).max())
    print(json.dumps(errors))
"""


def test_kernel_takes_every_blas_argument_combination():
    r = _run(DIRECT, _shim_env())
    assert len(r) == 8 and all(err < 1e-5 for err in r.values()), r


SELFTEST = """
    import json, sys, ctypes, mlx.core as mx
    from mlx_lm.models import llama
    from lockstep.kernels import cpu_blas
    from lockstep.kernels.invariance import set_batch_invariant_limit
    if sys.argv[1] == "portable":
        ctypes.c_int.in_dll(ctypes.CDLL(None), "lockstep_cpu_kernel_portable").value = 1
    args = llama.ModelArgs(model_type="llama", hidden_size=576, num_hidden_layers=2,
                           num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                           vocab_size=1024, rms_norm_eps=1e-5, rope_theta=100000.0,
                           tie_word_embeddings=True)
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    limit = lambda: (ctypes.c_int.in_dll(ctypes.CDLL(None), "lockstep_cpu_kernel_limit").value
                     if cpu_blas.active() == "openblas" else None)
    invariance = set_batch_invariant_limit(model, 4, "auto", prefixes=(11,))
    out = {"active": cpu_blas.active(), "isa": cpu_blas.kernel_isa(), "strategy": invariance.strategy,
           "guaranteed": invariance.guaranteed, "reason": invariance.reason,
           "candidates": [list(c[:2]) for c in invariance.candidates], "shim_limit": limit()}
    set_batch_invariant_limit(model, 0)
    out["shim_limit_off"] = limit()
    print(json.dumps(out))
"""


def _selftest(env, path="vector") -> dict:
    env = {**env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SELFTEST), path], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_auto_proves_and_installs_cpu_kernel_on_openblas():
    r = _selftest(_shim_env())
    assert r["active"] == "openblas", r
    # native is tried first and fails (OpenBLAS rows vary with M); cpu_kernel is proven
    assert r["candidates"][:2] == [["native", False], ["cpu_kernel", True]], r
    assert (r["strategy"], r["guaranteed"]) == ("cpu_kernel", True), r
    assert (r["shim_limit"], r["shim_limit_off"]) == (4, 0), r


def test_portable_path_passes_the_self_test():
    r = _selftest(_shim_env(), "portable")
    assert r["isa"] == "portable", r
    assert (r["strategy"], r["guaranteed"]) == ("cpu_kernel", True), r


@pytest.mark.reference_blas
def test_without_the_shim_cpu_kernel_is_skipped_with_the_reason():
    r = _selftest(cpu_blas.reference_env(_shim_env()))
    assert r["active"] == "reference" and r["shim_limit"] is None, r
    assert r["strategy"] == "native" and r["guaranteed"], r  # reference BLAS is invariant
    # native passed first, so cpu_kernel was never needed; ask for it by name instead
    from lockstep.kernels.invariance.ops import CPU_KERNEL
    assert "OpenBLAS shim" in CPU_KERNEL.unavailable_reason(4)


# Every row of an 8-row call against the same row called alone, through the shim's cblas_sgemm
# with ctypes (no MLX in between): all the model's linear shapes (N x K, the tied head included)
# plus odd N and K tails, x @ W.T ("nt") and x @ V ("nn", [v | 1] is 65 wide), on both paths.
# A change to how the kernel schedules rows, columns or K panels that moved any bit fails here.
WIDE_ROWS = SGEMM + """
    portable = ctypes.c_int.in_dll(lib, "lockstep_cpu_kernel_portable")
    rng = np.random.default_rng(5)
    shapes = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576), (581, 583), (7, 1543),
              (65, 215), (65, 13)]
    out = {"isa": cpu_blas.kernel_isa(), "differ": [], "checked": 0}
    for n, k in shapes:
        x = rng.standard_normal((8, k)).astype(np.float32)
        for layout in ("nt", "nn"):
            if layout == "nn" and n * k > 4e6:
                continue
            b = rng.standard_normal((n, k) if layout == "nt" else (k, n)).astype(np.float32)
            tb, ldb = (112, k) if layout == "nt" else (111, n)
            def call(rows):
                c = np.zeros((rows.shape[0], n), np.float32)
                f(101, 111, tb, rows.shape[0], n, k, 1.0, ptr(rows), k, ptr(b), ldb, 0.0, ptr(c), n)
                return c
            paths = (0, 1) if n * k < 4e6 else (0,)  # the head's 28M outputs: the vector path
            for path in paths:
                portable.value = path
                wide = call(x)
                alone = np.concatenate([call(np.ascontiguousarray(x[i:i + 1])) for i in range(8)])
                four = np.concatenate([call(np.ascontiguousarray(x[i:i + 4])) for i in (0, 4)])
                for name, got in (("8 rows", wide), ("2 x 4 rows", four)):
                    out["checked"] += 1
                    if (got.view(np.uint32) != alone.view(np.uint32)).any():
                        out["differ"].append([n, k, layout, path, name])
            portable.value = 0
    print(json.dumps(out))
"""


def test_rows_of_wide_calls_have_their_single_row_bits_for_the_model_shapes():
    r = _run(WIDE_ROWS, _shim_env())
    assert r["isa"] in ("avx2+fma", "portable"), r
    assert r["checked"] > 20 and r["differ"] == [], r
