"""Deterministic against plain requests through the engine, side by side, without HTTP: N
requests decoded together in process, rounds alternating between plain and deterministic
plans on one deployment (L installed, the ragged proof made for every width), and each decode
pass split into host graph building, the rest of the pass (device wait, argmax, sampling)
and the engine's time between passes. Where the runner compiles plain passes
(kernels/batching/compiled_pass.py), plain rounds run both ways: compiled, and built op by op.

    python bench/engine_passes.py [--weights float16] [--limit 8] [--requests 32] [--tokens 128] [--rounds 3]
                                  [--check-solo]

--check-solo: afterwards each request runs alone (deterministic plan), and the last
deterministic round's answers are compared with those solo answers (and the last plain
round's, which carry no guarantee, for contrast).

Measures and prints; asserts nothing (issue 27: where a deterministic pass's extra time goes).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from lockstep.kernels.batching import compiled_pass  # noqa: E402
from lockstep.kernels.batching.pool_mode import pool_mode  # noqa: E402
from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402
from lockstep.models.load import load_model  # noqa: E402
from lockstep.server.engine import Engine  # noqa: E402
from lockstep.server.engine.runner import model_runner  # noqa: E402
from lockstep.server.engine.guarantee.decode_plan import plan_request  # noqa: E402
from lockstep.server.engine.guarantee.deployment import proven_deployment  # noqa: E402
from lockstep.server.engine.decoding.request_state import GenerationRequest  # noqa: E402
from lockstep.server.engine.decoding.sampling import SamplingParams  # noqa: E402

RECORD: dict[str, list] = {"build": [], "decode": [], "start": [], "end": [], "rows": []}


async def answers(engine, requests, plans) -> list[tuple[str, int]]:
    """Each request's (answer text, completion tokens), all submitted at once."""
    handles = [engine.submit(r, plan) for r, plan in zip(requests, plans)]

    async def consume(handle):
        deltas = [delta async for delta in handle]
        return "".join(d.text for d in deltas), deltas[-1].completion_tokens

    return list(await asyncio.gather(*(consume(h) for h in handles)))


def instrument() -> None:
    """Time each decode pass's graph building (ragged_logits, or the compiled call) and the whole pass."""
    build = model_runner.ragged_logits
    compiled_build = compiled_pass.CompiledPasses.logits
    decode = model_runner.ModelRunner.decode

    def timed_build(*args, **kwargs):
        t = time.perf_counter()
        out = build(*args, **kwargs)
        RECORD["build"].append(time.perf_counter() - t)
        return out

    def timed_compiled_build(*args, **kwargs):
        t = time.perf_counter()
        out = compiled_build(*args, **kwargs)
        RECORD["build"].append(time.perf_counter() - t)
        return out

    def timed_decode(self, decode_pass):
        t = time.perf_counter()
        out = decode(self, decode_pass)
        RECORD["start"].append(t)
        RECORD["end"].append(time.perf_counter())
        RECORD["rows"].append(sum(len(rows) for _, rows in decode_pass.members))
        return out

    model_runner.ragged_logits = timed_build
    compiled_pass.CompiledPasses.logits = timed_compiled_build
    model_runner.ModelRunner.decode = timed_decode


