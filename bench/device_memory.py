"""Where a GPU deployment's device memory goes, and whether its admission fits the card (issue 50).

    python3 bench/device_memory.py [--clients 64] [--max-tokens 256] [--prompt-words 400] \
        -- serve args (e.g. --model DIR --batch-invariant-limit 8)

Starts one `lockstep serve` on loopback with the given arguments (admission sized by the
server unless they say otherwise), samples the card's used memory with `nvidia-smi` (all
allocations: MLX's pool and cache, CUDA graphs, cuBLAS workspaces, the context) while it
starts, runs its start-up work, and serves `--clients` concurrent requests with long prompts
and answers, twice. Prints the server's admission and its "device memory" log lines, the
card's peak used memory in each phase, and how many requests failed. A deployment whose
admission does not fit the card fails requests here (or its start-up work does).
"""
from __future__ import annotations

import argparse
import shutil
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

WORDS = ("harbor lantern copper meadow thunder violet canyon pebble orchard falcon ember glacier "
         "quartz willow saddle ribbon compass marble").split()


class CardSampler:
    """The card's used memory (MiB), sampled every `interval` s; `mark(phase)` starts a phase."""

    def __init__(self, interval: float = 0.25):
        self.interval = interval
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self.order: list[str] = []
        self._stop = threading.Event()
        self.available = shutil.which("nvidia-smi") is not None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def mark(self, phase: str) -> None:
        self.phase = phase

    def _used(self) -> int | None:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout.split(",")
        self.total = int(out[1]) if len(out) > 1 else None
        return int(out[0]) if out and out[0].strip().isdigit() else None

    def _run(self) -> None:
        while not self._stop.is_set():
            used = self._used()
            if used is not None:
                if self.phase not in self.peaks:
                    self.order.append(self.phase)
                self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), used)
            self._stop.wait(self.interval)

    def __enter__(self):
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.available:
            self._thread.join()


def run_clients(base: str, clients: int, max_tokens: int, prompt_words: int, round_index: int) -> dict:
    from openai import OpenAI

    results: list = [None] * clients

    def one(i: int) -> None:
        client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=1800)
        words = " ".join(WORDS[(i * 7 + j + round_index) % len(WORDS)] for j in range(prompt_words))
        try:
            r = client.chat.completions.create(
                model="default", max_tokens=max_tokens, temperature=0,
                messages=[{"role": "user", "content": f"Request {i}: continue this list. {words}"}],
                extra_body={"deterministic": i % 2 == 0})
            results[i] = ("ok", r.usage.completion_tokens)
        except Exception as exc:  # noqa: BLE001 - a failed request is the measurement
            results[i] = ("failed", f"{type(exc).__name__}: {str(exc)[:160]}")

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    failed = [r[1] for r in results if r[0] != "ok"]
    tokens = sum(r[1] for r in results if r[0] == "ok")
    return {"wall": wall, "tokens": tokens, "failed": failed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-words", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--log", default=None, help="keep the server's log here")
    parser.add_argument("serve", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    serve = [a for a in args.serve if a != "--"]

    from tests.http_server import free_port, wait_for_health

    port = free_port()
    log_path = Path(args.log or tempfile.mkstemp(prefix="device_memory_", suffix=".log")[1])
    base = f"http://127.0.0.1:{port}"
    rows, ok = [], True
    with CardSampler() as card:
        proc = subprocess.Popen([*lockstep_command(), "serve", "--port", str(port), *serve],
                                stdout=log_path.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            card.mark("load and start-up work")
            wait_for_health(proc, base, log_path, timeout=1200)
            card.mark("idle after start-up")
            time.sleep(1.0)
            for r in range(args.rounds):
                card.mark(f"round {r + 1}: {args.clients} clients")
                result = run_clients(base, args.clients, args.max_tokens, args.prompt_words, r)
                ok = ok and not result["failed"]
                rows.append((r + 1, result))
            card.mark("after")
            time.sleep(1.0)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
    log = log_path.read_text(errors="replace").splitlines()
    print("server:", " ".join(serve))
    for line in log:
        if "admission:" in line or "device memory" in line or "ERROR" in line or "out of memory" in line:
            print("  log:", line[:300])
    print(f"\ncard: {getattr(card, 'total', None)} MiB" if card.available else "\ncard: no nvidia-smi")
    print("| phase | card peak used (MiB) |\n|---|---|")
    for phase in card.order:
        print(f"| {phase} | {card.peaks[phase]:,} |")
    print("\n| round | tok/s | tokens | failed |\n|---|---|---|---|")
    for r, result in rows:
        print(f"| {r} | {result['tokens'] / result['wall']:,.0f} | {result['tokens']:,} | {len(result['failed'])} |")
        for f in result["failed"][:3]:
            print("   ", f)
    print(f"\nlog: {log_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
