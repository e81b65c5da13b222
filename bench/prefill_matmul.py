"""A prompt chunk's quantized matmuls (issue 50: the first tokens of many clients wait for
their prompts): MLX's quantized matmul against dequantizing the weight and a dense matmul, at
prompt widths, for each linear of the 8B shape (bench/qmv_rows_check.py's shapes).

Per shape and rows: µs a call of each way, interleaved (harness.measure), and the TFLOP/s
MLX's call reaches. The dequantized way's figure includes the dequantization, each call.

    python bench/prefill_matmul.py [--formats nvfp4,affine4] [--rows 64,256,512,1024] [--rounds 5]

On the CPU: --shape SmolLM2 --rows 64 --rounds 1. Measures and prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from harness import measure, median, paired_ratios, table  # noqa: E402
from qmv_rows_check import FORMATS, SHAPES  # noqa: E402

REPEATS = 10  # calls a measurement, evaluated together


def call_time(fn) -> float:
    start = time.perf_counter()
    mx.eval([fn() for _ in range(REPEATS)])
    return (time.perf_counter() - start) / REPEATS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8B", choices=sorted(SHAPES))
    parser.add_argument("--formats", default="nvfp4,affine4")
    parser.add_argument("--rows", default="64,256,512,1024")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    formats = {f[0]: f for f in FORMATS}
    out = []
    for label in args.formats.split(","):
        _, mode, group, bits, dtype = formats[label]
        for name, n, k in SHAPES[args.shape]:
            w = mx.random.normal((n, k), key=mx.random.key(0)).astype(dtype) * 0.02
            q = mx.quantize(w, group_size=group, bits=bits, mode=mode)
            wq, scales, biases = q[0], q[1], (q[2] if len(q) > 2 else None)
            mx.eval(wq, scales, *([biases] if biases is not None else []))
            for m in [int(r) for r in args.rows.split(",")]:
                x = mx.random.normal((m, k), key=mx.random.key(1)).astype(dtype)
                mx.eval(x)

                def quantized():
                    return mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group, bits=bits,
                                               mode=mode)

                def dequantized():
                    dense = mx.dequantize(wq, scales, biases, group_size=group, bits=bits, mode=mode, dtype=dtype)
                    return x @ dense.T

                got = measure({"quantized": lambda: call_time(quantized), "dequantized": lambda: call_time(dequantized)},
                              rounds=args.rounds)
                qt, dt = median(got["quantized"]), median(got["dequantized"])
                out.append([label, name, m, f"{qt * 1e6:.0f}", f"{2 * m * n * k / qt / 1e12:.0f}", f"{dt * 1e6:.0f}",
                            f"{median(paired_ratios(got, 'dequantized', 'quantized')):.2f}"])
                print(" | ".join(str(c) for c in out[-1]), flush=True)
    print(table(["format", "linear", "rows", "quantized µs", "its TFLOP/s", "dequantize + matmul µs",
                 "÷ quantized (paired)"], out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
