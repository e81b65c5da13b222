"""Host cost of lockstep's canonical linear, with the kernel launch stood in for by `x @ w.T`.

A wide deterministic call (more rows than L, `calls_in_blocks`) under strategy `gemv_rows`
runs as one launch of the row kernel; the launch itself is MLX's (traced; its cost on the H200:
bench/results/history/2026-12-02-h200-launch-cost-cuda-graphs-issues27-28.md). What lockstep adds around it is Python: the layer's
wrapper, the form's checks, the reshapes. This times graph building only (nothing is
evaluated), per call, on any backend, so the chain can be measured on the CPU:

  native        nn.Linear's own call (a plain pass's linear)
  launch        the stand-in launch with the two reshapes a canonical call needs (the floor)
  canonical     InvariantLinear, a 32-row call at L = 8 under calls_in_blocks
  wrapper       InvariantLinear under native_forms (a plain pass through the installed forms)

    python bench/canonical_chain_cost.py [--rows 32] [--dim 576]

Measures and prints; asserts nothing.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from lockstep.kernels.custom import gemv_rows  # noqa: E402
from lockstep.kernels.invariance import layers  # noqa: E402
from lockstep.kernels.invariance.ops import GEMV_ROWS  # noqa: E402


def per_call_us(fn, calls: int = 20000, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--dim", type=int, default=576)
    a = ap.parse_args()

    def stand_in(x, w, *_):
        return x @ w.T

    # the kernel as if proven here, its launch the stand-in (both entry points: older trees)
    gemv_rows.unavailable_reason = lambda: None
    gemv_rows._launch = stand_in
    if hasattr(gemv_rows, "one_launch"):
        gemv_rows.one_launch = lambda lead, n, k, dtype: lambda x, w: [stand_in(x, w)]
    lin = nn.Linear(a.dim, a.dim, bias=False)
    lin.set_dtype(mx.float16)
    x = mx.random.normal((1, a.rows, a.dim)).astype(mx.float16)
    mx.eval(x, lin.parameters())
    w = lin.weight
    native = per_call_us(lambda: lin(x))
    launch = per_call_us(lambda: stand_in(x.reshape(-1, a.dim), w).reshape(1, a.rows, -1))
    lin.__class__ = layers.InvariantLinear
    setting = layers.Setting(8, GEMV_ROWS)
    with layers.batch_invariant(setting), layers.calls_in_blocks():
        canonical = per_call_us(lambda: lin(x))
    with layers.batch_invariant(setting), layers.native_forms():
        wrapper = per_call_us(lambda: lin(x))
    print(f"{mx.default_device()}, MLX {mx.__version__}, x (1, {a.rows}, {a.dim}) float16, µs a call (graph building):")
    print("| native | launch (floor) | canonical | canonical − launch | wrapper − native |")
    print("|---|---|---|---|---|")
    print(f"| {native:.2f} | {launch:.2f} | {canonical:.2f} | {canonical - launch:.2f} | {wrapper - native:.2f} |")


if __name__ == "__main__":
    main()
