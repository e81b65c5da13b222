"""Decoding ahead (server/engine/runner/decode_ahead.py) through the engine, without HTTP, on the 8B
shape (bench/invariant_8b.py's model, random weights): N streams decoded together, the engine
with decode ahead on and off, and (one stream) mlx-lm's own generate loop (`generate_step`,
which overlaps its steps the same way), rounds rotating in one process after one unmeasured
round each. Each stream's prompt is --context random tokens; a stream's decode time runs from
its first token to its last.

    python bench/decode_ahead.py [--weights nvfp4,bf16] [--streams 1,8] [--tokens 64] [--rounds 5]
                                 [--temperature 0] [--limit 0]

Reports two figures a round, each the median over rounds: ms a token from first to last (one
stream: its decode time ÷ tokens after the first; N streams: the slowest stream's, which also
holds the steps where other streams' prompts were prefilled), and the gap between a stream's
tokens (each stream's median gap, then the median over streams: the steady decode step); % of
the HBM floor, ratios within rounds (of the first figure), and whether the engine's answers
with and without decoding ahead are the same tokens.

With --limit L > 0 the requests are deterministic, on a deployment whose guarantee the startup
proofs decided (guarantee.proven_deployment, L installed as `serve` does): the loops are the
engine with and without decoding ahead and the same requests as plain ones beside them (no
mlx-lm loop: its layers are not the ones proven). After the rounds, each stream decoded alone
is compared, token for token, with the same stream decoded beside the others: deterministic
answers must be equal, plain ones are the control. Measures and prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from invariant_8b import HBM_BYTES_PER_S, build, weight_bytes  # noqa: E402
from lockstep.kernels.batching.pool_mode import pool_mode  # noqa: E402
from lockstep.kernels.batching.ragged import enable_ragged  # noqa: E402
from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402
from lockstep.kernels.invariance.layers import uninstall  # noqa: E402
from lockstep.server.engine import Engine  # noqa: E402
from lockstep.server.engine.guarantee.decode_plan import plan_request  # noqa: E402
from lockstep.server.engine.guarantee.deployment import Deployment  # noqa: E402
from lockstep.server.engine.guarantee.deployment import proven_deployment  # noqa: E402
from lockstep.server.engine.decoding.request_state import GenerationRequest  # noqa: E402
from lockstep.server.engine.decoding.sampling import SamplingParams  # noqa: E402


class CharTokenizer:
    """Token id i <-> the character U+4E00 + i: any id of the 8B vocabulary decodes."""

    def decode(self, ids) -> str:
        return "".join(chr(0x4E00 + int(i)) for i in ids)


@dataclass
class Loaded:
    model: object
    tokenizer: CharTokenizer = field(default_factory=CharTokenizer)
    path: Path = Path("/nonexistent/8b")
    name: str = "8b"
    context_length: int = 8192
    eos_token_ids: set = field(default_factory=set)  # never stop early: every round the same length
    weights: str = ""


def guarantee_words(guarantee) -> str:
    """The deployment's guarantee as the run's header says it: L is "guaranteed rows" only
    where the self-test proved it."""
    if not guarantee.guaranteed:
        return f"L = {guarantee.call_rows} not proven (deterministic requests run plain, in passes of their own)"
    return (f"guaranteed rows {guarantee.call_rows}, shared passes {guarantee.shared_passes}, "
            f"compiled canonical passes {guarantee.compiled_canonical_passes}")


def _gaps(times: list[float]) -> float:
    """ms of the median gap between consecutive tokens."""
    return 1e3 * statistics.median(b - a for a, b in zip(times, times[1:]))


def engine_round(engine, requests, deterministic: bool = False) -> tuple[tuple[float, float], list[list[int]]]:
    """(the slowest stream's ms a token after its first, the median stream's median gap), and
    every stream's token ids."""
    plan = plan_request(engine.deployment, deterministic=deterministic, speculative=None, num_draft_tokens=None)

    async def main():
        handles = [engine.submit(r, plan) for r in requests]

        async def consume(handle):
            times, text = [], ""
            async for delta in handle:
                if delta.text:
                    times.append(time.perf_counter())
                    text += delta.text
            return times, [ord(c) - 0x4E00 for c in text]

        return await asyncio.gather(*(consume(h) for h in handles))

    streams = asyncio.run(main())
    per_token = max((t[-1] - t[0]) / (len(ids) - 1) for t, ids in streams)
    return (1e3 * per_token, statistics.median(_gaps(t) for t, _ in streams)), [ids for _, ids in streams]


