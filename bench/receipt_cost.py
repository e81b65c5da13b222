"""What a receipt and `serve --record` cost at 32 clients (issue 57; goal: <= 1 % of throughput).

    .venv/bin/python bench/receipt_cost.py [--rounds 3] [--clients 32] [--max-tokens 16] \
        [-- serve args, default: --batch-invariant-limit 4]

Two parts:

1. Side by side over HTTP: two `lockstep serve` processes of the embedded model on loopback,
   one with `--record DIR` and one without. Each round sends `--clients` concurrent
   deterministic, greedy chat requests through the official `openai` client (one client
   object per thread, its connection kept), released at once; a round's figure is all
   completion tokens over its wall time. One unmeasured warm round per server, then rounds in
   turn with the order rotated (bench/harness.py); the cost is 1 - the paired median of
   recorded ÷ plain. The recording's line count is checked against the requests sent.
2. Receipts are computed for every answer, so they cannot be switched off for a side by side:
   their share is timed apart. `Receipt.add` per token (with and without logprobs), a
   receipt's construction and `as_dict` per request, and `Recorder.write` of a recorded line
   per request, each times the plain server's measured tokens/s or requests/s: the fraction
   of one second of serving that work takes (on the engine's thread for the receipt, on the
   event loop for the record line).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import lockstep_command, measure, median, paired_ratios, summary  # noqa: E402

DEFAULT_SERVE = ["--batch-invariant-limit", "4"]
TOPICS = ["a lighthouse", "bicycle gears", "the water cycle", "tea", "a heist", "cooking", "the sky",
          "paperclips"]


def start_server(serve_args: list[str]):
    from tests.http_server import free_port, wait_for_health

    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="receipt_cost_", suffix=".log")[1])
    proc = subprocess.Popen([*lockstep_command(), "serve", "--port", str(port), *serve_args],
                            stdout=log_path.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    wait_for_health(proc, base, log_path, timeout=900)
    return proc, base


def stop(proc) -> None:
    proc.terminate()
    proc.wait(timeout=120)


class Clients:
    """`n` openai clients of one server, each on a thread of its own, sent off together."""

    def __init__(self, base: str, n: int, max_tokens: int):
        from openai import OpenAI

        self.clients = [OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=900) for _ in range(n)]
        self.max_tokens = max_tokens
        self.requests = 0
        self.unguaranteed = 0

    def _one(self, i: int, out: list) -> None:
        r = self.clients[i].chat.completions.create(
            model="default", max_tokens=self.max_tokens, temperature=0,
            messages=[{"role": "user", "content": f"Say one sentence about {TOPICS[i % len(TOPICS)]} (#{i})."}],
            extra_body={"deterministic": True})
        out[i] = (r.usage.completion_tokens, (r.model_extra.get("lockstep") or {}).get("guaranteed"))

    def round(self) -> dict:
        out: list = [None] * len(self.clients)
        threads = [threading.Thread(target=self._one, args=(i, out)) for i in range(len(self.clients))]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        if any(o is None for o in out):
            raise RuntimeError("a request failed (its thread printed why)")
        self.requests += len(out)
        self.unguaranteed += sum(1 for _, g in out if not g)
        tokens = sum(n for n, _ in out)
        return {"tok_s": tokens / wall, "req_s": len(out) / wall, "tokens": tokens}


def side_by_side(args) -> dict:
    record_dir = Path(tempfile.mkdtemp(prefix="receipt_cost_record_"))
    plain, plain_base = start_server(args.serve)
    recorded = None
    try:
        recorded, recorded_base = start_server([*args.serve, "--record", str(record_dir)])
        sides = {"plain": Clients(plain_base, args.clients, args.max_tokens),
                 "--record": Clients(recorded_base, args.clients, args.max_tokens)}
        results = measure({name: c.round for name, c in sides.items()}, rounds=args.rounds)
    finally:
        stop(plain)
        if recorded is not None:
            stop(recorded)
    lines = (record_dir / "requests.jsonl").read_text().splitlines()
    tok_s = lambda r: r["tok_s"]  # noqa: E731
    print(summary(results, baseline="plain", unit="tok/s", value=tok_s, digits=1))
    ratio = median(paired_ratios(results, "--record", "plain", tok_s))
    print(f"\n--record ÷ plain (paired median of {args.rounds}): {ratio:.4f}; cost {100 * (1 - ratio):+.2f} %")
    print(f"recorded lines {len(lines)} of {sides['--record'].requests} requests; answers not guaranteed: "
          f"plain {sides['plain'].unguaranteed}, --record {sides['--record'].unguaranteed}")
    return {"results": results, "ratio": ratio, "lines": lines}


def fake_receipt_inputs(prompt_len: int = 32):
    sampling = SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, greedy=True, seed=None,
                               top_logprobs=None)
    request = SimpleNamespace(sampling=sampling, logit_bias={}, grammar=None, presence_penalty=0.0,
                              frequency_penalty=0.0, stop=(), max_tokens=16)
    plan = SimpleNamespace(deterministic=True, guaranteed=True)
    deployment = SimpleNamespace(model_digest="sha256:" + "0" * 64, fingerprint="fp",
                                 guarantee=SimpleNamespace(call_rows=4))
    return request, list(range(1000, 1000 + prompt_len)), plan, deployment


def receipt_work(plain_rates: dict, line: str | None) -> None:
    from lockstep.server.api.recorder import Recorder
    from lockstep.server.engine.guarantee.receipt import Receipt

    request, prompt, plan, deployment = fake_receipt_inputs()
    r = Receipt(request, prompt, plan, deployment)
    n = 200_000
    add_s = min(timeit.repeat(lambda: r.add(12345, -0.25), number=n, repeat=5)) / n
    request.sampling.top_logprobs = 0
    r_lp = Receipt(request, prompt, plan, deployment)
    add_lp_s = min(timeit.repeat(lambda: r_lp.add(12345, -0.25), number=n, repeat=5)) / n
    request.sampling.top_logprobs = None
    m = 20_000
    per_request_s = min(timeit.repeat(lambda: Receipt(request, prompt, plan, deployment).as_dict(),
                                      number=m, repeat=5)) / m
    write_s = float("nan")
    if line is not None:
        recorder = Recorder(tempfile.mkdtemp(prefix="receipt_cost_write_"))
        entry = json.loads(line)
        k = 2000
        write_s = min(timeit.repeat(lambda: recorder.write(entry), number=k, repeat=3)) / k
    tok_s, req_s = plain_rates["tok_s"], plain_rates["req_s"]
    print(f"\nper token: Receipt.add {add_s * 1e6:.2f} µs, with logprobs {add_lp_s * 1e6:.2f} µs; per request: "
          f"Receipt() + as_dict {per_request_s * 1e6:.1f} µs, Recorder.write of one line {write_s * 1e6:.1f} µs")
    print(f"at the plain server's {tok_s:.1f} tok/s and {req_s:.2f} req/s (median round):")
    print("| work | share of a second of serving |\n|---|---|")
    print(f"| receipt, per token (no logprobs) | {100 * add_s * tok_s:.4f} % |")
    print(f"| receipt, per token (logprobs) | {100 * add_lp_s * tok_s:.4f} % |")
    print(f"| receipt, per request (built, prompt digest, as_dict) | {100 * per_request_s * req_s:.4f} % |")
    print(f"| record line write (event loop) | {100 * write_s * req_s:.4f} % |")
    # Where the machine is faster than this one: the rates at which each would reach 1 %.
    print(f"1 % would be reached at {0.01 / add_lp_s:,.0f} tok/s (receipt with logprobs, per token), "
          f"{0.01 / per_request_s:,.0f} req/s (receipt per request), {0.01 / write_s:,.0f} req/s (record line)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--micro-only", action="store_true", help="only part 2, at rates given by --rates")
    parser.add_argument("--rates", default="1000,30", help="tok/s,req/s for --micro-only")
    parser.add_argument("serve", nargs="*", help="serve arguments (after --)")
    args = parser.parse_args()
    args.serve = args.serve or DEFAULT_SERVE
    if args.rounds < 3:
        parser.error("--rounds: a figure is the median of at least 3")
    if args.micro_only:
        tok_s, req_s = (float(x) for x in args.rates.split(","))
        receipt_work({"tok_s": tok_s, "req_s": req_s}, None)
        return 0
    out = side_by_side(args)
    plain = out["results"]["plain"]
    rates = {"tok_s": statistics.median(r["tok_s"] for r in plain),
             "req_s": statistics.median(r["req_s"] for r in plain)}
    receipt_work(rates, out["lines"][0] if out["lines"] else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
