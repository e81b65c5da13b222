"""What one custom-kernel launch costs the host, against MLX's own matmul of the same shape:
the Python call that builds the graph node, and the evaluation of a chain of such nodes.

- call: `gemv_rows.matmul` (lockstep's wrapper), `mx.fast.precompiled_cuda_kernel` called
  directly with the instance's cubin, the same call with stand-in byte strings of other sizes
  (never evaluated: the cubin is only loaded at evaluation), and `x @ w.T`;
- chain: N launches, each on the previous output, built and evaluated (the host encodes each
  node; on these shapes the device's share is small), per launch; with the cubin as it is
  and with zero bytes appended (does its size cost at evaluation?).

    python bench/launch_cost.py [--rows 32] [--chain 200] [--repeats 9]

Measures and prints; asserts nothing (issue 27: the canonical pass's extra host time). CUDA only.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from lockstep.kernels.custom import compiled, gemv_rows  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    """Median over 5 runs of the host time of `calls` graph-building calls, per call (µs)."""
    runs = []
    for _ in range(5):
        keep = []
        start = time.perf_counter()
        for _ in range(calls):
            keep.append(fn())
        runs.append((time.perf_counter() - start) / calls * 1e6)
        del keep
    return statistics.median(runs)


def chain_us(step, x, length: int, repeats: int) -> float:
    """Median per-launch time of building and evaluating `length` chained launches."""
    runs = []
    for _ in range(repeats + 1):
        mx.synchronize()
        start = time.perf_counter()
        y = x
        for _ in range(length):
            y = step(y)
        mx.eval(y)
        mx.synchronize()
        runs.append((time.perf_counter() - start) / length * 1e6)
    return statistics.median(runs[1:])  # the first run loads modules


def elf_sections(blob: bytes) -> list[tuple[str, int]]:
    """(name, size) of a 64-bit little-endian ELF's sections (what a cubin is made of)."""
    import struct

    if blob[:4] != b"\x7fELF":
        return []
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = []
    for h in headers:
        name = blob[names_at + h[0]:blob.index(b"\0", names_at + h[0])].decode()
        out.append((name, h[5]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--chain", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dims", default="576x576,192x576,1536x576,576x1536", help="NxK of the weights")
    args = parser.parse_args()
    problem = gemv_rows.unavailable_reason()
    if problem:
        print(problem)
        return 1
    print(f"{mx.default_device()}, MLX {mx.__version__}, launch mode {compiled.mode('gemv_rows')}, "
          f"{args.rows} rows, float16")
    print("| weight N x K | cubin bytes | wrapper call µs | direct call µs | call, 1 KB / 100 KB stand-in µs "
          "| x @ w.T call µs | mx.compile'd call µs |")
    print("|---|---|---|---|---|---|---|")
    dtype = mx.float16
    for dims in args.dims.split(","):
        n, k = (int(v) for v in dims.split("x"))
        x = mx.random.normal((args.rows, k)).astype(dtype)
        w = mx.random.normal((n, k)).astype(dtype)
        mx.eval(x, w)
        call, launch = gemv_rows._launcher(args.rows, n, k, dtype, None)
        blob = launch.get("compiled_source", b"")

        def direct(source):  # the wrapper's call with another byte string as the cubin
            return call(inputs=[x, w], **{**launch, "compiled_source": source})[0]

        wrapper = per_call_us(lambda: gemv_rows.matmul(x, w), 2000)
        plain = per_call_us(lambda: call(inputs=[x, w], **launch)[0], 2000)
        kb1, kb100 = b"\0" * 1024, b"\0" * 102400
        small = per_call_us(lambda: direct(kb1), 2000) if blob else float("nan")
        large = per_call_us(lambda: direct(kb100), 2000) if blob else float("nan")
        native = per_call_us(lambda: x @ w.T, 2000)
        once = mx.compile(lambda a, b: call(inputs=[a, b], **launch)[0])
        mx.eval(once(x, w))
        traced = per_call_us(lambda: once(x, w), 2000)
        print(f"| {n} x {k} | {len(blob)} | {wrapper:.2f} | {plain:.2f} | {small:.2f} / {large:.2f} | {native:.2f} "
              f"| {traced:.2f} |")
        sections = elf_sections(blob)

    print("cubin sections (bytes): " + ", ".join(f"{name or '-'} {size}" for name, size in sections if size))

    # chains on a square weight: each launch takes the previous output
    k = 576
    x = mx.random.normal((args.rows, k)).astype(dtype)
    w = mx.random.normal((k, k)).astype(dtype) * (1 / k ** 0.5)
    mx.eval(x, w)
    call, launch = gemv_rows._launcher(args.rows, k, k, dtype, None)
    padded = dict(launch)
    if "compiled_source" in launch:
        padded["compiled_source"] = launch["compiled_source"] + b"\0" * 262144
    print(f"\nchain of {args.chain} launches, (rows {args.rows}, {k}) @ ({k}, {k}).T, built and evaluated, µs per launch:")
    native = chain_us(lambda y: y @ w.T, x, args.chain, args.repeats)
    kernel = chain_us(lambda y: call(inputs=[y, w], **launch)[0], x, args.chain, args.repeats)
    print(f"  x @ w.T {native:.2f}; gemv_rows {kernel:.2f}", end="")
    try:
        padded_us = chain_us(lambda y: call(inputs=[y, w], **padded)[0], x, args.chain, args.repeats)
        print(f"; gemv_rows with 256 KB appended to its cubin {padded_us:.2f}")
    except Exception as exc:  # a loader that refuses trailing bytes
        print(f"; the padded cubin did not load: {type(exc).__name__}: {str(exc)[:200]}")
    once = mx.compile(lambda a, b: call(inputs=[a, b], **launch)[0])
    traced = chain_us(lambda y: once(y, w), x, args.chain, args.repeats)
    print(f"  gemv_rows through mx.compile {traced:.2f}")
    build = per_call_us(lambda: call(inputs=[x, w], **launch)[0], 2000)
    print(f"  of which building one node: {build:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
