"""Does every `speculative` choice pay? Issue 54's side-by-side run against a live server.

    .venv/bin/python bench/speculation_pays.py [--rounds 3] [--max-tokens N] [--out FILE] [--base URL] \
        [-- serve args, default: --batch-invariant-limit 4 --draft-model default-quantized]

Starts `lockstep serve` with the given arguments (or uses `--base`), then, per prompt
(copy-heavy: repeats a sentence of its prompt; open-ended) and per determinism (plain,
deterministic), runs every `speculative` choice (none, draft, prompt_lookup, prediction: the
client's Predicted Output) side by side: a warm round first, then `--rounds` rounds with the
choices interleaved (each round's order rotated by one), and reports the median seconds and the
speed relative to `none` (goal >= 0.97), with the drafts accepted and the note the server gave.
`--max-tokens N`: every answer N tokens long (default: each prompt's own, 21 and 32 tokens, too
short to resolve a few percent on a GPU: docs/BENCHMARKS.md, Speculation).

`--compare "SERVE ARGS"` starts a second server with those arguments and interleaves its
requests with the first one's, each choice's row followed by its row there (marked `[2]`,
its speed relative to its own `none`): e.g. `--compare "--batch-invariant-limit 4
--draft-backoff off"` for the draft back-off on and off in one run.

Then a 4-token request alone (median of `--rounds`) and sent while a ~1,300-token prompt with
`speculative: draft` is being served: how long it waits beyond its idle time (goal <= 2 s).
Each round's long prompt starts differently, so none reuses an earlier one's cached prefix
(a cold prefill every time), after one warm-up round; with `--compare`, the second server's
rounds interleaved with the first's, and each long request's own seconds (its prefill's cost)
beside. `--only-beside` runs just this part. `--long-mode deterministic` sends the long prompt with `deterministic: true` instead
(`deterministic-draft`: and `speculative: draft`): its canonical `--prefill-chunk` chunks.
"""
from __future__ import annotations

import argparse
import os
import statistics
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
SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank at dawn."
PROMPTS = {
    "copy-heavy": (f"Repeat this sentence exactly, once, and nothing else: {SENTENCE}", SENTENCE, 21),
    "open-ended": ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
                   "The lighthouse keeper walked down to the shore every morning.", 32),
}
CHOICES = ("none", "draft", "prompt_lookup", "prediction")
LONG_PARAGRAPH = ("In the old harbour town the fishermen mended their nets each evening, talking about the "
                  "weather, the price of cod and the new lighthouse keeper who had arrived in spring. ")


def start_server(serve_args: list[str]) -> tuple[subprocess.Popen, str, Path]:
    from tests.http_server import free_port, wait_for_health

    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="speculation_pays_", suffix=".log")[1])
    proc = subprocess.Popen([*lockstep_command(), "serve", "--port", str(port), *serve_args],
                            stdout=log_path.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    wait_for_health(proc, base, log_path, timeout=600)
    return proc, base, log_path


def ask(client, prompt: str, max_tokens: int, deterministic: bool, choice: str, prediction: str):
    body = {"deterministic": deterministic}
    kwargs = {}
    if choice == "prediction":
        kwargs["prediction"] = {"type": "content", "content": prediction}
    else:
        body["speculative"] = choice
    start = time.perf_counter()
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0, extra_body=body, **kwargs)
    seconds = time.perf_counter() - start
    ext = (r.model_extra or {}).get("lockstep") or {}
    return seconds, r.choices[0].message.content, ext


def side_by_side(clients: list, rounds: int, max_tokens_all: int | None = None) -> list[str]:
    """Each prompt's choices side by side; `max_tokens_all`: every answer that long instead of
    each prompt's own length (a longer answer: its passes, not its first token, dominate)."""
    lines = ["| prompt | mode | speculative | median s | × none | accepted/drafted | same answer | note |",
             "|---|---|---|---|---|---|---|---|"]
    for name, (prompt, prediction, max_tokens) in PROMPTS.items():
        max_tokens = max_tokens_all or max_tokens
        for deterministic in (False, True):
            keys = [(choice, s) for choice in CHOICES for s in range(len(clients))]
            times = {key: [] for key in keys}
            last = {}
            for r in range(rounds + 1):  # round 0 warms up
                # each round starts one choice later: no choice always follows the same one
                for choice, s in keys[r % len(keys):] + keys[:r % len(keys)]:
                    seconds, text, ext = ask(clients[s], prompt, max_tokens, deterministic, choice, prediction)
                    if r:
                        times[(choice, s)].append(seconds)
                    last[(choice, s)] = (text, ext)
            for choice, s in keys:
                base = statistics.median(times[("none", s)])
                median = statistics.median(times[(choice, s)])
                text, ext = last[(choice, s)]
                note = (ext.get("note") or "")[:70]
                label = choice + (f" [{s + 1}]" if s else "")
                lines.append(f"| {name} | {'deterministic' if deterministic else 'plain'} | {label} | "
                             f"{median:.2f} | {base / median:.2f} | {ext.get('accepted_tokens', 0)}/"
                             f"{ext.get('drafted_tokens', 0)} | {text == last[('none', 0)][0]} | {note} |")
            print("\n".join(lines[-len(keys):]), flush=True)
    return lines


