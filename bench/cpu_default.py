"""Which weights + BLAS `auto` should pick on a Linux CPU: prefill, decode, first token.

    .venv/bin/python bench/cpu_default.py [--rounds 2] [--prompt 128] [--long 500] [--out FILE]

The embedded model (SmolLM2-135M) in each (weights, BLAS) configuration, each in its own
subprocess (LD_PRELOAD acts only at process start), rounds alternating the
configurations so machine noise hits all alike; best round reported. Per configuration:
prefill tok/s of a `--prompt`-token prompt, greedy decode tok/s, and the time to the
first token of a `--long`-token prompt (prefill in the server's 512-token chunks, then
the first token picked; the `chunk` rows use `--prefill-chunk` 256 / 128 instead). The
float32/OpenBLAS rows are repeated with deterministic mode installed (L = 8, the strategy
the self-test proves), to show what the canonical forms OpenBLAS needs cost.

Threads (issue 10): by default the shim runs calls of >= 64 rows (prefill) as fixed column
blocks on the idle cores (kernels/cpu_blas/split_gemm.c) and the rest on one OpenBLAS
thread (2 cores); "1 thread" rows turn the blocks off (the rule before), "2 threads" runs
every call on OpenBLAS's own 2 threads. OPENBLAS_* / LOCKSTEP_BLAS_* of the caller's
environment are dropped, so each row is what its name says. The last column counts, per
round, the blocks helper threads ran / the large calls split.

Issue 10's side-by-side run (the reference-BLAS rows do not depend on the shim):
    .venv/bin/python bench/cpu_default.py --rounds 2 --out bench/results/cpu_default.txt --only \
      "float32 / openblas 1 thread,float32 / openblas,float32 / openblas 2 threads,\
float32 / openblas chunk 128,float32 / openblas L=8 1 thread,float32 / openblas L=8"
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lockstep.kernels import cpu_blas  # noqa: E402

# The shim's OpenBLAS threads: `OPENBLAS_NUM_THREADS` for small calls, and
# LOCKSTEP_BLAS_LARGE_THREADS for calls of >= LOCKSTEP_BLAS_LARGE_ROWS rows (0 = one count).
ONE_THREAD = {"LOCKSTEP_BLAS_LARGE_THREADS": "0"}  # the default before issue 10's change
ALL_TWO = {"OPENBLAS_NUM_THREADS": "2", "LOCKSTEP_BLAS_LARGE_THREADS": "0"}
# Prompt chunks attend in blocks of 32 query rows on the CPU (kernels/invariance/prefill_attention.py);
# this turns that off (the rule before).
WHOLE_CHUNK = {"LOCKSTEP_PREFILL_ATTENTION_BLOCK": "0"}

CONFIGS = {  # name -> (weights, BLAS, batch-invariant limit, extra env, prefill chunk)
    "q4 / reference": ("q4", "reference", 0, {}, 512),
    "float32 / openblas": ("float32", "openblas", 0, {}, 512),
    "float32 / openblas 1 thread": ("float32", "openblas", 0, ONE_THREAD, 512),
    "float32 / openblas whole-chunk attention": ("float32", "openblas", 0, WHOLE_CHUNK, 512),
    "float32 / openblas 2 threads": ("float32", "openblas", 0, ALL_TWO, 512),
    "float32 / openblas chunk 256": ("float32", "openblas", 0, {}, 256),
    "float32 / openblas chunk 128": ("float32", "openblas", 0, {}, 128),
    "float32 / openblas L=8": ("float32", "openblas", 8, {}, 512),
    "float32 / openblas L=8 1 thread": ("float32", "openblas", 8, ONE_THREAD, 512),
    "float32 / reference": ("float32", "reference", 0, {}, 512),
    "q4 / openblas": ("q4", "openblas", 0, {}, 512),
}


def worker(weights: str, limit: int, n_prompt: int, n_long: int, n_decode: int,
           chunk: int = 512) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.models.load import load_model
    from lockstep.server.tools.speed_ratios import decode, prefill_seconds
    from lockstep.server.engine.runner.model_runner import ModelRunner, forward

    from lockstep.kernels.batching.ragged import enable_ragged

    loaded = load_model("default", weights=weights)
    model = loaded.model
    invariance = set_batch_invariant_limit(model, limit) if limit else None
    enable_ragged(model)  # the model's attention through lockstep's hook, as the engine has it
    text = "The lighthouse keeper climbed the stairs and lit the lamp. " * 200
    tokens = list(loaded.tokenizer.encode(text))
    decode(model, tokens[:8], 2)  # warm-up
    prompt_s = prefill_seconds(model, tokens[:n_prompt])
    _, decode_s, _ = decode(model, tokens[:16], n_decode)
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    for _ in ModelRunner(model, batched=False).prefill_cache(cache, tokens[: n_long - 1], chunk):  # as the engine does
        pass
    first = mx.argmax(forward(model, cache, tokens[n_long - 1 : n_long])[-1])
    mx.eval(first)
    ttft = time.perf_counter() - start
    return {"blas": cpu_blas.describe(), "weights": loaded.weights,
            "strategy": invariance.strategy if invariance else "-", "guaranteed": invariance.guaranteed if invariance else None,
            "prefill_tps": n_prompt / prompt_s, "decode_tps": n_decode / decode_s, "ttft_s": ttft,
            "split": cpu_blas.split_counts()}


def run_config(name: str, args) -> dict:
    weights, blas, limit, extra, chunk = CONFIGS[name]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS_", "LOCKSTEP_BLAS_", "LOCKSTEP_PREFILL_"))}
    env = cpu_blas.preload_env({**base, **extra}) if blas == "openblas" else cpu_blas.reference_env(base)
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'bench')!r});"
            f"from cpu_default import worker; print('RESULT', json.dumps(worker({weights!r}, {limit}, "
            f"{args.prompt}, {args.long}, {args.decode}, {chunk})))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=ROOT)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-2000:]}")
    return json.loads(line[7:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--long", type=int, default=500)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--only", default=None, help="comma-separated config names")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGS)
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name in names:
            r = run_config(name, args)
            b = best.setdefault(name, r)
            for k, better in (("prefill_tps", max), ("decode_tps", max), ("ttft_s", min)):
                b[k] = better(b[k], r[k])
            b.setdefault("splits", []).append(r["split"])
    lines = [f"embedded model, {args.prompt}-token prefill, {args.decode}-token greedy decode, "
             f"first token of a {args.long}-token prompt; best of {args.rounds} alternating rounds",
             f"{'configuration':<26} {'prefill tok/s':>13} {'decode tok/s':>12} {'first token s':>13}  strategy / BLAS"]
    for name, r in best.items():
        # Per round: blocks run by helper threads / large calls split (helpers run only
        # where a core was idle; the bits are the same either way).
        helpers = ", ".join(f"{s[1]}/{s[0]}" for s in r["splits"] if s and s[0]) or "-"
        lines.append(f"{name:<26} {r['prefill_tps']:13.1f} {r['decode_tps']:12.1f} {r['ttft_s']:13.2f}  "
                     f"{r['strategy']} (guaranteed {r['guaranteed']}) / {r['blas']}; "
                     f"helper blocks per round {helpers}")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
