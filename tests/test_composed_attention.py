"""The "composed" attention form of strategy `cpu_kernel` (kernels/invariance/composed_attention.py):
all query rows in a few matmuls that the shim's invariant kernel takes.

It must equal MLX's attention within float32 rounding (causal rows, GQA, key counts that are
not multiples of 8), serve only what it can, and give each row of a block the bits of that
row alone when the matmuls run on the invariant kernel; on plain OpenBLAS (rows vary with M)
the same comparison must diverge, or the test would prove nothing.
"""
from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

from lockstep.kernels.invariance.composed_attention import composed_attention, composed_serves
from tests.test_cpu_blas import _run, _shim_env  # the shim acts at process start


def _qkv(t, s, heads=9, kv_heads=3, d=64, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((1, heads, t, d), key=k1), mx.random.normal((1, kv_heads, s, d), key=k2),
            mx.random.normal((1, kv_heads, s, d), key=k3))


@pytest.mark.parametrize("t,s,heads,kv_heads", [(1, 37, 9, 3), (5, 37, 9, 3), (8, 64, 4, 4), (3, 3, 2, 1)])
def test_matches_mlx_attention(t, s, heads, kv_heads):
    q, k, v = _qkv(t, s, heads, kv_heads)
    got = composed_attention(q, k, v, 0.125)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal" if t > 1 else None)
    assert got.shape == want.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_serves_causal_or_no_mask_without_sinks():
    assert composed_serves(None, None) and composed_serves("causal", None)
    assert not composed_serves(mx.zeros((2, 2), dtype=mx.bool_), None)
    assert not composed_serves("causal", mx.zeros((9,)))


ROWS = """
    import json, os, mlx.core as mx
    from lockstep.kernels import cpu_blas
    from lockstep.kernels.invariance.composed_attention import composed_attention
    cpu_blas.set_kernel_limit(int(os.environ["COMPOSED_LIMIT"]))
    keys = mx.random.split(mx.random.key(1), 3)
    t, s = 8, 45  # 45 keys: not a multiple of the kernel's 8 lanes
    q = mx.random.normal((1, 9, t, 64), key=keys[0])
    k = mx.random.normal((1, 3, s, 64), key=keys[1])
    v = mx.random.normal((1, 3, s, 64), key=keys[2])
    block = composed_attention(q, k, v, 0.125)
    same = 0
    for i in range(t):
        end = s - t + i + 1
        one = composed_attention(q[:, :, i:i + 1], k[:, :, :end], v[:, :, :end], 0.125)
        same += bool(mx.array_equal(one[:, :, 0], block[:, :, i]).item())
    print(json.dumps({"same": same, "blas": cpu_blas.describe()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD shim is Linux-only")
def test_block_rows_equal_single_rows_on_the_invariant_kernel_and_not_on_openblas():
    on_kernel = _run(ROWS, {**_shim_env(), "COMPOSED_LIMIT": "8"})
    assert on_kernel["same"] == 8, on_kernel
    on_openblas = _run(ROWS, {**_shim_env(), "COMPOSED_LIMIT": "0"})
    assert on_openblas["same"] < 8, f"OpenBLAS gave every row the single-row bits: {on_openblas}"


# GQA folded into rows (group x T <= the kernel's limit) against repeated key/value heads (the
# limit below group x T): both run every matmul on the invariant kernel, so the bits must agree;
# a fold that mapped query heads to the wrong key head, or padding that moved a lane, fails here.
FOLD = """
    import json, mlx.core as mx, numpy as np
    from lockstep.kernels import cpu_blas
    from lockstep.kernels.invariance.composed_attention import composed_attention
    out = {"equal": [], "max_err": 0.0}
    keys = mx.random.split(mx.random.key(4), 3)
    for t, s, folded, repeated in [(1, 45, 4, 2), (1, 8, 3, 1), (2, 37, 8, 2), (3, 130, 9, 4)]:
        q = mx.random.normal((1, 9, t, 64), key=keys[0])
        k = mx.random.normal((1, 3, s, 64), key=keys[1])
        v = mx.random.normal((1, 3, s, 64), key=keys[2])
        cpu_blas.set_kernel_limit(folded)  # read when the graph is built and when it runs
        a = composed_attention(q, k, v, 0.125)
        mx.eval(a)
        cpu_blas.set_kernel_limit(repeated)
        b = composed_attention(q, k, v, 0.125)
        mx.eval(b)
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal" if t > 1 else None)
        out["equal"].append(bool(mx.array_equal(a, b).item()))
        out["max_err"] = max(out["max_err"], float(mx.abs(a - want).max().item()))
    print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD shim is Linux-only")
def test_folded_query_heads_give_the_bits_of_repeated_key_heads():
    r = _run(FOLD, _shim_env())
    assert r["equal"] == [True] * 4, r
    assert r["max_err"] < 1e-5, r
