"""Cost of batch-invariant mode: decode tokens/s and an L-row verify block, native vs each
canonical strategy, on the running backend. Measures, asserts nothing.

    python bench/invariant_cost.py [tiny|default] [--limit 8] [--steps 64]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402


def load(spec):
    if spec == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from tiny_models import tiny_llama

        return tiny_llama(quant="affine", tied=True)
    from lockstep.models.load import load_model

    return load_model(spec).model


def decode_tok_s(model, steps, prefix=32):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(prefix)[None] % 200, cache=cache))
    tok = mx.array([[1]])
    mx.eval(model(tok, cache=cache))  # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        tok = mx.argmax(model(tok, cache=cache)[:, -1:], axis=-1)
        mx.eval(tok)
    return steps / (time.perf_counter() - t)


def block_ms(model, width, prefix=32, repeats=5):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(prefix)[None] % 200, cache=cache))
    block = mx.arange(width)[None] + 3
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(model(block, cache=cache))
        best = min(best, time.perf_counter() - t)
        for c in cache:
            c.trim(width)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="tiny")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    model = load(a.model)
    print(f"backend {mx.default_device()}, model {a.model}, L={a.limit}")
    strategies = ("off", "native", "strided_gemv", "rowwise")
    best = {s: (0.0, float("inf")) for s in strategies}
    # Interleaved rounds, best of each: shared machines make single runs noisy.
    for _ in range(a.rounds):
        for strategy in strategies:
            if strategy == "off":
                set_batch_invariant_limit(model, 0)
            else:
                set_batch_invariant_limit(model, a.limit, strategy, verify=False)
            tps, ms = decode_tok_s(model, a.steps), block_ms(model, a.limit)
            best[strategy] = (max(best[strategy][0], tps), min(best[strategy][1], ms))
    base = best["off"]
    for strategy, (tps, ms) in best.items():
        print(f"{strategy:>13}: decode {tps:8.1f} tok/s ({tps / base[0]:.2f}x)   "
              f"{a.limit}-row block {ms:7.2f} ms ({ms / base[1]:.2f}x)")
    invariance = set_batch_invariant_limit(model, a.limit)
    print(f"auto: {invariance.strategy}, guaranteed={invariance.guaranteed}: {invariance.reason}")
    print(f"      self-test {invariance.self_test.seconds:.2f}s, candidates {invariance.candidates}")


if __name__ == "__main__":
    main()
