"""Where the engine's time goes under load, without HTTP: N requests decoded together in
process, the engine thread under cProfile.

    python bench/engine_profile.py [--model default] [--weights float16] [--requests 32] [--tokens 128]
                                   [--kv-pool auto]

(A tiny random model, e.g. from tests/synthetic.py, makes the forward pass negligible and
leaves the engine's own per-row work.)

Prints aggregate tok/s and the functions with the most own time on the engine thread
(time inside mx.eval is time spent waiting for the device; on Python 3.12 the profile also
sees the driving thread).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from harness import drive  # noqa: E402

from lockstep.kernels.batching.pool_mode import pool_mode  # noqa: E402
from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402
from lockstep.models.load import load_model  # noqa: E402
from lockstep.server.engine import Engine  # noqa: E402
from lockstep.server.engine.guarantee.decode_plan import plan_request  # noqa: E402
from lockstep.server.engine.guarantee.deployment import proven_deployment  # noqa: E402
from lockstep.server.engine.decoding.request_state import GenerationRequest  # noqa: E402
from lockstep.server.engine.decoding.sampling import SamplingParams  # noqa: E402


class ProfiledEngine(Engine):
    profile = cProfile.Profile()

    def _run(self) -> None:
        self.profile.runcall(super()._run)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="model spec or directory (as `serve --model`)")
    parser.add_argument("--weights", default="float16")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--kv-pool", default="auto")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--pool-kernel-double", action="store_true",
                        help="on the CPU, the GPU's decode path: the KV pool's kernel by tests/doubles/pool_kernel.py's "
                             "stand-in (passes compiled and decoded ahead); with --kv-pool auto")
    args = parser.parse_args()
    if args.pool_kernel_double:
        from tests.doubles.pool_kernel import pool_kernel_double

        pool_kernel_double().__enter__()  # for the process's life
        from lockstep.kernels.batching import pool_mode as pool_mode_module

        pool_mode_module.kernel_unavailable_reason = lambda *args, **kwargs: None  # its own name for it

    loaded = load_model(args.model, args.weights)
    invariance = set_batch_invariant_limit(loaded.model, args.limit)
    mode = pool_mode(loaded.model, args.kv_pool)
    # the ragged proof covers every pass width the engine below may build, as serve's does
    deployment = proven_deployment(loaded.model, invariance, kv_pool=mode, pass_rows=max(32, args.requests))
    engine = ProfiledEngine(loaded, max_active=args.requests, deployment=deployment,
                            max_batch_rows=max(32, args.requests), max_kv_tokens=None)
    mx.eval(loaded.model(mx.array([[1, 2, 3]])))
    engine.start()
    vocab = loaded.model.args.vocab_size
    requests = [GenerationRequest(prompt_tokens=mx.random.randint(0, vocab, (40 + i,), key=mx.random.key(i)).tolist(),
                                  max_tokens=args.tokens,
                                  sampling=SamplingParams(temperature=args.temperature, seed=i))
                for i in range(args.requests)]
    plans = [plan_request(deployment, deterministic=args.deterministic, speculative=None, num_draft_tokens=None)
             for _ in requests]
    start = time.perf_counter()
    tokens = asyncio.run(drive(engine, requests, plans))
    wall = time.perf_counter() - start
    engine.stop()
    out = io.StringIO()
    pstats.Stats(engine.profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    print(f"{args.requests} requests x {args.tokens} tokens, kv_pool {mode}, L = {invariance.call_rows} "
          f"({invariance.strategy}), deterministic {args.deterministic}, temperature {args.temperature}: {tokens} tokens in {wall:.2f} s = "
          f"{tokens / wall:.1f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
