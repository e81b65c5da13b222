"""What one graph node of each kind costs the host: building it in Python and MLX evaluating
it, per node, on chains of small arrays (the device's share is small on these shapes).

A decode step of an 8B model is ~900 such nodes (issue 28); which of them are worth fusing
depends on what each kind costs: a view (reshape, squeeze, transpose) launches nothing, an
elementwise op or a norm launches one kernel, a quantized matmul one of MLX's kernels, a
lockstep custom launch a traced NVRTC kernel.

    python bench/node_cost.py [--chain 400] [--repeats 7] [--out table.md]

Measures and prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402


def timed(step, start, length: int, repeats: int) -> tuple[float, float]:
    """Median (build, evaluate) µs per node of `length` chained steps from `start`."""
    builds, evals = [], []
    for _ in range(repeats + 1):
        mx.synchronize()
        t0 = time.perf_counter()
        y = start
        for _ in range(length):
            y = step(y)
        t1 = time.perf_counter()
        mx.eval(y)
        mx.synchronize()
        t2 = time.perf_counter()
        builds.append((t1 - t0) / length * 1e6)
        evals.append((t2 - t1) / length * 1e6)
    return statistics.median(builds[1:]), statistics.median(evals[1:])  # the first run compiles


def kinds(dtype) -> dict:
    """name: (step, start, nodes a step)."""
    key = mx.random.key(0)
    row = mx.random.normal((1, 4096), key=key).astype(dtype)
    heads = mx.random.normal((1, 32, 1, 128), key=key).astype(dtype)
    norm_w = mx.ones((4096,), dtype=dtype)
    small = mx.random.normal((256, 256), key=key).astype(dtype) * 0.05
    x256 = mx.random.normal((1, 256), key=key).astype(dtype)
    x32 = mx.random.normal((32, 256), key=key).astype(dtype)
    keys = mx.random.normal((1, 32, 512, 128), key=key).astype(dtype)
    buffer = mx.zeros((1, 8, 1024, 128), dtype=dtype)
    new_kv = mx.random.normal((1, 8, 1, 128), key=key).astype(dtype)
    swiglu = mx.compile(lambda a: nn.silu(a) * a)
    add_mul = mx.compile(lambda a, b: (a + b) * b)  # two elementwise ops MLX fuses into one kernel
    at = mx.array([5], dtype=mx.int32)
    slots = mx.full((1, 8, 1, 128), 5, dtype=mx.int32)

    def write(buf):
        buf[:, :, 5:6, :] = new_kv
        return buf

    out = {
        "reshape (view)": (lambda y: y.reshape(y.shape[::-1]), row, 1),
        "squeeze + expand_dims (views)": (lambda y: mx.expand_dims(y.squeeze(0), 0), row, 2),
        "transpose (view)": (lambda y: y.T, row, 1),
        "add": (lambda y: y + row, row, 1),
        "compiled silu * x": (swiglu, row, 1),
        "rms_norm": (lambda y: mx.fast.rms_norm(y, norm_w, 1e-5), row, 1),
        "rope": (lambda y: mx.fast.rope(y, 128, traditional=False, base=500000.0, scale=1.0, offset=7),
                 heads, 1),
        "slice_update (in place)": (write, buffer, 1),
        "slice_update at an array start (in place)": (
            lambda buf: mx.slice_update(buf, new_kv, at, axes=(2,)), buffer, 1),
        "put_along_axis, one row (in place)": (
            lambda buf: mx.put_along_axis(buf, slots, new_kv, axis=2), buffer, 1),
        "compiled (x + a) * a, fused": (lambda y: add_mul(y, row), row, 1),
        "sdpa, 1 query, 512 keys": (lambda q: mx.fast.scaled_dot_product_attention(q, keys, keys, scale=0.08),
                                    heads, 1),
        "matmul 1 x 256 x 256": (lambda y: y @ small.T, x256, 1),
        "matmul 32 x 256 x 256": (lambda y: y @ small.T, x32, 1),
    }
    for mode, group in (("affine", 64), ("nvfp4", 16)):
        try:
            packed = mx.quantize(small, group_size=group, bits=4, mode=mode)
        except Exception as error:  # noqa: BLE001 - a mode this MLX lacks: say so
            print(f"{mode}: {error}")
            continue
        wq, scales, *rest = packed
        biases = rest[0] if rest else None
        out[f"quantized_matmul {mode} 1 x 256 x 256"] = (
            lambda y, wq=wq, s=scales, b=biases, g=group, m=mode: mx.quantized_matmul(
                y, wq, s, b, transpose=True, group_size=g, bits=4, mode=m), x256, 1)
    try:
        from lockstep.kernels.custom import gemv_rows

        launch = gemv_rows.one_launch((2,), 256, 256, dtype)
        if launch is not None:
            x2 = x32[:2]
            out["lockstep traced launch (gemv_rows, 2 rows)"] = (lambda y: launch(y, small)[0], x2, 1)
    except Exception as error:  # noqa: BLE001 - CPU or no kernel: the table says so
        print(f"gemv_rows: {error}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chain", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    lines = [f"device {mx.default_device()}, MLX {mx.__version__}, {args.dtype}, chains of {args.chain}, "
             f"median of {args.repeats}",
             "| node | build µs | evaluate µs | both µs |", "|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name, (step, start, nodes) in kinds(dtype).items():
        build, evaluate = timed(step, start, args.chain, args.repeats)
        line = (f"| {name} | {build / nodes:.2f} | {evaluate / nodes:.2f} | "
                f"{(build + evaluate) / nodes:.2f} |")
        lines.append(line)
        print(line, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
