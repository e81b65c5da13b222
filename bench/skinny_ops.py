"""Op-level cost of the skinny kernels at the Llama-3-8B layer shapes (H200 or a Mac GPU):
µs per call for MLX native and the skinny kernel, M = 1, 8, 16, 32, and whether every row of
the M-row call equals that row computed alone (bits). Measures and prints; asserts nothing.

    python bench/skinny_ops.py [--rows 1,8,16,32] [--weights bf16,nvfp4,affine4] [--calls 20]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from lockstep.kernels import custom  # noqa: E402
from lockstep.kernels.invariance.selftest import bits_equal  # noqa: E402

SHAPES = {"lm_head": (128256, 4096), "q/o": (4096, 4096), "k/v": (1024, 4096),
          "gate/up": (14336, 4096), "down": (4096, 14336)}
WEIGHTS = {"bf16": None, "nvfp4": ("nvfp4", 16), "affine4": ("affine", 64)}
HBM_BYTES_PER_S = 4.8e12


def per_call_us(fn, xs, calls: int) -> float:
    """Median over 5 rounds of `calls` independent calls evaluated together, per call."""
    mx.eval([fn(x) for x in xs[:2]])
    times = []
    for _ in range(5):
        t = time.perf_counter()
        mx.eval([fn(x) for x in xs[:calls]])
        times.append((time.perf_counter() - t) / calls)
    return 1e6 * float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--weights", default="bf16,nvfp4,affine4")
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args()
    print(f"backend {mx.default_device()}, MLX {mx.__version__}; kernels: {custom.unavailable_reason() or 'available'}")
    print("| weights | layer | N x K | M | floor µs | native µs | kernel µs | kernel / native | rows == M=1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for weights in a.weights.split(","):
        for layer, (n, k) in SHAPES.items():
            w = (mx.random.normal((n, k), key=mx.random.key(1)) * 0.02).astype(mx.bfloat16)
            if WEIGHTS[weights]:
                mode, group = WEIGHTS[weights]
                wq, scales, *rest = mx.quantize(w, group, 4, mode=mode)
                b = rest[0] if rest else None
                native = lambda x: mx.quantized_matmul(x, wq, scales, b, transpose=True,  # noqa: E731
                                                       group_size=group, bits=4, mode=mode)
                kernel = lambda x: custom.quantized_matmul(x, wq, scales, b, group_size=group,  # noqa: E731
                                                           bits=4, mode=mode)
                nbytes = wq.nbytes + scales.nbytes + (b.nbytes if b is not None else 0)
            else:
                native = lambda x: x @ w.T  # noqa: E731
                kernel = lambda x: custom.dense_matmul(x, w)  # noqa: E731
                nbytes = w.nbytes
            mx.eval(w)
            for m in [int(r) for r in a.rows.split(",")]:
                xs = [mx.random.normal((m, k), key=mx.random.key(10 + i)).astype(mx.bfloat16) for i in range(a.calls)]
                mx.eval(xs)
                t_native, t_kernel = per_call_us(native, xs, a.calls), per_call_us(kernel, xs, a.calls)
                block = kernel(xs[0])
                same = sum(bits_equal(block[i], kernel(xs[0][i : i + 1])[0]) for i in range(m))
                print(f"| {weights} | {layer} | {n} x {k} | {m} | {1e6 * nbytes / HBM_BYTES_PER_S:.1f} | "
                      f"{t_native:.1f} | {t_kernel:.1f} | {t_kernel / t_native:.2f} | {same}/{m} |", flush=True)
            del w
            mx.clear_cache()


if __name__ == "__main__":
    main()
