"""Issue 57's 200-request recording: `serve --record`, then `lockstep replay` against a restarted
deployment.

    .venv/bin/python bench/record_replay.py [--requests 200] [--concurrency 16] [--out DIR] \
        [-- serve args, default: --batch-invariant-limit 4 --draft-model default-quantized]

Starts `lockstep serve ARGS --record DIR`, sends `--requests` deterministic requests of mixed
kinds (plain and streamed chat, a server-drawn seed, n = 3, a forced tool call, auto tools, a
JSON schema, completions, prompt lookup, a draft model, a Predicted Output), `--concurrency`
at a time through the official `openai` client, and stops the server. Then:

1. `lockstep replay DIR/requests.jsonl --json` (no --url: it starts the recorded deployment
   itself from DIR/deployment.json): every answer must be identical;
2. a copy of the recording with one recorded token altered (request `--victim`, its first
   choice, token `--at`) replayed the same way: exactly that choice must diverge, at that token.

Prints the figures (requests, answers, outcomes, wall times) and exits 1 when either check fails.
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import lockstep_command  # noqa: E402

DEFAULT_SERVE = ["--batch-invariant-limit", "4", "--draft-model", "default-quantized"]
DET = {"deterministic": True}
TOPICS = ["a fox", "the sea", "a clock", "bread", "a storm", "a violin", "mountains", "a library"]
WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA = {"name": "fact", "schema": {"type": "object", "properties": {"topic": {"type": "string"},
                                                                      "rating": {"type": "integer"}},
                                     "required": ["topic", "rating"]}}
REPEAT = "Repeat after me: the quick brown fox jumps over the lazy dog near the river."


def kinds(client):
    """(name, job(i)) for each kind of request; job i varies its topic and seed by i."""
    chat = client.chat.completions.create

    def msg(i, what="Tell me a short story about"):
        return [{"role": "user", "content": f"{what} {TOPICS[i % len(TOPICS)]}. (#{i})"}]

    return [
        ("greedy", lambda i: chat(model="default", messages=msg(i), max_tokens=12, temperature=0, extra_body=DET)),
        ("drawn seed", lambda i: chat(model="default", messages=msg(i), max_tokens=12, temperature=0.9,
                                      extra_body=DET)),
        ("stream", lambda i: list(chat(model="default", messages=msg(i), max_tokens=12, temperature=0.7, seed=i,
                                       stream=True, extra_body=DET))),
        ("n = 3", lambda i: chat(model="default", messages=msg(i), max_tokens=8, temperature=1.0, seed=i, n=3,
                                 extra_body=DET)),
        ("forced tool", lambda i: chat(model="default", messages=msg(i, "What is the weather near"), max_tokens=24,
                                       temperature=0, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "weather"}},
                                       extra_body=DET)),
        ("auto tools, stream", lambda i: list(chat(model="default", messages=msg(i, "What is the weather near"),
                                                   max_tokens=16, temperature=0, tools=[WEATHER], stream=True,
                                                   extra_body=DET))),
        ("json_schema", lambda i: chat(model="default", messages=msg(i, "Rate"), max_tokens=24, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": SCHEMA},
                                       extra_body=DET)),
        ("completions", lambda i: client.completions.create(model="default", prompt=f"Once upon a time, {i}",
                                                            max_tokens=10, temperature=0.8, seed=i,
                                                            extra_body=DET)),
        ("prompt lookup", lambda i: chat(model="default", messages=[{"role": "user", "content": f"{REPEAT} ({i})"}],
                                         max_tokens=16, temperature=0,
                                         extra_body={**DET, "speculative": "prompt_lookup", "num_draft_tokens": 3})),
        ("draft", lambda i: chat(model="default", messages=msg(i), max_tokens=12, temperature=0,
                                 extra_body={**DET, "speculative": "draft", "num_draft_tokens": 3})),
        ("prediction, stream", lambda i: list(chat(
            model="default", messages=[{"role": "user", "content": f"{REPEAT} ({i})"}], max_tokens=16,
            temperature=0, stream=True, extra_body=DET,
            prediction={"type": "content", "content": "the quick brown fox jumps over the lazy dog near the river."}))),
    ]


def record(serve_args: list[str], directory: Path, n: int, concurrency: int) -> dict:
    from openai import OpenAI

    from tests.http_server import free_port, wait_for_health

    port = free_port()
    log_path = directory / "serve.log"
    proc = subprocess.Popen([*lockstep_command(), "serve", "--port", str(port), *serve_args,
                             "--record", str(directory)], stdout=log_path.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_health(proc, base, log_path, timeout=900)
        client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=900)
        jobs = kinds(client)
        plan = [(i, *jobs[i % len(jobs)]) for i in range(n)]
        errors, sent = [], collections.Counter()
        lock = threading.Lock()

        def worker():
            while True:
                with lock:
                    if not plan:
                        return
                    i, name, job = plan.pop(0)
                try:
                    job(i)
                    with lock:
                        sent[name] += 1
                except Exception as exc:  # noqa: BLE001 - counted and printed below
                    errors.append(f"#{i} {name}: {exc!r}")

        start = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    return {"wall_s": wall, "sent": sent, "errors": errors}


def replay(path: Path) -> tuple[list, float, int]:
    start = time.perf_counter()
    done = subprocess.run([*lockstep_command(), "replay", str(path), "--json"], cwd=ROOT,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    try:
        verdicts = json.loads(done.stdout)
    except ValueError:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        raise
    return verdicts, wall, done.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--victim", type=int, default=57, help="0-based line of the altered request")
    parser.add_argument("--at", type=int, default=3, help="the altered token's index")
    parser.add_argument("--out", help="the recording's directory (default: a fresh temporary one)")
    parser.add_argument("serve", nargs="*", help="serve arguments (after --)")
    args = parser.parse_args()
    directory = Path(args.out or tempfile.mkdtemp(prefix="record_replay_"))
    directory.mkdir(parents=True, exist_ok=True)
    recorded = record(args.serve or DEFAULT_SERVE, directory, args.requests, args.concurrency)
    path = directory / "requests.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    answers = sum(len(e["choices"]) for e in entries)
    guaranteed = sum(bool((c["receipt"] or {}).get("guaranteed")) for e in entries for c in e["choices"])
    print(f"recorded {len(entries)} of {args.requests} requests ({answers} answers, {guaranteed} guaranteed) "
          f"in {recorded['wall_s']:.1f} s at {args.concurrency} at a time; errors {len(recorded['errors'])}")
    print("kinds: " + ", ".join(f"{k} {v}" for k, v in recorded["sent"].items()))
    for line in recorded["errors"][:10]:
        print("  " + line)

    verdicts, wall, rc = replay(path)
    outcomes = collections.Counter(v["outcome"] for v in verdicts)
    print(f"\nreplay (restarted deployment, no --url): {dict(outcomes)} of {len(verdicts)} answers "
          f"in {wall:.1f} s (start included), exit {rc}")
    for v in verdicts:
        if v["outcome"] != "identical":
            print(f"  {v}")
    ok = outcomes.get("identical") == len(verdicts) == answers and rc == 0

    victim = entries[args.victim]
    tokens = victim["choices"][0]["token_ids"]
    at = min(args.at, len(tokens) - 1)
    original = tokens[at]
    tokens[at] = original + 1
    tampered = directory / "tampered.jsonl"
    tampered.write_text("".join(json.dumps(e) + "\n" for e in entries))
    # the copy lies beside deployment.json, so replay starts the same deployment for it
    verdicts, wall, rc = replay(tampered)
    outcomes = collections.Counter(v["outcome"] for v in verdicts)
    off = [v for v in verdicts if v["outcome"] != "identical"]
    print(f"\nreplay of the copy with line {args.victim + 1} choice 0 token {at} altered ({original} -> "
          f"{original + 1}): {dict(outcomes)} in {wall:.1f} s, exit {rc}")
    for v in off:
        print(f"  {v}")
    exact = (len(off) == 1 and off[0]["outcome"] == "diverged" and off[0]["line"] == args.victim + 1
             and off[0]["choice"] == 0 and off[0]["index"] == at and off[0]["recorded"] == original + 1
             and off[0]["replayed"] == original and rc == 1)
    print(f"\nall identical: {ok}; exactly the altered token diverged: {exact}")
    return 0 if ok and exact and not recorded["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
