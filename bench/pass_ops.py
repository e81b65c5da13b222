"""Ops in one ragged decode pass of a real model over the KV pool, by primitive, at B rows (one
per request): the engine's plain pass (native forms) and its deterministic pass (canonical
forms), beside mlx-lm's own step for one request. On MLX's CUDA backend every op the graph
evaluates costs host time (bench/launch_cost.py), so the count is what a pass's host time
follows. On the CPU, MLX's fast ops (norms, RoPE, attention) count as their fallbacks' parts.

    python bench/pass_ops.py [--weights float16] [--batches 1,32] [--limit 8] [--out t.md]

Counts and prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from op_count import ops  # noqa: E402
from lockstep.kernels import custom  # noqa: E402
from lockstep.kernels.batching.kv_pool import KVPool  # noqa: E402
from lockstep.kernels.batching.pool_mode import pool_mode  # noqa: E402
from lockstep.kernels.batching.ragged import enable_ragged, ragged_logits  # noqa: E402
from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402
from lockstep.kernels.invariance.layers import calls_in_blocks, native_forms  # noqa: E402
from lockstep.models.load import load_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--weights", default="float16")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--strategy", default=None, help="default: gemv_rows on CUDA (what serve proves there), else auto")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--out")
    args = ap.parse_args()

    loaded = load_model(args.model, args.weights)
    model = loaded.model
    vocab = int(model.args.vocab_size)
    prompt = mx.random.randint(0, vocab, (args.prompt_tokens,), key=mx.random.key(0))
    counts: dict[str, Counter] = {}
    own = make_prompt_cache(model)
    mx.eval(model(prompt[None], cache=own))
    counts["mlx-lm step, 1 request"] = ops(model(mx.array([[7]]), cache=own))

    enable_ragged(model)
    mode = pool_mode(model, "auto")
    batches = [int(b) for b in args.batches.split(",")]
    pool = KVPool(model, max(batches) * (args.prompt_tokens + 64), use_kernel=mode == "kernel")
    caches = []
    for _ in range(max(batches)):
        c = pool.allocate(args.prompt_tokens + 64)
        mx.eval(model(prompt[None], cache=c))
        caches.append(c)
    strategy = args.strategy or ("gemv_rows" if custom.backend() == "cuda" else "auto")
    invariance = set_batch_invariant_limit(model, args.limit, strategy, verify=False)
    def counted(rows: int) -> Counter:
        """The pass's ops; then it runs and its rows are trimmed, so the next count starts
        from evaluated state (an unevaluated pass would be part of the next one's graph)."""
        logits = ragged_logits(model, [(c, [7]) for c in caches[:rows]])
        found = ops(*logits)
        mx.eval(logits, pool.keys, pool.values)
        for c in caches[:rows]:
            for layer in c:
                layer.trim(1)
        return found

    for b in batches:
        with native_forms():
            counts[f"plain, {b} rows"] = counted(b)
        with calls_in_blocks():
            counts[f"deterministic ({invariance.strategy}), {b} rows"] = counted(b)
    layers = len(model.layers)
    lines = [f"device {mx.default_device()}, MLX {mx.__version__}, {loaded.name} {args.weights}, {layers} layers, "
             f"kv pool {mode}, L = {args.limit}"]
    names = sorted(set().union(*counts.values()), key=lambda n: -max(c[n] for c in counts.values()))
    lines.append("| primitive | " + " | ".join(counts) + " |")
    lines.append("|---|" + "---|" * len(counts))
    lines.append("| **all** | " + " | ".join(str(sum(c.values())) for c in counts.values()) + " |")
    lines.append("| **a layer** | " + " | ".join(f"{sum(c.values()) / layers:.1f}" for c in counts.values()) + " |")
    lines += [f"| {n} | " + " | ".join(str(c[n]) for c in counts.values()) + " |" for n in names]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
