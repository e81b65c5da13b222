"""Plain serving on the CPU with the shim's column blocks from LOCKSTEP_BLAS_LARGE_ROWS rows,
at two (or more) values side by side: one `lockstep serve` per value, alike but for that
variable, the rounds alternating between them (server/tools/http_load.py's loop: a warm-up
round each, then rounds taken in turn, each round with prompts of its own).

    .venv/bin/python bench/blas_blocks.py --values 64,2 --concurrency 1,8 [--model DIR]

Calls of at least that many rows with split_gemm.c's work floor of multiply-adds run in fixed
column blocks on the idle cores (kernels/cpu_blas.py LARGE_ROWS); fewer rows run on one
OpenBLAS thread. Prints each server's median round and the paired ratios to the first value.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lockstep.kernels import cpu_blas  # noqa: E402
from lockstep.server.tools import http_load  # noqa: E402
from lockstep.server.tools.replay_server import free_port  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", default="64,2", help="LOCKSTEP_BLAS_LARGE_ROWS values, the first the baseline")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model, float32)")
    args = parser.parse_args()
    if args.model is None:
        from lockstep.models.resolve import resolve_model

        args.model = str(resolve_model("default", "float32"))
    values = args.values.split(",")
    logs = Path(tempfile.mkdtemp(prefix="blas-blocks-"))
    procs, servers = [], []
    for i, value in enumerate(values):
        env = cpu_blas.preload_env({**os.environ, "LOCKSTEP_BLAS_LARGE_ROWS": value})
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "lockstep.server.cli", "serve", "--model", args.model,
                                       "--port", str(port), "--max-active", "16"], env=env,
                                      stdout=open(logs / f"serve_{value}.log", "w"), stderr=subprocess.STDOUT))
        servers.append((f"http://127.0.0.1:{port}", "default", {}))
    try:
        for (url, _, _), proc in zip(servers, procs):
            http_load.wait_healthy(url, "/health", 600, proc)
        servers = [(url + "/v1", model, extra) for url, model, extra in servers]
        print(f"LOCKSTEP_BLAS_LARGE_ROWS {args.values}, {args.max_tokens} tokens a request, model {args.model}")
        print(http_load.HEADER)
        for n in (int(c) for c in args.concurrency.split(",")):
            out = http_load.interleaved_rounds(servers, n, args.max_tokens, args.rounds)
            for value, (median, rounds) in zip(values, out):
                print(http_load.summary_line(f"rows>={value}", median)
                      + f"   (rounds {', '.join(f'{r.tok_per_s:.1f}' for r in rounds)})", flush=True)
            for value, (_, rounds) in zip(values[1:], out[1:]):
                pairs = [b.tok_per_s / a.tok_per_s for a, b in zip(out[0][1], rounds)]
                print(f"  {n} clients, rows>={value} / rows>={values[0]}: paired "
                      f"{' '.join(f'{p:.2f}' for p in pairs)}, median {statistics.median(pairs):.2f}", flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait()


if __name__ == "__main__":
    main()
