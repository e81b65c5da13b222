"""What the batched-sampling proof (server/engine/decoding/sampling_proof.py) costs a first start
(no verdict cached), at widest passes of several widths, side by side in one process
(bench/harness.py: a warm-up round, rotated rounds, medians, paired ratios): the proof as it is
(the widths the engine batches deterministic rows in: powers of two up to W, and W) against
the same comparison at every width 2..W (what it proved before, the rows alone computed once
alike). `serve` runs it on the engine thread after the guarantee's proofs, serving between its
widths; a restart reads the verdict instead.

    python bench/sampling_proof_cost.py [--vocab 49152] [--dtype float32] [--widths 8,16,32] [--rounds 3]

The default vocabulary is the embedded SmolLM2's; float32 its logits on the CPU default
(OpenBLAS). Measures and prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from harness import measure, summary, timed  # noqa: E402
from lockstep.server.engine.decoding.sampling_proof import (FORMS, first_divergence,  # noqa: E402
                                                             prove_batched_sampling)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--widths", default="8,16,32", help="widest passes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    widths = [int(w) for w in args.widths.split(",")]

    def prove(widest: int):
        def run():
            proof = prove_batched_sampling(args.vocab, dtype, widest)  # no cache: a first start
            assert proof.rows == widest, proof.reason  # a bench of a failing proof measures nothing
        return run

    def every_width(widest: int):
        def run():
            where = first_divergence(args.vocab, dtype, list(range(2, widest + 1)))
            assert where is None, where
        return run

    variants = {}
    for w in widths:
        variants[f"every width 2..{w}"] = timed(every_width(w))
        variants[f"widest {w}"] = timed(prove(w))
    results = measure(variants, args.rounds)
    print(f"batched-sampling proof, first start: vocabulary {args.vocab}, {args.dtype}, {len(FORMS)} forms, "
          f"device {mx.default_device()}, {args.rounds} rounds after one unmeasured")
    for w in widths:
        pair = {name: results[name] for name in (f"every width 2..{w}", f"widest {w}")}
        print(summary(pair, baseline=f"every width 2..{w}"))


if __name__ == "__main__":
    main()
