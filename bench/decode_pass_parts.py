"""Where a wide deterministic decode pass spends its time, against the same pass run natively:
the engine's ragged pass over the KV pool at B rows (one per request), per strategy, split into
host graph building and the whole pass; then the model's linears alone at B rows (native GEMM
against the strategy's one-launch canonical kernel), summed over the layers as a step runs them.
Also checks that every row of the canonical B-row pass equals that request's pass alone.

    python bench/decode_pass_parts.py [--weights float16] [--limit 8] [--strategies gemv_rows,skinny]
                                      [--batches 1,8,16,32] [--cpu-blas openblas]

Measures and prints; asserts nothing (issue 27: the deterministic 32-row step on the H200).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lockstep.kernels import cpu_blas  # noqa: E402  (imports nothing heavy: before mlx)

if "--cpu-blas" in sys.argv[:-1]:  # LD_PRELOAD acts at process start: re-exec before mlx loads
    cpu_blas.ensure_preloaded([__file__, *sys.argv[1:]], sys.argv[sys.argv.index("--cpu-blas") + 1])

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from lockstep.kernels.batching.kv_pool import KVPool  # noqa: E402
from lockstep.kernels.batching.pool_mode import pool_mode  # noqa: E402
from lockstep.kernels.batching.ragged import enable_ragged, ragged_logits  # noqa: E402
from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402
from lockstep.kernels.invariance.layers import calls_in_blocks, native_forms  # noqa: E402
from lockstep.kernels.invariance.ops import dense_rows, dense_rows_in_one_launch  # noqa: E402
from lockstep.models.load import load_model  # noqa: E402


def trim(caches, n=1):
    for c in caches:
        for layer in c:
            layer.trim(n)


def timed_pass(model, caches, context, repeats):
    """(median ms to build the pass's graph, median ms for build + eval), one row per request."""
    run = lambda: ragged_logits(model, [(c, [7]) for c in caches])  # noqa: E731
    with context():
        mx.eval(run())
        trim(caches)
        built, total = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            y = run()
            t1 = time.perf_counter()
            mx.eval(y)
            t2 = time.perf_counter()
            trim(caches)
            built.append((t1 - t0) * 1e3)
            total.append((t2 - t0) * 1e3)
    return statistics.median(built), statistics.median(total)


def rows_equal_alone(model, pool, caches):
    """How many rows of the canonical B-row pass equal that request's canonical pass alone."""
    with calls_in_blocks():
        together = ragged_logits(model, [(pool.clone(c), [9]) for c in caches])
        alone = [ragged_logits(model, [(pool.clone(c), [9])])[0] for c in caches]
        mx.eval(together, alone)
    return sum(bool(mx.array_equal(together[i], a).item()) for i, a in enumerate(alone))


def linear_shapes(model) -> Counter:
    """(N, K) -> how many dense linears a step runs with that weight (the tied head included)."""
    shapes = Counter()
    for _, m in model.named_modules():
        if isinstance(m, nn.Linear):
            shapes[tuple(m.weight.shape)] += 1
    if getattr(model.args, "tie_word_embeddings", False):
        shapes[tuple(model.model.embed_tokens.weight.shape)] += 1
    return shapes


def linears_ms(shapes: Counter, rows: int, dtype, form: str | None, calls: int = 20) -> float:
    """ms a step spends in its dense linears at `rows` rows: per call (median of 5 rounds of
    `calls` independent calls evaluated together), times how many the step runs."""
    total = 0.0
    for (n, k), count in shapes.items():
        w = (mx.random.normal((n, k)) * 0.02).astype(dtype)
        xs = [mx.random.normal((rows, k)).astype(dtype) for _ in range(calls)]
        mx.eval(w, xs)

        def run():
            if form is None:
                return [x @ w.T for x in xs]
            if rows == 1:
                return [x @ w.T for x in xs]
            one = [dense_rows_in_one_launch(x, w, form) for x in xs]
            return [dense_rows(x, w, form) if y is None else y for x, y in zip(xs, one)]

        mx.eval(run())
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            mx.eval(run())
            times.append((time.perf_counter() - t0) * 1e3 / calls)
        total += statistics.median(times) * count
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--weights", default="float16")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--strategies", default="gemv_rows,skinny")
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--cpu-blas", choices=cpu_blas.CHOICES, default=None,
                    help="MLX's CPU BLAS (the process re-executes itself under it; cpu_kernel needs openblas)")
    args = ap.parse_args()

    loaded = load_model(args.model, args.weights)
    model = loaded.model
    enable_ragged(model)
    mode = pool_mode(model, "auto")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"device {mx.default_device()}, MLX {mx.__version__}, model {loaded.name} {args.weights}, "
          f"kv pool {mode}, L = {args.limit}", flush=True)
    vocab = int(model.args.vocab_size)
    most = max(batches)
    pool = KVPool(model, most * (args.prompt_tokens + 17 * most + 64), use_kernel=mode == "kernel")
    caches = []
    for i in range(most):
        prompt = mx.random.randint(0, vocab, (args.prompt_tokens + 17 * i,), key=mx.random.key(i)).tolist()
        c = pool.allocate(len(prompt) + 64)
        mx.eval(model(mx.array(prompt)[None], cache=c))
        caches.append(c)
    shapes = linear_shapes(model)
    dtype = model.model.embed_tokens.weight.dtype
    print(f"dense linears a step: {sum(shapes.values())} in {len(shapes)} shapes, {dtype}", flush=True)

    rows_out = []
    for name in args.strategies.split(","):
        try:
            invariance = set_batch_invariant_limit(model, args.limit, name, verify=False)
        except Exception as e:  # noqa: BLE001 - a bench: report and go on
            print(f"{name}: cannot install ({e})", flush=True)
            continue
        print(f"{name}: installed ({invariance.reason})", flush=True)
        for b in batches:
            nb, nt = timed_pass(model, caches[:b], native_forms, args.repeats)
            cb, ct = timed_pass(model, caches[:b], calls_in_blocks, args.repeats)
            same = rows_equal_alone(model, pool, caches[:b]) if b > 1 else 1
            lin_native = linears_ms(shapes, b, dtype, None)
            lin_canon = linears_ms(shapes, b, dtype, invariance.strategy)
            rows_out.append((name, b, nb, nt, cb, ct, lin_native, lin_canon, same))
            print(f"  B={b:>3}: native build {nb:.2f} / pass {nt:.2f} ms; canonical build {cb:.2f} / pass {ct:.2f} ms "
                  f"({ct / nt:.2f}x); linears native {lin_native:.2f} / canonical {lin_canon:.2f} ms; "
                  f"rows = alone {same}/{b}", flush=True)
    set_batch_invariant_limit(model, 0)

    print("\n| strategy | B | native build ms | native pass ms | canonical build ms | canonical pass ms "
          "| canonical ÷ native | linears native ms | linears canonical ms | rows = alone |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, b, nb, nt, cb, ct, ln, lc, same in rows_out:
        print(f"| {name} | {b} | {nb:.2f} | {nt:.2f} | {cb:.2f} | {ct:.2f} | {ct / nt:.2f}× | {ln:.2f} | {lc:.2f} "
              f"| {same}/{b} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