def mlx_lm_round(model, prompt: list[int], tokens: int, temperature: float) -> tuple[float, float]:
    """mlx-lm's generate loop, one stream: ms a token after the first, and its median gap."""
    sampler = None
    if temperature > 0:
        sampler = lambda logits: mx.random.categorical(logits * (1 / temperature))  # noqa: E731
    times = []
    for _token, _ in generate_step(mx.array(prompt), model, max_tokens=tokens, sampler=sampler):
        times.append(time.perf_counter())
    return 1e3 * (times[-1] - times[0]) / (len(times) - 1), _gaps(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="nvfp4,bf16")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--limit", type=int, default=0, help="L > 0: deterministic requests (see above)")
    a = ap.parse_args()
    print(f"backend {mx.default_device()}, MLX {mx.__version__}; {a.tokens} tokens a stream after a "
          f"{a.context}-token prompt, temperature {a.temperature}, {a.rounds} rounds after one unmeasured, "
          f"L = {a.limit}")
    deterministic = a.limit > 0
    for weights in a.weights.split(","):
        model = build(weights, a.layers)
        floor_ms = 1e3 * weight_bytes(model) / HBM_BYTES_PER_S
        # lockstep's layers as `serve` installs them: plain at L = 0, else L with its proofs
        invariance = set_batch_invariant_limit(model, a.limit)
        enable_ragged(model)
        kv_pool = pool_mode(model, "on")  # "kernel" on the GPU; the CPU runs it as a smoke test
        deployment = Deployment(kv_pool=kv_pool)
        if deterministic:
            deployment = proven_deployment(model, invariance, kv_pool=kv_pool)
            print(f"{weights}: strategy {invariance.strategy}, {guarantee_words(deployment.guarantee)}")
        loaded = Loaded(model, weights=weights)
        widest = max(8, *(int(s) for s in a.streams.split(",")))  # every stream decodes in each step
        engines = {name: Engine(loaded, max_active=widest, max_batch_rows=widest,
                                deployment=replace(deployment, decode_ahead=on))
                   for name, on in (("ahead", True), ("one at a time", False))}
        for engine in engines.values():
            engine.start()
        try:
            for streams in [int(s) for s in a.streams.split(",")]:
                prompts = [mx.random.randint(0, model.args.vocab_size, (a.context,), key=mx.random.key(7 + i)).tolist()
                           for i in range(streams)]  # noqa: E501
                requests = [GenerationRequest(p, a.tokens, SamplingParams(temperature=a.temperature, seed=5 + i))
                            for i, p in enumerate(prompts)]
                names = list(engines) + (["plain ahead"] if deterministic else ["mlx-lm"] if streams == 1 else [])
                times = {name: [] for name in names}
                answers = {}
                for r in range(a.rounds + 1):
                    order = names[r % len(names):] + names[:r % len(names)]
                    for name in order:
                        if name == "mlx-lm":
                            uninstall(model)  # mlx-lm's own classes
                            ms = mlx_lm_round(model, prompts[0], a.tokens, a.temperature)
                            set_batch_invariant_limit(model, 0)
                            enable_ragged(model)
                        elif name == "plain ahead":
                            ms, answers[name] = engine_round(engines["ahead"], requests)
                        else:
                            ms, answers[name] = engine_round(engines[name], requests, deterministic)
                        if r:
                            times[name].append(ms)
                print(f"\n## {weights}, {streams} stream(s): HBM floor {floor_ms:.2f} ms")
                print(f"| loop | median ms a token | % of floor | median ÷ {names[1]} (paired rounds) "
                      f"| median gap ms |")
                print("|---|---|---|---|---|")
                for name in names:
                    ms = statistics.median(t for t, _ in times[name])
                    gap = statistics.median(g for _, g in times[name])
                    ratio = statistics.median(t[0] / n[0] for t, n in zip(times[name], times[names[1]]))
                    print(f"| {name} | {ms:.2f} | {100 * floor_ms / ms:.1f} | {ratio:.3f} | {gap:.2f} |")
                same = answers["ahead"] == answers["one at a time"]
                counts = {n: (e.runner.ahead_built, e.runner.ahead_taken, e.runner.ahead_dropped)
                          for n, e in engines.items()}
                print(f"passes decoded ahead (built, taken over, dropped) so far: {counts}")
                print(f"same tokens with and without decoding ahead: {same}")
                if deterministic and streams > 1:
                    for kind, det in (("deterministic", True), ("plain (control)", False)):
                        alone = [engine_round(engines["ahead"], [r], det)[1][0] for r in requests]
                        beside = answers["ahead" if det else "plain ahead"]
                        equal = sum(x == y for x, y in zip(alone, beside))
                        print(f"{kind}: {equal} of {streams} streams decoded beside the others equal "
                              f"the stream decoded alone")
        finally:
            for engine in engines.values():
                engine.stop()
        del model, engines
        mx.clear_cache()


if __name__ == "__main__":
    main()
