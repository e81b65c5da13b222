"""What the fallback ragged proof costs when a wider one failed: before (the proof of 1..L from
nothing) and after (crediting the widths the wider proof passed; kernels/batching/ragged_selftest.py
`prove_ragged_cached(credit_from=...)`), side by side in one process.

The embedded model with batch invariance for L; a kernel broken at width --broken-at (a stand-in
for a backend whose wide passes differ: that pass's first request gets other logits;
tests/doubles/ragged_proof_passes.py, which also counts the passes), so the proof of 1..--widest
fails there; this times the fallback proof of 1..L, a deployment's fallback where the wider proof
failed at L + 1 (the defaults; server/engine/guarantee/guarantee.py). Each round, with a verdict
store of its own: the wider proof (not timed), then the fallback proof timed, before and after
alternating; one warm round first, then the medians of --rounds. The fallback's passes are
counted: its width passes, and its setup's solo passes.

    .venv/bin/python bench/fallback_proof.py [--limit 4] [--widest 32] [--broken-at 5] [--rounds 3]
        [--cpu-blas openblas|reference]   # default openblas (the shim), as `serve` runs on the CPU
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
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
    parser.add_argument("--broken-at", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu-blas", choices=cpu_blas.CHOICES, default="openblas")
    args = parser.parse_args()
    if not args.limit < args.broken_at <= args.widest:
        parser.error("--broken-at must be wider than --limit and at most --widest")

    from lockstep.kernels.batching.ragged import enable_ragged
    from lockstep.kernels.batching.ragged_selftest import prove_ragged_cached
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.kernels.invariance.selftest import ProofCache
    from lockstep.kernels.verdict_cache import VerdictCache
    from lockstep.models.load import load_model
    from tests.doubles.ragged_proof_passes import counted_widths

    loaded = load_model("default")
    assert set_batch_invariant_limit(loaded.model, args.limit).guaranteed
    enable_ragged(loaded.model)
    print(f"BLAS: {cpu_blas.describe()}; L = {args.limit}, widest {args.widest}, broken from {args.broken_at}",
          flush=True)
    seconds = {"before": [], "after": []}
    for n in range(args.rounds + 1):
        for mode in seconds:
            with tempfile.TemporaryDirectory() as tmp:
                proofs = ProofCache(VerdictCache("selftest", Path(tmp)), {"weights": "bench"})
                with counted_widths(broken_width=args.broken_at):
                    wider = prove_ragged_cached(loaded.model, args.limit, proofs, pass_rows=args.widest)
                assert not wider.passed, "the wider proof passed: nothing to fall back from"
                setup = {}
                with counted_widths(broken_width=args.broken_at, setup=setup) as widths:
                    start = time.perf_counter()
                    fallback = prove_ragged_cached(loaded.model, args.limit, proofs, pass_rows=args.limit,
                                                   **({"credit_from": args.widest} if mode == "after" else {}))
                    took = time.perf_counter() - start
                assert fallback.passed
                counts = {"widths": len(widths), "solo": len(setup["solo"])}
            if n:
                seconds[mode].append(took)
            print(f"{'warm-up' if n == 0 else f'round {n}'} {mode}: {took:.2f} s; {counts['widths']} width passes, "
                  f"{counts['solo']} solo passes; widths credited 1..{fallback.resumed}", flush=True)
    for mode, values in seconds.items():
        print(f"{mode}: median {statistics.median(values):.3f} s of {', '.join(f'{v:.3f}' for v in values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
