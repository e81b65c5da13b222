"""Issue 53's goal figures for the prompt cache: an agent's growing conversation.

    .venv/bin/python bench/prompt_cache_turns.py [--reps 3] [--turns 10] [--new-tokens 200] [-- serve args]

(the history outgrows the CPU's default prompt cap: run with `-- --max-prompt-tokens 8192`)

A conversation of `--turns` turns, each adding ~`--new-tokens` tokens of user text to the
history (the answers, 16 tokens at temperature 0, stay in it), is sent to two `lockstep
serve` processes of the default model: one with no prompt cache (`--prefix-cache-entries 0`)
and one with both tiers (`--prompt-cache-dir` a fresh directory). Time to first token is the
time to the first streamed content chunk. Then the cache's server is restarted on the same
directory and turn `--turns + 1` is sent (the cache-less server answers it too).

Figures, per repetition (each its own conversation text; a warm-up request first on every
server): the sum of TTFT of turns 2..N with the cache ÷ without (goal <= 0.3), turn N + 1
after the restart ÷ without (goal <= 0.3), and turn 1 with ÷ without (a miss on both: the
noise floor of the pairing). Medians over `--reps`.
"""
from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import lockstep_command  # noqa: E402

WORDS = ("river mill lantern harbour tide ledger copper orchard signal engine bridge winter paper "
         "market clock garden letter station island quarry meadow candle forge barrel timber "
         "the a of and to in on with under over near beside after before because while until "
         "counts carries finds keeps mends writes opens watches follows remembers checks builds").split()
ANSWER_TOKENS = 16


def start_server(serve_args: list[str]):
    from tests.http_server import free_port, wait_for_health

    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="prompt_cache_turns_", suffix=".log")[1])
    proc = subprocess.Popen([*lockstep_command(), "serve", "--port", str(port), *serve_args],
                            stdout=log_path.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    wait_for_health(proc, base, log_path, timeout=900)
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=900)
    ttft(client, [{"role": "user", "content": "Say hello."}])  # warm-up
    return proc, client


def stop(proc) -> None:
    proc.terminate()
    proc.wait(timeout=120)


def user_text(rng: random.Random, tokens: int) -> str:
    # ~1 token a word for these words, plus punctuation
    words = [rng.choice(WORDS) for _ in range(tokens - tokens // 12)]
    return " ".join(w + ("." if i % 12 == 11 else "") for i, w in enumerate(words))


def ttft(client, messages) -> tuple[float, str, int]:
    """(seconds to the first content chunk, the answer, cached prompt tokens)."""
    start = time.perf_counter()
    first, parts, cached = None, [], 0
    stream = client.chat.completions.create(model="default", messages=messages, max_tokens=ANSWER_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return (first if first is not None else time.perf_counter() - start), "".join(parts), cached


def conversation(clients: dict, rng: random.Random, turns: int, new_tokens: int) -> dict:
    """Each client's TTFT per turn (the history grows by each turn's text and the answer, the
    answers compared between the clients)."""
    messages: list = []
    times = {name: [] for name in clients}
    for turn in range(turns):
        messages.append({"role": "user", "content": user_text(rng, new_tokens)})
        answers = set()
        for name, client in clients.items():
            seconds, answer, cached = ttft(client, messages)
            times[name].append(seconds)
            answers.add(answer)
            print(f"  turn {turn + 1} {name}: {seconds:.3f} s, cached {cached}", flush=True)
        messages.append({"role": "assistant", "content": sorted(answers)[0]})
    return times, messages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("serve", nargs="*", help="extra serve arguments (after --)")
    args = parser.parse_args()

    plain, plain_client = start_server(["--prefix-cache-entries", "0", *args.serve])
    ratios, restart_ratios, miss_ratios = [], [], []
    try:
        for rep in range(args.reps):
            cache_dir = tempfile.mkdtemp(prefix="prompt_cache_turns_dir_")
            serve_cached = ["--prompt-cache-dir", cache_dir, *args.serve]
            cached, cached_client = start_server(serve_cached)
            rng = random.Random(rep)
            print(f"rep {rep + 1}", flush=True)
            times, messages = conversation({"without": plain_client, "with": cached_client}, rng,
                                           args.turns, args.new_tokens)
            stop(cached)
            restarted, restarted_client = start_server(serve_cached)
            messages.append({"role": "user", "content": user_text(rng, args.new_tokens)})
            after, _, hit = ttft(restarted_client, messages)
            without, _, _ = ttft(plain_client, messages)
            stop(restarted)
            print(f"  turn {args.turns + 1} after a restart: {after:.3f} s (cached {hit}) vs {without:.3f} s",
                  flush=True)
            ratios.append(sum(times["with"][1:]) / sum(times["without"][1:]))
            restart_ratios.append(after / without)
            miss_ratios.append(times["with"][0] / times["without"][0])
            print(f"  turns 2..{args.turns} with ÷ without {ratios[-1]:.3f}; turn {args.turns + 1} after restart "
                  f"÷ without {restart_ratios[-1]:.3f}; turn 1 ÷ without {miss_ratios[-1]:.3f}", flush=True)
    finally:
        stop(plain)
    print(f"| figure | median of {args.reps} | runs | goal |\n|---|---|---|---|")
    print(f"| TTFT turns 2..{args.turns}, with ÷ without | {statistics.median(ratios):.3f} | "
          f"{', '.join(f'{r:.3f}' for r in ratios)} | ≤ 0.3 |")
    print(f"| TTFT turn {args.turns + 1} after a restart ÷ without | {statistics.median(restart_ratios):.3f} | "
          f"{', '.join(f'{r:.3f}' for r in restart_ratios)} | ≤ 0.3 |")
    print(f"| TTFT turn 1 (a miss on both) ÷ without | {statistics.median(miss_ratios):.3f} | "
          f"{', '.join(f'{r:.3f}' for r in miss_ratios)} | ≈ 1 |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
