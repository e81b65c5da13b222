"""One-row plain steps of the 8B shape (bench/invariant_8b.py's model, KV pool, compiled passes)
under launch layouts, timed interleaved in one process: round after round, each layout one step
in turn (the order rotating), so the lent machine's drift reaches every layout alike. Reports
each layout's median step, its median ratio to mlx-lm's own step taken in the same rounds, the
graph's nodes, and whether its logits equal the first layout's bit for bit.

Each step is timed in three phases: build (the Python call that makes the graph), submit
(`mx.async_eval`: MLX encodes every node into CUDA graphs and launches them; it returns once all
are launched) and wait (until the device finishes). A wait near zero says the host is the
bound: the device finished the last graph while the host was still encoding. --nodes prints
each graph's nodes by primitive.

--pipelined K: each sample is K steps in a row, each built and submitted before the one before
it is waited for (as mlx-lm's generate loop runs its steps: `mx.async_eval` of the next step,
then the current token), reported per step. The host's building then overlaps the device's
work, so a step costs the larger of the two.

Layouts (each traced once while it is set up, then replayed):
- `lockstep`: what the engine runs (lockstep's launches with no view nodes around them,
  compiled.shaped_launch);
- `lockstep_views`: the same kernels with reshape and squeeze nodes around every lockstep
  launch, as the launches were before `compiled.shaped_launch` (the same bits);
- `lockstep_commits`: lockstep's pass handed to the device in parts: `mx.async_eval` of the
  pool's keys and values of each layer in --commit-at, then of the logits (each ends a CUDA
  graph, so the graph left after the host's last launch is short);
- `lockstep_busy`: lockstep's step submitted while the device still runs ~10 ms of matmuls
  enqueued just before (does the host encode slower while the device runs?).
One-row sibling launches (q/k/v and gate/up each as one qmv_split launch) and the hand-over in
parts inside the engine's compiled pass (commit a1383b3) were measured this way and not kept:
bench/results/history/2026-12-03-h200-sibling-launches-not-kept-issue28.md and
bench/results/history/2026-12-03-h200-step-phases-decode-ahead-issue28.md.

--requests N: a pass of N requests of one row each (the engine's decode pass for N streams),
each after its own context; mlx-lm's own step is only timed for one request, so wider passes
give ratios to the first layout.

    python bench/step_layouts.py [--weights nvfp4,bf16] [--rounds 40] [--requests 1] [--pipelined 1]

Measures and prints; asserts nothing.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from invariant_8b import HBM_BYTES_PER_S, build, context, trim, weight_bytes  # noqa: E402
from op_count import ops  # noqa: E402
from lockstep.kernels.batching.compiled_pass import CompiledPasses  # noqa: E402
from lockstep.kernels.custom import attention, compiled, qmv_mma, qmv_mma_parts, qmv_split, split_attention  # noqa: E402
from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402
from lockstep.kernels.invariance.layers import uninstall  # noqa: E402
from lockstep.server.engine.runner.model_runner import ModelRunner  # noqa: E402

LAYOUTS = ("lockstep", "lockstep_views", "lockstep_commits", "lockstep_busy")
_SIZES_ARE_SCALARS = compiled.sizes_are_scalars


def _forget_launches() -> None:
    for cached in (qmv_split.launch_for, qmv_mma.launch_for, qmv_mma_parts.launch_for, split_attention._traced,
                   attention._traced):
        cached.cache_clear()


def set_up(model, layout: str) -> None:
    """Install lockstep's plain layers (L = 0) as `layout` has them."""
    views = layout.endswith("_views")
    compiled.sizes_are_scalars = (lambda call: False) if views else _SIZES_ARE_SCALARS
    _forget_launches()
    set_batch_invariant_limit(model, 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="nvfp4,bf16")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--nodes", action="store_true", help="print each graph's nodes by primitive")
    ap.add_argument("--commit-at", default="24,28,30", help="lockstep_commits: layers whose KV is handed over first")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--pipelined", default="1", metavar="K[,K...]", help="steps a sample, each submitted before "
                    "the previous one is waited for (a table for each K)")
    a = ap.parse_args()
    layouts = [s for s in a.layouts.split(",") if s in LAYOUTS]
    ks = [int(k) for k in a.pipelined.split(",")]
    print(f"backend {mx.default_device()}, MLX {mx.__version__}; {a.requests} request(s) of one row, context "
          f"{a.context}, {a.rounds} interleaved rounds")
    for weights in a.weights.split(","):
        model = build(weights, a.layers)
        floor_ms = 1e3 * weight_bytes(model) / HBM_BYTES_PER_S
        native_cache = context(model, a.context)
        path = ModelRunner.as_engine_runs(model, "kernel")
        pooled = [context(model, a.context, path.new_cache(a.context + max(ks)), seed=1 + i) for i in range(a.requests)]
        token = [11]
        runs, nodes, same = {}, {}, {}
        pool = path.kv_pool
        commit_at = [int(i) for i in a.commit_at.split(",") if i]
        submit = {"lockstep_commits": lambda out: [mx.async_eval(pool.keys[i], pool.values[i]) for i in commit_at]
                  + [mx.async_eval(out)]}
        big = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
        mx.eval(big)

        def busy():
            y = big
            for _ in range(8):
                y = y @ big
            mx.async_eval(y)

        before = {"lockstep_busy": busy}
        first = None
        for layout in layouts:
            set_up(model, layout)
            passes = CompiledPasses(model, path.kv_pool)
            runs[layout] = (lambda p: lambda: p.logits([(cache, token) for cache in pooled]))(passes)
            out = runs[layout]()  # traced now, under this layout
            kinds = ops(out)
            nodes[layout] = sum(kinds.values())
            if a.nodes:
                print(f"{weights} {layout} nodes: {dict(kinds.most_common())}")
            mx.eval(out)
            first = out if first is None else first
            same[layout] = mx.array_equal(out, first).item()
            for cache in pooled:
                trim(cache, 1)
        compiled.sizes_are_scalars = _SIZES_ARE_SCALARS
        _forget_launches()
        uninstall(model)  # mlx-lm's own step: its classes, its caches (the traces above are kept)
        runs["mlx-lm"] = lambda: model(mx.array([token]), cache=native_cache)[0]
        caches = {name: pooled for name in layouts} | {"mlx-lm": [native_cache]}
        out = runs["mlx-lm"]()
        kinds = ops(out)
        nodes["mlx-lm"] = sum(kinds.values())
        if a.nodes:
            print(f"{weights} mlx-lm nodes: {dict(kinds.most_common())}")
        mx.eval(out)
        trim(native_cache, 1)
        names = (["mlx-lm"] if a.requests == 1 else []) + layouts
        for k in ks:
            times = {name: [] for name in names}
            phases = {name: [] for name in names}
            for r in range(a.rounds + 1):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    before.get(name, lambda: None)()
                    building = submitting = 0.0
                    start = time.perf_counter()
                    previous = None
                    for _ in range(k):
                        t0 = time.perf_counter()
                        out = runs[name]()
                        t1 = time.perf_counter()
                        submit.get(name, mx.async_eval)(out)
                        t2 = time.perf_counter()
                        building, submitting = building + t1 - t0, submitting + t2 - t1
                        if previous is not None:
                            mx.eval(previous)
                        previous = out
                    mx.eval(previous)
                    total = time.perf_counter() - start
                    for cache in caches[name]:
                        trim(cache, k)
                    if r:  # round 0 is a warm-up
                        times[name].append(1e3 * total / k)
                        waiting = total - building - submitting
                        phases[name].append(tuple(1e3 * t / k for t in (building, submitting, waiting)))
            print(f"\n## {weights}: HBM floor {floor_ms:.2f} ms" + (f"; {k} steps pipelined a sample" if k > 1 else ""))
            print(f"| layout | nodes | median ms a step | build / submit / wait ms (medians) | % of floor "
                  f"| median ÷ {names[0]} (paired rounds) | logits == {layouts[0]}'s |")
            print("|---|---|---|---|---|---|---|")
            for name in names:
                ratio = statistics.median(t / n for t, n in zip(times[name], times[names[0]]))
                ms = statistics.median(times[name])
                split = " / ".join(f"{statistics.median(p[i] for p in phases[name]):.2f}" for i in range(3))
                print(f"| {name} | {nodes[name]} | {ms:.2f} | {split} | {100 * floor_ms / ms:.1f} | {ratio:.3f} "
                      f"| {same.get(name, '')} |")
        del model, runs, native_cache, pooled, path
        mx.clear_cache()


if __name__ == "__main__":
    main()
