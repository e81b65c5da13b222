"""Many short prompts prefilled in one pass (issue 50): what a 16- or 32-client round does first,
its prompts' chunks in one ragged pass over the KV pool (`ModelRunner.prefill_shared`'s call,
native forms, as a plain deployment runs it). M requests, each with a short cached context, get
T new prompt tokens each; the pass is timed end to end (build, submit and the device) for each M,
median of --rounds after 3 unmeasured. With --ncu M it instead runs three passes of M requests
inside a profiler range, for Nsight Compute's kernel table (`bench/step_kernels.py --summarize`):

    ncu --profile-from-start off --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --csv python bench/shared_prompt_pass.py DIR --ncu 16 > ncu.csv

    python bench/shared_prompt_pass.py DIR [--members 16,32] [--tokens 20] [--rounds 10] [--views]

--views evaluates each request's KV as two views a layer (what `prefill_shared` evaluated before
`kv_pool.written_kv`: 2,048 arrays built at 32 requests of 32 layers) instead of the pool's arrays.

DIR is a model `serve` would load (bench/model_dirs.py writes the 8B shape). On the CPU, a small
dir: --members 2,4 --tokens 5 --rounds 2. Measures and prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from invariant_8b import context, trim  # noqa: E402
from step_rows import served  # noqa: E402
from lockstep.kernels.batching.kv_pool import written_kv  # noqa: E402
from lockstep.kernels.batching.ragged import ragged_prompt_forward  # noqa: E402
from lockstep.kernels.invariance.layers import native_forms  # noqa: E402
from lockstep.server.engine.runner.model_runner import ModelRunner  # noqa: E402

CONTEXT = 16  # each request's cached prompt before its chunk (the chat template's share)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--members", default="16,32", help="requests in the pass (comma-separated)")
    ap.add_argument("--tokens", type=int, default=20, help="new prompt tokens a request")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--views", action="store_true", help="evaluate each request's KV views (the way before)")
    ap.add_argument("--ncu", type=int, default=0, metavar="M", help="three passes of M requests in a profiler range")
    a = ap.parse_args()
    widths = [a.ncu] if a.ncu else [int(m) for m in a.members.split(",")]
    model = served(a.dir, "auto", None)
    most = max(widths)
    runner = ModelRunner.as_engine_runs(model, "kernel", pool_tokens=most * (CONTEXT + a.tokens + 8) + 64)
    caches = [context(model, CONTEXT, runner.new_cache(CONTEXT + a.tokens + 4), seed=1 + i) for i in range(most)]
    chunk = [11 + j for j in range(a.tokens)]

    def one_pass(m: int) -> None:
        with native_forms():
            out = ragged_prompt_forward(model, [(c, chunk) for c in caches[:m]])
        written = [layer.state for c in caches[:m] for layer in c] if a.views else written_kv(caches[:m])
        mx.eval(out, written)  # as prefill_shared evaluates (--views: as it did)
        for c in caches[:m]:
            trim(c, a.tokens)

    print(f"backend {mx.default_device()}, MLX {mx.__version__}; {runner.describe()}", flush=True)
    if a.ncu:
        for _ in range(3):
            one_pass(a.ncu)
        cuda = ctypes.CDLL("libcuda.so.1")
        mx.synchronize()
        cuda.cuProfilerStart()
        for _ in range(3):
            one_pass(a.ncu)
        mx.synchronize()
        cuda.cuProfilerStop()
        return 0
    print("| requests | prompt rows | median ms a pass | fastest | ms a row |")
    print("|---|---|---|---|---|")
    for m in widths:
        for _ in range(3):
            one_pass(m)
        times = []
        for _ in range(a.rounds):
            start = time.perf_counter()
            one_pass(m)
            times.append(1e3 * (time.perf_counter() - start))
        median = statistics.median(times)
        print(f"| {m} | {m * a.tokens} | {median:.2f} | {min(times):.2f} | {median / (m * a.tokens):.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
