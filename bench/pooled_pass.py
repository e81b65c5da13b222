"""One batched decode pass: each request's own KV caches vs the shared KV pool.

    python bench/pooled_pass.py [--weights float16] [--limit 16] [--batches 1,4,16,32]

For B requests with prompts of --prompt-tokens, times a decode pass of one row per request
(what the engine runs under load) with per-request caches (kv_pool off) and with the pool
(kernels/batching/kv_pool.py; the GPU kernel where available), and checks that in the pool every
request's logits row is bit-identical to its pass alone. With --limit L the batch-invariant
forms for L are installed (strategy --strategy) and the ragged-pass proof runs over the
pool, plus its negative control (L = 0: native forms must fail the proof where the backend
varies). Prints a table last.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from lockstep.kernels.batching.kv_pool import KVPool  # noqa: E402
from lockstep.kernels.batching.pool_mode import pool_mode  # noqa: E402
from lockstep.kernels.batching.ragged import enable_ragged, ragged_forward  # noqa: E402
from lockstep.kernels.batching.ragged_selftest import prove_ragged  # noqa: E402
from lockstep.kernels.custom.attention import kernel_unavailable_reason  # noqa: E402
from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402
from lockstep.models.load import load_model  # noqa: E402


def timed_passes(model, caches, steps: int) -> float:
    """Seconds per decode pass of one row per request (KV appended, then trimmed back)."""
    rows = [[7] for _ in caches]
    mx.eval(ragged_forward(model, list(zip(caches, rows))))  # warm-up, compiles
    for c in caches:
        for layer in c:
            layer.trim(1)
    start = time.perf_counter()
    for _ in range(steps):
        mx.eval(ragged_forward(model, list(zip(caches, rows))))
        for c in caches:
            for layer in c:
                layer.trim(1)
    return (time.perf_counter() - start) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--weights", default="float16")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--strategy", default="strided_gemv")
    parser.add_argument("--batches", default="1,4,16,32")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    loaded = load_model(args.model, args.weights)
    model = loaded.model
    print(f"device {mx.default_device()}, MLX {mx.__version__}, model {loaded.name} {args.weights}")
    print(f"pooled attention kernel: {kernel_unavailable_reason(mx.float16, 64) or 'available'}; "
          f"--kv-pool auto -> {pool_mode(model, 'auto')}")
    if args.limit:
        invariance = set_batch_invariant_limit(model, args.limit, args.strategy)
        print(f"L = {args.limit}: strategy {invariance.strategy}, guaranteed {invariance.guaranteed} ({invariance.reason})")
    enable_ragged(model)
    use_kernel = pool_mode(model, "auto") == "kernel"
    mode = "kernel" if use_kernel else "reference"

    proofs = []
    if args.limit:
        t = time.perf_counter()
        proof = prove_ragged(model, args.limit, kv_pool=mode)
        proofs.append((f"ragged proof L={args.limit}, pool {mode}", bool(proof), proof.reason,
                       time.perf_counter() - t))
        setting = set_batch_invariant_limit(model, 0)
        control = prove_ragged(model, args.limit, kv_pool=mode)
        proofs.append(("negative control: native forms (L = 0), same proof", bool(control), control.reason, 0.0))
        del setting
        set_batch_invariant_limit(model, args.limit, args.strategy)

    vocab = int(model.args.vocab_size)
    table = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = [mx.random.randint(0, vocab, (args.prompt_tokens + 17 * i,), key=mx.random.key(i)).tolist()
                   for i in range(batch)]
        plain = []
        for p in prompts:
            c = make_prompt_cache(model)
            mx.eval(model(mx.array(p)[None], cache=c))
            plain.append(c)
        pool = KVPool(model, batch * (args.prompt_tokens + 17 * batch + 64), use_kernel=use_kernel)
        pooled = []
        for p in prompts:
            c = pool.allocate(len(p) + 64)
            mx.eval(model(mx.array(p)[None], cache=c))
            pooled.append(c)
        off = timed_passes(model, plain, args.steps)
        on = timed_passes(model, pooled, args.steps)
        together = ragged_forward(model, [(pool.clone(c), [9]) for c in pooled])
        alone = [ragged_forward(model, [(pool.clone(c), [9])])[0] for c in pooled]
        mx.eval(together, alone)
        same = sum(bool(mx.array_equal(a, b).item()) for a, b in zip(together, alone))
        table.append((batch, off, on, same))

    print()
    for what, passed, reason, seconds in proofs:
        print(f"{what}: {'passed' if passed else 'FAILED'} {reason} ({seconds:.1f} s)")
    print(f"\ndecode pass, one row per request, prompts ~{args.prompt_tokens} tokens, L = {args.limit}")
    print(f"{'B':>4} {'own caches ms':>14} {'pool ms':>9} {'pool/own':>9} {'own tok/s':>10} {'pool tok/s':>11}"
          f" {'rows = alone':>13}")
    for batch, off, on, same in table:
        print(f"{batch:>4} {off * 1e3:>14.2f} {on * 1e3:>9.2f} {on / off:>9.2f} {batch / off:>10.0f}"
              f" {batch / on:>11.0f} {same:>9}/{batch}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
