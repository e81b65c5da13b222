"""Cold prompts, plain and deterministic, over HTTP: the time to a one-token answer of a prompt
no earlier request shares, by prompt length. Deterministic prompts prefill on the grid where
the split proof failed (kernels/invariance/prefill.py: 16, 16, 32, ... ahead of whole chunks),
in whole chunks where it passed; this says what the grid costs a cold prompt on a backend.

    python bench/cold_prompts.py --url http://127.0.0.1:8000/v1 [--lengths 100,400,900] [--rounds 4]

Against a running server with L > 0 (`lockstep serve --batch-invariant-limit 8`). Each round
sends one prompt of each length plain, then deterministic, each its own words; the first
round warms and is not counted. Prints the median seconds each way and the median of the
paired ratios (deterministic ÷ plain). Measures and prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from openai import OpenAI

WORDS = ("alpha beta gamma delta river stone cloud paper orange window silver garden market "
         "yellow pencil engine harbor meadow candle violet thunder marble").split()


def prompt(words: int, seed: int) -> str:
    pick = random.Random(seed)
    return " ".join(pick.choice(WORDS) for _ in range(words))


def seconds(client: OpenAI, model: str, text: str, deterministic: bool) -> float:
    start = time.perf_counter()
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], max_tokens=1,
                                   temperature=0, extra_body={"deterministic": deterministic})
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="default")
    parser.add_argument("--lengths", default="100,400,900", help="prompt lengths in words")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, the first unmeasured")
    args = parser.parse_args()
    client = OpenAI(base_url=args.url, api_key="none", timeout=600)
    seed = random.randrange(1 << 30)  # prompts no earlier run of this script sent either
    print(f"{'words':>6} {'plain s':>8} {'det s':>8}  det ÷ plain (paired median)")
    for words in (int(w) for w in args.lengths.split(",")):
        plain, det = [], []
        for round_ in range(args.rounds):
            a = seconds(client, args.model, prompt(words, seed + 2 * round_ + 7919 * words), False)
            b = seconds(client, args.model, prompt(words, seed + 2 * round_ + 1 + 7919 * words), True)
            if round_:
                plain.append(a)
                det.append(b)
        ratios = [b / a for a, b in zip(plain, det)]
        print(f"{words:>6} {statistics.median(plain):8.3f} {statistics.median(det):8.3f}  "
              f"{statistics.median(ratios):.2f} ({' '.join(f'{r:.2f}' for r in ratios)})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
