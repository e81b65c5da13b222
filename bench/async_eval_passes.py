"""Decode passes built whole, then evaluated, against passes that start evaluating every N
layers while the rest is built (`serve --async-eval-layers N`): the engine's ragged pass of
B requests (one row each, over the KV pool where the backend has one), in process, variants
rotating round by round (bench/harness.py). Also checks that every variant's logits equal
the whole pass's.

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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lockstep.kernels import cpu_blas  # noqa: E402  (imports nothing heavy: before mlx)

if "--cpu-blas" in sys.argv[:-1]:  # LD_PRELOAD acts at process start: re-exec before mlx loads
    cpu_blas.ensure_preloaded([__file__, *sys.argv[1:]], sys.argv[sys.argv.index("--cpu-blas") + 1])

import mlx.core as mx  # noqa: E402

from lockstep.kernels.batching.pool_mode import pool_mode  # noqa: E402
from lockstep.kernels.batching.ragged import ragged_logits  # noqa: E402
from lockstep.models.load import load_model  # noqa: E402
from lockstep.server.engine.guarantee.deployment import Deployment  # noqa: E402
from lockstep.server.engine.runner.model_runner import ModelRunner  # noqa: E402

from harness import measure, median, paired_ratios, table  # noqa: E402


def build_time(measured: tuple) -> float:
    return measured[0]


def pass_time(measured: tuple) -> float:
    return measured[1]


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

    def passes(every: int):
        got = [one_pass(every) for _ in range(args.passes)]
        return statistics.median(b for b, _ in got), statistics.median(t for _, t in got)

    results = measure({v: (lambda v=v: passes(v)) for v in variants}, rounds=args.rounds)

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
          f"{args.requests} requests one row each, {len(model.layers)} layers; {args.rounds} rounds rotating, "
          f"median of {args.passes} passes each")
    rows = [[v or "off", f"{median(results[v], build_time) * 1e3:.2f}", f"{median(results[v], pass_time) * 1e3:.2f}",
             f"{median(paired_ratios(results, v, variants[0], pass_time)):.3f}", equal[v]] for v in variants]
    print(table(["async eval every", "build ms", "pass ms (build included)", "÷ built whole (paired median)",
                 "logits equal"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