def one_round(engine, requests, plans, compiled) -> dict:
    """One round; `compiled`: the runner's CompiledPasses for its plain passes, or None (op by op)."""
    engine.runner.compiled = compiled
    for v in RECORD.values():
        v.clear()
    start = time.perf_counter()
    got = asyncio.run(answers(engine, requests, plans))
    wall = time.perf_counter() - start
    texts, tokens = [text for text, _ in got], sum(n for _, n in got)
    wide = [i for i, r in enumerate(RECORD["rows"]) if r == len(requests)]  # passes holding every request
    gaps = [RECORD["start"][i] - RECORD["end"][i - 1] for i in wide if i > 0 and i - 1 in wide]
    ms = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    return dict(tok_s=tokens / wall, passes=len(RECORD["rows"]), wide=len(wide), texts=texts,
                build=ms([RECORD["build"][i] for i in wide]),
                decode=ms([RECORD["end"][i] - RECORD["start"][i] for i in wide]), gap=ms(gaps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--weights", default="float16")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check-solo", action="store_true")
    args = ap.parse_args()

    loaded = load_model(args.model, args.weights)
    invariance = set_batch_invariant_limit(loaded.model, args.limit, args.strategy)
    mode = pool_mode(loaded.model, "auto")
    deployment = proven_deployment(loaded.model, invariance, kv_pool=mode, pass_rows=max(32, args.requests))
    instrument()
    engine = Engine(loaded, max_active=args.requests, deployment=deployment,
                    max_batch_rows=max(32, args.requests), max_kv_tokens=None)
    engine.start()
    vocab = loaded.model.args.vocab_size
    requests = [GenerationRequest(prompt_tokens=mx.random.randint(0, vocab, (40 + i,), key=mx.random.key(i)).tolist(),
                                  max_tokens=args.tokens, sampling=SamplingParams(temperature=0.0, seed=i))
                for i in range(args.requests)]
    plans = {det: [plan_request(deployment, deterministic=det, speculative=None, num_draft_tokens=None)
                   for _ in requests] for det in (False, True)}
    print(f"{mx.default_device()}, MLX {mx.__version__}, {loaded.name} {args.weights}, L = {invariance.call_rows} "
          f"({invariance.strategy}), kv pool {mode}, pass rows {deployment.guarantee.pass_rows}, compiled passes: plain "
          f"{engine.runner.compiled is not None}, deterministic {deployment.guarantee.compiled_canonical_passes}; "
          f"{args.requests} requests x "
          f"{args.tokens} tokens, rounds alternating (one unmeasured round each first)", flush=True)
    compiled = engine.runner.compiled
    # (name, deterministic plans, the runner's compiled passes)
    kinds = [("plain", False, compiled), ("deterministic", True, compiled)]
    if compiled is not None:
        kinds.insert(1, ("plain, op by op", False, None))
    for _, det, passes in kinds:
        one_round(engine, requests, plans[det], passes)
    rows = {name: [] for name, _, _ in kinds}
    for r in range(args.rounds):
        for name, det, passes in (kinds if r % 2 == 0 else kinds[::-1]):
            got = one_round(engine, requests, plans[det], passes)
            rows[name].append(got)
            print(f"  {name:>15}: {got['tok_s']:.1f} tok/s, {got['passes']} passes "
                  f"({got['wide']} of all {args.requests} requests): build {got['build']:.2f} ms, pass "
                  f"{got['decode']:.2f} ms, between passes {got['gap']:.2f} ms", flush=True)
    engine.runner.compiled = compiled
    if args.check_solo:
        solo = [asyncio.run(answers(engine, [r], [plans[True][0]]))[0][0] for r in requests]
        for name in ("deterministic", "plain"):
            same = sum(a == b for a, b in zip(rows[name][-1]["texts"], solo))
            print(f"{name} answers of the last round equal to each request's solo deterministic answer: "
                  f"{same}/{len(solo)}", flush=True)
    engine.stop()
    print("\n| plans | tok/s | build ms | pass ms (build included) | between passes ms |")
    print("|---|---|---|---|---|")
    for name in rows:
        med = lambda k: statistics.median(x[k] for x in rows[name])  # noqa: E731
        print(f"| {name} | {med('tok_s'):.1f} | {med('build'):.2f} | {med('decode'):.2f} | {med('gap'):.2f} |")
    for a, b in (("deterministic", "plain"), ("plain", "plain, op by op"), ("deterministic", "plain, op by op")):
        if a in rows and b in rows:
            ratio = statistics.median(x["tok_s"] / y["tok_s"] for x, y in zip(rows[a], rows[b]))
            print(f"{a} / {b}, median of per-round ratios: {ratio:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    os._exit(code)  # MLX's teardown may abort after the engine thread ran the model
