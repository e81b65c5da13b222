"""Cost of one all-reduce inside a decode-like graph, per backend (issue 14's analysis).

A tensor-parallel decode step runs 2 all-reduces per layer. This times, on every rank of an
mlx.launch, a graph of `--layers` × 2 small matmuls each followed by an all-reduce of the
(rows, hidden) activations, against the same graph without the all-reduces; the difference
÷ the number of all-reduces is what one costs in a forward pass. Prints from rank 0.

    mlx.launch --backend nccl -n 2 -- python bench/allreduce_latency.py
"""
import argparse
import time

import mlx.core as mx


def step(x, w, layers: int, reduce: bool, group):
    for _ in range(2 * layers):
        x = x @ w
        if reduce:
            x = mx.distributed.all_sum(x, group=group)
    return x


def timed(fn, repeats: int) -> float:
    mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    group = mx.distributed.init()
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    w = (mx.random.normal((args.hidden, args.hidden)) / args.hidden ** 0.5).astype(dtype)
    lines = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = mx.random.normal((rows, args.hidden)).astype(dtype)
        plain = timed(lambda: step(x, w, args.layers, False, group), args.repeats)
        reduced = timed(lambda: step(x, w, args.layers, True, group), args.repeats)
        per = (reduced - plain) / (2 * args.layers) * 1e6
        lines.append(f"rows {rows:3d}: {2 * args.layers} matmuls {plain * 1e3:7.2f} ms, with an all_sum after each "
                     f"{reduced * 1e3:7.2f} ms -> {per:6.1f} us per all_sum")
    if group.rank() == 0:
        print(f"world {group.size()}, {mx.default_device()}, hidden {args.hidden}, mlx {mx.__version__}")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
