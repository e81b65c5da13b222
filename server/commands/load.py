"""`lockstep bench --concurrency 1,4,16,32 [--against-mlx-lm]`: lockstep (and mlx_lm.server)
under N streaming clients, side by side in one run, on the same model directory."""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], log_path: str | None) -> subprocess.Popen:
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def _bench(name: str, base_url: str, model: str, levels: list[int], args, extra) -> list:
    """extra: one dict of request fields for every client, or a function of the client index."""
    from lockstep.server.load_bench import changed_answers, extra_for, run_round, solo_texts, summary_line

    results = []
    run_round(base_url, model, 1, 8, extra)  # warm-up: first-call compilation out of the numbers
    solo = solo_texts(base_url, model, max(levels), args.max_tokens, extra)
    for n in levels:
        r = run_round(base_url, model, n, args.max_tokens, extra)
        # With mixed clients only the deterministic ones are promised their solo answer.
        watched = ({i for i in range(n) if extra_for(extra, i).get("deterministic")}
                   if callable(extra) else None)
        changed = changed_answers(r, solo, watched) if n > 1 else None
        print(summary_line(name, r, changed, None if watched is None else len(watched)), flush=True)
        results.append(r)
    return results


def run_load(args: argparse.Namespace) -> int:
    from lockstep.models.resolve import resolve_model
    from lockstep.server.commands.runtime_args import apply_cpu_blas
    from lockstep.server.load_bench import HEADER, mixed_extra, wait_healthy

    apply_cpu_blas(args)  # as serve would: both servers below inherit the BLAS choice

    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise SystemExit("--concurrency takes positive integers, e.g. 1,4,16,32")
    model_dir = resolve_model(args.model, args.weights)
    lines = [f"lockstep bench --concurrency {args.concurrency}: model {model_dir}, {args.max_tokens} tokens "
             f"per request, greedy, streamed" + (", deterministic" if args.deterministic else "")
             + (", mixed (even clients deterministic; changed counts those)" if args.mixed else "")]
    print(lines[0])
    print(HEADER, flush=True)

    port = _free_port()
    serve = [sys.executable, "-m", "lockstep.server.cli", "serve", "--model", str(model_dir), "--port", str(port),
             "--max-active", str(max(levels)), "--max-queue", str(max(levels)), *args.serve_arg]
    if args.limit is not None and (args.deterministic or args.mixed):
        serve += ["--batch-invariant-limit", str(args.limit)]
    extra = mixed_extra if args.mixed else {"deterministic": True} if args.deterministic else {}
    rows = {}
    proc = _start(serve, (args.out + ".lockstep.log") if args.out else None)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", "/health", 600, proc)
        rows["lockstep"] = _bench("lockstep", f"http://127.0.0.1:{port}/v1", "default", levels, args, extra)
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    if args.against_mlx_lm:
        port = _free_port()
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)]
        proc = _start(cmd, (args.out + ".mlx_lm.log") if args.out else None)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", "/v1/models", 600, proc)
            rows["mlx_lm.server"] = _bench("mlx_lm.server", f"http://127.0.0.1:{port}/v1", str(model_dir),
                                           levels, args, {})
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        print("ratios lockstep / mlx_lm.server (aggregate tok/s):")
        for ours, theirs in zip(rows["lockstep"], rows["mlx_lm.server"]):
            ratio = ours.tok_per_s / theirs.tok_per_s if theirs.tok_per_s else float("nan")
            print(f"  concurrency {ours.concurrency:>3}: {ratio:.2f}x", flush=True)
    return 0
