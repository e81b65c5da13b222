"""Decode passes built whole, then evaluated, against passes that start evaluating every N
layers while the rest is built (`serve --async-eval-layers N`): the engine's ragged pass of
B requests (one row each, over the KV pool where the backend has one), in process, variants
alternating round by round. Also checks that every variant's logits equal the whole pass's.

    python bench/async_eval_passes.py [--weights float16] [--requests 32] [--every 0,6,10]
                                      [--rounds 6] [--cpu-blas openblas]

Measures and prints; asserts nothing (issue 27: the host's graph building against the device).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lockstep.kernels import cpu_blas  # noqa: E402  (imports nothing heavy: before mlx)

if "--cpu-blas" in sys.argv[:-1]:  # LD_PRELOAD acts at process start: re-exec before mlx loads
    cpu_blas.ensure_preloaded([__file__, *sys.argv[1:]], sys.argv[sys.argv.index("--cpu-blas") + 1])

import mlx.core as mx  # noqa: E402

from lockstep.kernels.batching.pool_mode import pool_mode  # noqa: E402
from lockstep.kernels.batching.ragged import ragged_logits  # noqa: E402
from lockstep.models.load import load_model  # noqa: E402
from lockstep.server.engine.deployment import Deployment  # noqa: E402
from lockstep.server.engine.model_runner import ModelRunner  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--weights", default="float16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--every", default="0,6,10", help="layers between hand-offs; 0: the pass built whole")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--passes", type=int, default=4, help="passes a round and variant")
    ap.add_argument("--cpu-blas", default=None)
    args = ap.parse_args()
    variants = [int(v) for v in args.every.split(",")]

    loaded = load_model(args.model, args.weights)
    model = loaded.model
    mode = pool_mode(model, "auto")
    runner = ModelRunner(model, Deployment(kv_pool=mode), pool_tokens=args.requests * 1024)
    caches = [runner.new_cache(1024) for _ in range(args.requests)]
    for i, cache in enumerate(caches):  # prompts of different lengths, as arrivals have
        for _ in runner.prefill_cache(cache, [(7 * j + i) % 1000 + 5 for j in range(40 + i)]):
            pass

    def one_pass(every: int) -> tuple[float, float]:
        start = time.perf_counter()
        logits = ragged_logits(model, [(cache, [11]) for cache in caches], every)
        built = time.perf_counter()
        mx.eval(logits)
        return built - start, time.perf_counter() - start

    times = {v: [] for v in variants}
    builds = {v: [] for v in variants}
    for v in variants:  # warm every variant once
        one_pass(v)
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            got = [one_pass(v) for _ in range(args.passes)]
            builds[v].append(statistics.median(b for b, _ in got))
            times[v].append(statistics.median(t for _, t in got))

    # bits: every variant's pass against the whole pass, each from freshly prefilled caches
    def fresh() -> list:
        made = [runner.new_cache(64) for _ in range(3)]
        for i, cache in enumerate(made):
            for _ in runner.prefill_cache(cache, list(range(5, 30 + 7 * i))):
                pass
        return made

    rows = [[11], [12, 13], [14]]
    whole = ragged_logits(model, list(zip(fresh(), rows)), 0)
    equal = {v: "yes" if mx.array_equal(ragged_logits(model, list(zip(fresh(), rows)), v), whole).item() else "NO"
             for v in variants}

    print(f"{mx.default_device()}, MLX {mx.__version__}, {loaded.name} {args.weights}, kv pool {mode}, "
          f"{args.requests} requests one row each, {len(model.layers)} layers; {args.rounds} rounds alternating, "
          f"median of {args.passes} passes each")
    print("| async eval every | build ms | pass ms (build included) | ÷ built whole | logits equal |")
    print("|---|---|---|---|---|")
    base = statistics.median(times[variants[0]])
    for v in variants:
        ratios = [t / w for t, w in zip(times[v], times[variants[0]])]
        print(f"| {v or 'off'} | {statistics.median(builds[v]) * 1e3:.2f} | {statistics.median(times[v]) * 1e3:.2f} "
              f"| {statistics.median(ratios):.3f} (medians {statistics.median(times[v]) / base:.3f}) | {equal[v]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
