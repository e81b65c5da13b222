"""A long prompt's prefill with and without dequantized_rows (issue 50): the model runner
prefills a prompt in the engine's chunks (server/tools/speed_ratios.prefill_seconds) at L = 0,
its wide plain calls once through kernels/custom/dequantized_rows.py and once through MLX's
quantized matmul (the path's rows out of reach), interleaved in one process
(harness.measure). Prints tokens/s each way and the paired ratio.

    python bench/prefill_chunks.py --model DIR [--prompt-tokens 4096] [--rounds 3]

Measures and prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import measure, summary  # noqa: E402
from lockstep.kernels.custom import dequantized_rows  # noqa: E402
from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402
from lockstep.models.load import load_model  # noqa: E402
from lockstep.server.tools.speed_ratios import prefill_seconds  # noqa: E402

ON = dequantized_rows.ROWS_FROM


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loaded = load_model(args.model)
    model = loaded.model
    set_batch_invariant_limit(model, 0)  # the plain calls' kernels, as serve installs them at L = 0
    split = [m._split_rows for _, m in model.named_modules() if getattr(m, "_split_rows", None) is not None]
    prompt = [(i * 7919) % (model.args.vocab_size - 1) + 1 for i in range(args.prompt_tokens)]

    def way(rows_from: tuple):
        def run() -> float:
            dequantized_rows.ROWS_FROM = rows_from
            for s in split:
                s.launches.clear()  # each call's choice is made again under this bound
            return prefill_seconds(model, prompt, args.chunk)
        return run

    results = measure({"quantized matmul": way(((0, 1 << 30),)), "dequantized": way(ON)}, rounds=args.rounds)
    print(f"{args.model}: {args.prompt_tokens}-token prompt in {args.chunk}-token chunks, L = 0, "
          f"{len(split)} layers with lockstep's plain kernels; seconds, and tokens/s of the medians:")
    print(summary(results, baseline="quantized matmul", unit="s", digits=3))
    for name, got in results.items():
        print(f"{name}: {args.prompt_tokens / sorted(got)[len(got) // 2]:.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
