"""The engine thread's per-row parts of a decode pass, each against the way it was done before,
side by side in one process (bench/harness.py: a warm-up round, rotated rounds, medians, paired
ratios). Host time only: a tiny vocab-wide logits array, evaluated before the clock starts.

  sampling   a pass's seeded rows: each request's own sampling graph (as before), against one
             batch over the pass (decode_ahead.presample_pass), both evaluated and read back
  greedy     a pass's greedy rows as run_pass hands them on: slices a row (the presample
             listcomp's and the Step's row, as before), against none
  detok      one stream's tokens through the incremental decoder: two decodes a token (the
             window moved on after every token, as before), against one (a window of IncrementalDecoder.WINDOW)

    python bench/pass_host_parts.py [--rows 16,32] [--rounds 7] [--vocab 49152]

Measures and prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from harness import measure, summary  # noqa: E402
from lockstep.server.engine.decoding.sampling import SamplingParams, sample_pending  # noqa: E402
from lockstep.server.engine.decoding.stops import IncrementalDecoder  # noqa: E402
from lockstep.server.engine.decoding.token_steps import PlainSource, SpeculationStats  # noqa: E402
from lockstep.server.engine.runner.decode_ahead import presample_pass  # noqa: E402

PASSES = 20  # passes a round


def member(params: SamplingParams, context: int) -> PlainSource:
    """A pass member as the runner reads one: a PlainSource has the sampling hooks."""
    return PlainSource([], list(range(context)), params, SpeculationStats())


def timed(fn):
    def run():
        start = time.perf_counter()
        for _ in range(PASSES):
            fn()
        return (time.perf_counter() - start) / PASSES
    return run


def sampling_variants(rows: int, vocab: int) -> dict:
    logits = mx.random.normal((rows, vocab), key=mx.random.key(0)) * 3
    mx.eval(logits)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    members = [(member(replace(params, seed=i), 100 + i), [0]) for i in range(rows)]
    spans = [(i, i + 1) for i in range(rows)]

    def per_request():
        pending = [state.presample(logits[b:e]) for (state, _), (b, e) in zip(members, spans)]
        mx.eval([x for p in pending for x in p.arrays])
        return [p.result()[0].token for p in pending]

    def batched():
        pending = presample_pass(members, logits, spans)
        mx.eval([x for p in pending for x in p.arrays])
        return [p.result()[0].token for p in pending]

    assert per_request() == batched()  # the same tokens, or the comparison means nothing
    return {"per request": timed(per_request), "one batch": timed(batched)}


def greedy_variants(rows: int, vocab: int) -> dict:
    logits = mx.random.normal((rows, vocab), key=mx.random.key(0))
    mx.eval(logits)
    members = [(member(SamplingParams(temperature=0.0), 10), [0]) for _ in range(rows)]
    spans = [(i, i + 1) for i in range(rows)]
    argmax = list(range(rows))

    def sliced():  # before: the presample listcomp sliced every row, then run_pass and Step
        [state.presample(logits[b:e]) for (state, _), (b, e) in zip(members, spans)]
        steps = [state.verify(logits[b:e], [], argmax[b:e]) for (state, _), (b, e) in zip(members, spans)]
        return [step[0].logits for step in steps]  # the row the Step sliced when made

    def unsliced():
        presample_pass(members, logits, spans)
        return [state.verify(logits[b:e], [], argmax[b:e]) for (state, _), (b, e) in zip(members, spans)]

    return {"slices a row": timed(sliced), "none": timed(unsliced)}


def detok_variants(tokenizer, prompt: list[int], tokens: list[int], streams: int) -> dict:
    def stream(window: int):
        def run():
            saved = IncrementalDecoder.WINDOW
            IncrementalDecoder.WINDOW = window
            try:
                for _ in range(streams):
                    decoder = IncrementalDecoder(tokenizer, prompt)
                    text = "".join(decoder.add(t) for t in tokens) + decoder.finish()
            finally:
                IncrementalDecoder.WINDOW = saved
            return text
        return run

    assert stream(1)() == stream(IncrementalDecoder.WINDOW)()
    return {"two decodes a token": timed(stream(1)), "one decode a token": timed(stream(IncrementalDecoder.WINDOW))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=384, help="logits' width (small: the device's share then stays small)")
    args = parser.parse_args()
    from lockstep.models.load import load_model

    tokenizer = load_model("default", "float32").tokenizer
    prompt = tokenizer.encode("The sky is")
    tokens = tokenizer.encode(" blue, and the quick brown fox jumps over the lazy dog again. " * 6,
                              add_special_tokens=False)[:64]
    print(f"pass_host_parts: vocab {args.vocab}, {args.rounds} rounds after one warm-up, "
          f"{PASSES} passes a round; µs of host time a pass (detok: 64 tokens of each of `rows` streams)")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, variants in (("sampling (seeded rows, t 0.8, top_p 0.95)", sampling_variants(rows, args.vocab)),
                               ("greedy rows", greedy_variants(rows, args.vocab)),
                               ("detok", detok_variants(tokenizer, prompt, tokens, rows))):
            results = measure(variants, rounds=args.rounds)
            baseline = next(iter(variants))
            print(f"\n{name}, {rows} rows:\n" + summary(results, baseline=baseline, unit="µs", scale=1e6, digits=0))


if __name__ == "__main__":
    main()
