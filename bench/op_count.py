"""Ops in one decode step's graph, by primitive: mlx-lm's own step (its model call, its
caches) beside lockstep's plain step (a ragged pass over the engine's KV pool, as passes
without deterministic rows run) and its deterministic step (a strategy installed).

A decode step of an 8B model is bound by how many ops MLX dispatches, not by weight bytes
(bench/op_floor_8b.py), so this counts the nodes MLX would evaluate for one step
(mx.export_to_dot), the figure issue 28 asks to cut. The model is Llama-3-8B's layout
(32 layers, 32/8 heads of 128) with small matrices; op counts do not depend on the sizes.
Runs on any backend: the pool is the GPU kernel's on CUDA, the reference one elsewhere.

    python bench/op_count.py [--layers 32] [--strategy auto] [--limit 8] [--weights bf16] [--fuse]

--fuse: q/k/v and gate/up fused (models/fused_projections.py), as `serve --fuse-projections`.
"""
import argparse
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from invariant_8b import build, context  # noqa: E402
from lockstep.kernels import custom  # noqa: E402
from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402
from lockstep.models.fused_projections import fuse_projections  # noqa: E402
from lockstep.server.engine.runner.model_runner import ModelRunner  # noqa: E402

_NODE = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


def ops(*outputs) -> Counter:
    """Primitives in the graph that evaluating `outputs` would run."""
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return Counter(_NODE.findall(Path(f.name).read_text()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--weights", default="bf16", help="bf16, nvfp4 or affine4")
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--fuse", action="store_true", help="fuse q/k/v and gate/up first")
    ap.add_argument("--out")
    a = ap.parse_args()
    pool = "kernel" if custom.backend() == "cuda" else "reference"
    model = build(a.weights, a.layers, hidden=256, intermediate=512, vocab=1024)
    if a.fuse:
        fuse_projections(model)
    token = [7]

    def step(run, cache):
        """The step's ops; then it runs, so the next count starts from evaluated state."""
        logits = run()
        counted = ops(logits)
        mx.eval(logits, [c.state for c in cache if hasattr(c, "state")])
        return counted

    counts = {}
    cache = context(model, a.context)
    counts["mlx-lm step"] = step(lambda: model(mx.array([token]), cache=cache), cache)
    runner = ModelRunner.as_engine_runs(model, pool)
    pooled = context(model, a.context, runner.new_cache(a.context + 8))
    counts[f"lockstep plain (pool {pool})"] = step(lambda: runner.forward_rows(pooled, token), pooled)
    invariance = set_batch_invariant_limit(model, a.limit, a.strategy, verify=False)
    counts[f"lockstep deterministic ({invariance.strategy}, L = {a.limit})"] = step(
        lambda: runner.forward_rows(pooled, token), pooled)

    lines = [f"backend {mx.default_device()}, MLX {mx.__version__}; {a.weights}, {a.layers} layers, "
             f"context {a.context}, one token" + ("; q/k/v and gate/up fused" if a.fuse else "")]
    names = sorted(set().union(*counts.values()), key=lambda n: -max(c[n] for c in counts.values()))
    lines.append("| primitive | " + " | ".join(counts) + " |")
    lines.append("|---|" + "---|" * len(counts))
    lines.append("| **all** | " + " | ".join(str(sum(c.values())) for c in counts.values()) + " |")
    lines += [f"| {n} | " + " | ".join(str(c[n]) for c in counts.values()) + " |" for n in names]
    print("\n".join(lines))
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
