"""One decode step with q/k/v and gate/up fused (models/fused_projections.py) beside the same
model with separate layers, side by side: two copies loaded at once, steps alternating
between them (bench/harness.py), the median of every round's ratio reported with each side's median.

    python bench/fused_projections.py [--model default] [--weights float32] [--cpu-blas openblas]
                                      [--quantize MODE] [--context 64] [--rounds 7] [--steps 16]
    python bench/fused_projections.py --shape-8b bf16|nvfp4|affine4 [--layers 32]   (GPU: random
        weights at the Llama-3-8B shape, bench/invariant_8b.py's model)

Plain decode (no canonical forms): the model call on mlx-lm's own caches, one token a step.
Measures and prints; asserts nothing.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import measure, summary  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--quantize", default=None)
    ap.add_argument("--cpu-blas", default="openblas", choices=("openblas", "reference"))
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per round and side")
    ap.add_argument("--shape-8b", default=None, metavar="WEIGHTS",
                    help="random weights at the 8B shape instead of --model: bf16, nvfp4 or affine4")
    ap.add_argument("--layers", type=int, default=32, help="layers of the --shape-8b model")
    a = ap.parse_args()
    if a.shape_8b:
        a.cpu_blas = "reference"  # the 8B shape is for the GPU; no shim to preload

    from lockstep.kernels import cpu_blas

    if a.cpu_blas == "openblas":
        cpu_blas.ensure_preloaded(sys.argv, "openblas")
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from lockstep.models.fused_projections import fuse_projections
    from lockstep.models.load import load_model
    from lockstep.models.quantize import quantize_model_in_memory

    def load():
        if a.shape_8b:
            from invariant_8b import build

            class Built:
                model = build(a.shape_8b, a.layers)
            return Built
        loaded = load_model(a.model, weights="float32" if a.quantize else a.weights)
        if a.quantize:
            quantize_model_in_memory(loaded.model, None, a.quantize, None, None)
        mx.eval(loaded.model.parameters())
        return loaded

    separate, fused = load().model, load().model
    paths = fuse_projections(fused)
    prompt = mx.array([[(17 * i) % 1000 + 10 for i in range(a.context)]])
    caches = {}
    for name, model in (("separate", separate), ("fused", fused)):
        caches[name] = make_prompt_cache(model)
        mx.eval(model(prompt, cache=caches[name]))

    def steps(model, cache) -> float:
        token = mx.array([[42]])
        start = time.perf_counter()
        for _ in range(a.steps):
            token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
            mx.eval(token)
        elapsed = (time.perf_counter() - start) / a.steps
        for c in cache:
            c.trim(a.steps)
        return 1e3 * elapsed

    results = measure({"separate": lambda: steps(separate, caches["separate"]),
                       "fused": lambda: steps(fused, caches["fused"])}, rounds=a.rounds)
    print(f"backend {mx.default_device()}, MLX {mx.__version__}, BLAS {cpu_blas.describe()}; model {a.model} "
          f"({a.shape_8b or a.quantize or a.weights}), {len(paths)} fused layers, context {a.context}, {a.steps} steps a round, "
          f"{a.rounds} rounds alternating" + (f"; 8B shape, {a.layers} layers, random weights" if a.shape_8b else ""))
    print(summary(results, baseline="separate", unit="ms a step"))


if __name__ == "__main__":
    main()
