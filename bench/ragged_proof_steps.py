"""Where a ragged proof's time goes, fresh or resumed from a record of 1..--kept widths: its
setup (each pool member's prefill, then each one's solo pass) and its width passes, timed at the
proof's own steps (kernels/proof_steps.py: `step_done()` after every prefill, solo pass and
width), one warm round first, then --rounds.

    .venv/bin/python bench/ragged_proof_steps.py [--limit 4] [--widest 32] [--kept 17] [--rounds 2]
        [--cpu-blas openblas|reference]   # default openblas (the shim), as `serve` runs on the CPU
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lockstep.kernels import cpu_blas  # noqa: E402  (imports nothing heavy: before mlx)

# LD_PRELOAD acts at process start: re-exec before mlx loads
cpu_blas.ensure_preloaded([__file__, *sys.argv[1:]],
                          sys.argv[sys.argv.index("--cpu-blas") + 1] if "--cpu-blas" in sys.argv[:-1] else "openblas")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--widest", type=int, default=32)
    parser.add_argument("--kept", type=int, default=17, help="widths 1..kept proven before (0: a fresh proof)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpu-blas", choices=cpu_blas.CHOICES, default="openblas")
    args = parser.parse_args()

    from lockstep.kernels.batching import ragged_selftest
    from lockstep.kernels.batching.ragged import enable_ragged
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.kernels.proof_steps import between_steps
    from lockstep.models.load import load_model

    loaded = load_model("default")
    assert set_batch_invariant_limit(loaded.model, args.limit).guaranteed
    enable_ragged(loaded.model)
    pool = ragged_selftest._pool(args.limit, args.widest)
    used = len({i for w in range(args.kept + 1, args.widest + 1) for i in ragged_selftest._members_for(w, pool)})
    print(f"BLAS: {cpu_blas.describe()}; L = {args.limit}, widths {args.kept + 1}..{args.widest} to prove, "
          f"{used} of the pool's {len(pool)} members set up", flush=True)
    parts = {"prefills": [], "solo passes": [], "widths": [], "total": []}
    for n in range(args.rounds + 1):
        stamps = []
        start = time.perf_counter()
        with between_steps(lambda: stamps.append(time.perf_counter())):
            proof = ragged_selftest.prove_ragged(loaded.model, args.limit, pass_rows=args.widest, proven=args.kept)
        end = time.perf_counter()
        assert proof.passed, proof.reason
        took = {"prefills": stamps[used - 1] - start, "solo passes": stamps[2 * used - 1] - stamps[used - 1],
                "widths": end - stamps[2 * used - 1], "total": end - start}
        print(f"{'warm-up' if n == 0 else f'round {n}'}: " + ", ".join(f"{k} {v:.2f} s" for k, v in took.items()),
              flush=True)
        if n:
            for k, v in took.items():
                parts[k].append(v)
    print("median: " + ", ".join(f"{k} {statistics.median(v):.2f} s" for k, v in parts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