LONG_MODES = {"draft": (False, "draft"), "deterministic": (True, "none"), "deterministic-draft": (True, "draft")}


def beside_long_prompt(clients: list, rounds: int, long_mode: str = "draft") -> list[str]:
    """Per server (their rounds interleaved): the 4-token request alone, and beside a cold long
    prompt, with the long request's own seconds (what its prefill costs)."""
    deterministic, choice = LONG_MODES[long_mode]
    idle = {s: [] for s in range(len(clients))}
    waits = {s: [] for s in range(len(clients))}
    longs = {s: [] for s in range(len(clients))}
    for r in range(rounds + 1):  # round 0 warms up
        for s, client in enumerate(clients):
            alone = ask(client, "Say hi.", 4, False, "none", "")[0]
            started = threading.Event()
            # distinct per round and server: no cached prefix (in memory or on disk) serves it
            long_prompt = f"Chronicle {r + 1}.{s} of {rounds + 1}. " + LONG_PARAGRAPH * 40
            long_seconds = []

            def long_request():
                started.set()
                long_seconds.append(ask(client, long_prompt + "\nSummarise this in one line.", 8,
                                        deterministic, choice, "")[0])

            worker = threading.Thread(target=long_request)
            worker.start()
            started.wait()
            time.sleep(0.5)  # the long prompt is admitted and prefilling
            wait = ask(client, "Say hi.", 4, False, "none", "")[0]
            worker.join()
            if r:
                idle[s].append(alone)
                waits[s].append(wait)
                longs[s].extend(long_seconds)
    lines = ["", f"4-token request alone and beside a ~1,300-token {'deterministic' if deterministic else 'plain'} "
             f"prompt (speculative {choice}, cold), median of {rounds} after a warm round",
             "| server | alone s | beside s | waited s | rounds beside | long request s |", "|---|---|---|---|---|---|"]
    for s in range(len(clients)):
        alone, beside = statistics.median(idle[s]), statistics.median(waits[s])
        lines.append(f"| {'[1]' if s == 0 else f'[{s + 1}]'} | {alone:.2f} | {beside:.2f} | +{beside - alone:.2f} | "
                     f"{', '.join(f'{w:.2f}' for w in waits[s])} | {statistics.median(longs[s]):.2f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--base", help="a running server's URL (then no server is started)")
    parser.add_argument("--compare", help="a second server's serve arguments, its requests interleaved")
    parser.add_argument("--skip-beside", action="store_true", help="leave out the 4-token request beside a long one")
    parser.add_argument("--only-beside", action="store_true", help="only the 4-token request beside a long one")
    parser.add_argument("--long-mode", choices=sorted(LONG_MODES), default="draft",
                        help="the long prompt's request: plain drafted (default) or deterministic")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="every answer this long (default: each prompt's own, 21 and 32 tokens)")
    parser.add_argument("serve_args", nargs="*", default=DEFAULT_SERVE)
    args = parser.parse_args()
    from openai import OpenAI

    proc = compare_proc = None
    if args.base:
        base = args.base
    else:
        proc, base, log_path = start_server(args.serve_args or DEFAULT_SERVE)
    try:
        clients = []
        if args.compare:
            compare_proc, compare_base, _ = start_server(args.compare.split())
            clients.append(OpenAI(base_url=compare_base + "/v1", max_retries=0, timeout=600,
                                  api_key=os.environ.get("LOCKSTEP_API_KEY", "unused")))
        client = OpenAI(base_url=base + "/v1", api_key=os.environ.get("LOCKSTEP_API_KEY", "unused"),
                        max_retries=0, timeout=600)
        models = client.models.list().data[0].model_extra["lockstep"]
        header = [f"lockstep serve {' '.join(args.serve_args or DEFAULT_SERVE)}; draft model "
                  f"{models.get('draft_model')} ({models.get('draft_model_state', 'drafted from')}); "
                  f"median of {args.rounds} after a warm round"
                  + (f"; {args.max_tokens} tokens an answer" if args.max_tokens else "")]
        if args.compare:
            header.append(f"[2]: lockstep serve {args.compare}, its requests interleaved with these")
        header.append("")
        print("\n".join(header), flush=True)
        lines = header + ([] if args.only_beside else side_by_side([client, *clients], args.rounds,
                                                                           args.max_tokens))
        if not args.skip_beside:
            lines += beside_long_prompt([client, *clients], args.rounds, args.long_mode)
    finally:
        for p in (proc, compare_proc):
            if p is not None:
                p.terminate()
                p.wait(timeout=60)
    print("\n".join(lines[-6:]))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
