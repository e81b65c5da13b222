"""Which kernels one decode step of the 8B shape runs, and how long each takes on the device
(CUDA, under Nsight Compute). The step runs warm, then three steps inside a profiler range:

    ncu --profile-from-start off --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --csv python bench/step_kernels.py [lockstep|mlx-lm] [nvfp4|bf16|affine4] > ncu.csv
    python bench/step_kernels.py --summarize ncu.csv

lockstep: the engine's plain one-row pass (lockstep's layers at L = 0, KV pool, compiled);
mlx-lm: mlx-lm's own step on its caches. Each kernel is timed alone, so the launch gaps of the
real step are not in the sum (bench/invariant_8b.py times the step).
"""
import collections
import csv
import ctypes
import io
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def summarize(path: str) -> None:
    text = Path(path).read_text()
    rows = csv.DictReader(io.StringIO(text[text.find('"ID"'):]))
    total, count = collections.defaultdict(float), collections.Counter()
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    for r in rows:
        if r.get("Metric Name") == "gpu__time_duration.sum":
            name = r["Kernel Name"][:90]
            total[name] += float(r["Metric Value"].replace(",", "")) * scale[r["Metric Unit"]]
            count[name] += 1
    steps = 3
    print(f"kernels {sum(count.values()) / steps:.0f} a step, device time {sum(total.values()) / steps:.1f} us a step")
    for name, t in sorted(total.items(), key=lambda x: -x[1]):
        print(f"{t / steps:8.1f} us  {count[name] / steps:5.0f}x  {t / count[name]:6.2f} us  {name}")


def profile(who: str, weights: str) -> None:
    import mlx.core as mx
    import numpy as np
    from invariant_8b import build, context, trim

    model = build(weights, 32)
    if who == "lockstep":
        from lockstep.kernels.batching.compiled_pass import CompiledPasses
        from lockstep.kernels.invariance import set_batch_invariant_limit
        from lockstep.server.engine.runner.model_runner import ModelRunner

        set_batch_invariant_limit(model, 0)
        path = ModelRunner.as_engine_runs(model, "kernel")
        kv = context(model, 512, path.new_cache(520))
        passes = CompiledPasses(model, path.kv_pool)
        run = lambda t: passes.logits([(kv, t)])  # noqa: E731
    else:
        kv = context(model, 512)
        run = lambda t: model(mx.array([t]), cache=kv)[0]  # noqa: E731
    times = []
    for _ in range(15):
        start = time.perf_counter()
        mx.eval(run([123]))
        times.append(time.perf_counter() - start)
        trim(kv, 1)
    print(f"{who} {weights} step ms, median of the last 10: {1e3 * np.median(times[5:]):.2f}", flush=True)
    cuda = ctypes.CDLL("libcuda.so.1")
    mx.synchronize()
    cuda.cuProfilerStart()
    for _ in range(3):
        mx.eval(run([123]))
        trim(kv, 1)
    mx.synchronize()
    cuda.cuProfilerStop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summarize"]:
        summarize(sys.argv[2])
    else:
        profile(sys.argv[1] if len(sys.argv) > 1 else "lockstep", sys.argv[2] if len(sys.argv) > 2 else "nvfp4")
