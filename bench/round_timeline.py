"""Where a round of N clients' time goes (issue 50), without HTTP: `lockstep serve`'s own
assembly (its engine, admission, proofs and kernels) gets N chat requests at once, the prompts
of `lockstep bench --concurrency` (tools/http_load.py, each round its own), and every engine
step is timed as it runs: prompt chunks (prefill) and decode passes apart.

With `--kinds plain,deterministic` the rounds alternate between the kinds in one process
(after one unmeasured round of each), so both are measured under the same conditions.

Per round: wall time and tok/s; the time until every request has its first token (the prefill
phase: its prefill steps, its decode steps, the rest); then the decode phase's steps by rows
(median ms a step); and how many decode passes were built ahead and taken over (the host's
building of a pass overlapped the device's work on the one before: `decode_ahead.py`). The rest
of a round's wall time (not inside a step) is the engine's own work between steps and waits
for requests. One unmeasured round first, medians of the rounds.

    python bench/round_timeline.py --model DIR [--clients 16,32] [--tokens 96] [--rounds 3]
                                   [--kinds plain,deterministic] [--serve-arg=--batch-invariant-limit=8 ...]
                                   [--log server.log]

--host-profile N adds the engine thread's host work over the measured rounds (cProfile, started
and stopped on that thread between its iterations; from Python 3.12 a profiler covers every
thread, so the report also holds the clients' event loop, `consume`): the N functions with the
most time of their own. Model calls there are the graph's building and the waits for the device (`decode`,
`prefill_shared`); the rest is the engine's per-request work (admission with its prefix-cache
copies, request updates, detokenization, posting to the clients).

On the CPU with a small model: --model default --clients 4 --tokens 8 --rounds 1.
Measures and prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server" / "tools"))
sys.path.insert(0, str(ROOT / "bench"))

import http_load  # noqa: E402
from harness import table  # noqa: E402


class Timeline:
    """Every non-empty engine step of a round: (kind, start, end, size): prefill steps' size is
    their prompt tokens, decode steps' their rows."""

    def __init__(self, engine):
        self.steps: list[tuple[str, float, float, int]] = []
        inner = engine._step

        def step(output):
            if output.empty:
                return inner(output)
            prefill = output.prefill_alone + output.prefill_shared
            size = (sum(slot.state.next_chunk_tokens() for slot in prefill) if prefill
                    else sum(p.rows for p in output.passes))
            start = time.perf_counter()
            try:
                return inner(output)
            finally:
                self.steps.append(("prefill" if prefill else "decode", start, time.perf_counter(), size))

        engine._step = step  # this instance only: the bench's probe, not the product's


class HostProfile:
    """cProfile of the engine thread, switched on and off there between iterations (before
    Python 3.12 a profiler covers the thread that enables it; from 3.12, every thread)."""

    def __init__(self, engine):
        self.profile, self.wanted, self.on = cProfile.Profile(), False, False
        inner = engine._iterate

        def iterate():
            if self.wanted != self.on:
                (self.profile.enable if self.wanted else self.profile.disable)()
                self.on = self.wanted
            return inner()

        engine._iterate = iterate  # this instance only, as Timeline's probe

    def report(self, top: int) -> str:
        out = io.StringIO()
        pstats.Stats(self.profile, stream=out).sort_stats("tottime").print_stats(top)
        text = out.getvalue()
        return text[text.find("ncalls"):] if "ncalls" in text else text


