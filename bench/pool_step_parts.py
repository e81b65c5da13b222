"""Where one step of an 8B-shaped model spends its time: mlx-lm's caches vs the engine's KV
pool (with the pooled attention kernel, and with the per-row reference attention), host graph
building vs the whole step, per strategy, B = 1 and 8; then the attention op alone (kernel vs
MLX's own). Measures and prints; asserts nothing.

    python bench/pool_step_parts.py [--layers 32]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from invariant_8b import build, context, forward, trim  # noqa: E402
from lockstep.kernels.custom import attention  # noqa: E402
from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402
from lockstep.server.engine.runner.model_runner import ModelRunner  # noqa: E402


def measure(run, cache, tokens, repeats=9):
    """(median ms to build the graph, median ms for build + eval)."""
    mx.eval(run(tokens))
    trim(cache, len(tokens))
    built, total = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run(tokens)
        t1 = time.perf_counter()
        mx.eval(out)
        built.append(t1 - t0)
        total.append(time.perf_counter() - t0)
        trim(cache, len(tokens))
    return 1e3 * float(np.median(built)), 1e3 * float(np.median(total))


def per_call_us(fn, calls=30):
    mx.eval(fn())
    t = time.perf_counter()
    mx.eval([fn() for _ in range(calls)])
    return 1e6 * (time.perf_counter() - t) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    a = ap.parse_args()
    model = build("bf16", a.layers)
    plain = context(model, 512)
    path = ModelRunner.as_engine_runs(model, "kernel")
    pooled = context(model, 512, path.new_cache(600))
    path_ref = ModelRunner.as_engine_runs(model, "on")  # the pool without the attention kernel
    pooled_ref = context(model, 512, path_ref.new_cache(600))
    for strategy, limit in (("native", 0), ("gemv_rows", 16), ("skinny", 16)):
        set_batch_invariant_limit(model, limit, strategy, verify=False)
        for b in (1, 8):
            tokens = list(range(100, 100 + b))
            for name, run, cache in (("plain", forward(model, plain, None), plain),
                                     ("pool+kernel", forward(model, pooled, path), pooled),
                                     ("pool+ref", forward(model, pooled_ref, path_ref), pooled_ref)):
                if b > 1 and name == "pool+ref":
                    continue
                built, total = measure(run, cache, tokens)
                print(f"{strategy:>10} B={b} {name:>12}: build {built:6.2f} ms, step {total:6.2f} ms", flush=True)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    kp = mx.random.normal((8, 4096, 128)).astype(mx.bfloat16)
    vp = mx.random.normal((8, 4096, 128)).astype(mx.bfloat16)
    rows = attention.PoolRows([0], [512])
    k, v = kp[None, :, :512], vp[None, :, :512]
    print(f"attention op, 30 calls evaluated together: pooled kernel "
          f"{per_call_us(lambda: attention.kernel_attention(q, kp, vp, rows, 0.088)):.1f} us, MLX SDPA on a "
          f"cache view {per_call_us(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088)):.1f} us")


if __name__ == "__main__":
    main()