def requests_for(loaded, clients: int, tokens: int, tag: str):
    from lockstep.server.engine.decoding.request_state import GenerationRequest
    from lockstep.server.engine.decoding.sampling import SamplingParams

    out = []
    for i in range(clients):
        messages = [{"role": "user", "content": http_load.prompt_for(i, tag=tag)}]
        prompt = list(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        out.append(GenerationRequest(prompt_tokens=prompt, max_tokens=tokens, sampling=SamplingParams(temperature=0.0)))
    return out


async def _round(engine, requests, plan) -> tuple[list[float], int]:
    """Submit every request at once; each one's first-token time and the tokens of all."""
    handles = [engine.submit(r, plan) for r in requests]

    async def consume(handle):
        first, last = None, None
        async for delta in handle:
            if first is None and delta.completion_tokens:
                first = time.perf_counter()
            last = delta
        return first, last.completion_tokens

    done = await asyncio.gather(*(consume(h) for h in handles))
    return [f for f, _ in done], sum(n for _, n in done)


def one_round(engine, timeline: Timeline, requests, plan) -> dict:
    timeline.steps.clear()
    ahead = engine.decode_ahead_counts()
    start = time.perf_counter()
    firsts, tokens = asyncio.run(_round(engine, requests, plan))
    end = time.perf_counter()
    taken = engine.decode_ahead_counts()["taken"] - ahead["taken"]
    all_first = max(f for f in firsts if f is not None)
    steps = list(timeline.steps)

    def within(lo, hi, kind):
        return [s for s in steps if s[0] == kind and lo <= s[1] < hi]

    def busy(parts):  # within the round: a step still running when it began counts from its start
        return sum(max(0.0, min(e, end) - max(s, start)) for _, s, e, _ in parts)

    pre_p, pre_d = within(start, all_first, "prefill"), within(start, all_first, "decode")
    dec = within(all_first, end, "decode")
    by_rows: dict[int, list[float]] = {}
    for _, s, e, rows in dec:
        by_rows.setdefault(rows, []).append(e - s)
    return {"wall": end - start, "tokens": tokens, "ttft": statistics.median(f - start for f in firsts),
            "prefill_phase": all_first - start, "prefill_steps": len(pre_p), "prefill_tokens": sum(x[3] for x in pre_p),
            "prefill_s": busy(pre_p), "prefill_decode_steps": len(pre_d), "prefill_decode_s": busy(pre_d),
            "decode_phase": end - all_first, "decode_steps": len(dec), "decode_s": busy(dec),
            "outside": end - start - busy(steps), "by_rows": by_rows, "taken_ahead": taken}


def _row(n: int, kind: str, got: list) -> list:
    """One table row: the medians of a kind's measured rounds at n clients."""
    med = lambda key: statistics.median(g[key] for g in got)  # noqa: E731
    step_ms = {rows: statistics.median(t for g in got for t in g["by_rows"].get(rows, [])) * 1e3
               for rows in sorted({k for g in got for k in g["by_rows"]})}
    top = max(step_ms, key=lambda k: sum(len(g["by_rows"].get(k, [])) for g in got)) if step_ms else 0
    print(f"  {n} {kind}: " + ", ".join(f"{k}: {v:.2f} ms" for k, v in step_ms.items()), flush=True)
    return [n, kind, f"{med('tokens') / med('wall'):.1f}", f"{med('wall') * 1e3:.0f}", f"{med('ttft') * 1e3:.0f}",
            f"{med('prefill_phase') * 1e3:.0f}",
            f"{med('prefill_steps'):.0f} × {med('prefill_tokens') / max(1, med('prefill_steps')):.0f} tok, "
            f"{med('prefill_s') * 1e3:.0f}",
            f"{med('prefill_decode_steps'):.0f}, {med('prefill_decode_s') * 1e3:.0f}",
            f"{med('decode_phase') * 1e3:.0f}", f"{med('decode_steps'):.0f}, {med('decode_s') * 1e3:.0f}",
            f"{top} rows: {step_ms.get(top, float('nan')):.2f}", f"{med('outside') * 1e3:.0f}",
            f"{med('taken_ahead'):.0f}"]


def wait_settled(engine, timeout: float = 900) -> None:
    """Until the audit covered every width, the guarantee settled and every other piece of
    start-up work (the batched-sampling proof, a draft) is done: each runs on the engine thread,
    serving between its own steps, so a round measured meanwhile counts its steps as time
    outside the engine's."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.audited.complete and engine.guarantee.settled and not engine.starting:
            return
        time.sleep(0.2)
    raise TimeoutError("the startup work did not finish")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--clients", default="16,32")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default="plain", help="plain, deterministic or both (comma-separated, alternating)")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more `serve` argument (repeatable)")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="the engine thread's N functions with the most own time over the measured rounds")
    parser.add_argument("--log", default=None, help="the server's INFO log to this file (its proofs say which passes "
                                                    "run compiled)")
    args = parser.parse_args()
    if args.log:
        import logging

        logging.basicConfig(level=logging.INFO, filename=args.log, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    levels = [int(c) for c in args.clients.split(",")]

    from lockstep.server.cli import build_parser
    from lockstep.server.commands.runtime_args import apply_cpu_blas
    from lockstep.server.commands.serve import build_app_from_args
    from lockstep.server.engine.guarantee.decode_plan import plan_request

    argv = ["serve", "--model", args.model, *args.serve_arg]
    serve_args = build_parser().parse_args(argv)
    apply_cpu_blas(serve_args)  # the BLAS `serve` would run on the CPU (may re-exec this process)
    _, engine = build_app_from_args(serve_args)
    wait_settled(engine)
    timeline = Timeline(engine)
    host = HostProfile(engine) if args.host_profile else None
    kinds = args.kinds.split(",")
    plans = {kind: plan_request(engine.deployment, deterministic=kind == "deterministic", speculative=None,
                                num_draft_tokens=None) for kind in kinds}
    print(f"# {' '.join(argv)}; {' and '.join(kinds)} requests, {args.tokens} tokens; "
          f"admission {engine.describe().get('max_active')} requests", flush=True)
    rows = []
    try:
        for n in levels:
            got = {kind: [] for kind in kinds}
            for r in range(args.rounds + 1):
                for kind in kinds:
                    requests = requests_for(engine.loaded, n, args.tokens, f"r{n}.{r}.{kind}")
                    if host:
                        host.wanted = r > 0  # the measured rounds
                    result = one_round(engine, timeline, requests, plans[kind])
                    if r:
                        got[kind].append(result)
            for kind in kinds:
                rows.append(_row(n, kind, got[kind]))
    finally:
        engine.stop()  # its thread, and with it the profiler's hook there, ends
    print(table(["clients", "kind", "tok/s", "wall ms", "ttft p50 ms", "until all first ms", "prefill steps (ms)",
                 "decode steps then (n, ms)", "decode phase ms", "its steps (n, ms)", "commonest step",
                 "outside steps ms", "decode passes taken ahead"], rows))
    if host:
        print(f"\n## the engine thread's host work over the measured rounds (cProfile, by own time)\n```\n"
              f"{host.report(args.host_profile)}```")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
