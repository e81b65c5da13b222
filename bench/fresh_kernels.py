"""Which MLX kernels a fresh `lockstep serve` compiles, and when: one start on empty caches (the
verdicts, MLX's kernel cache, the CUDA driver's), a plain chat request at its first /health,
then the kernel cache's modules listed by the second they appeared, beside the server log's
lines on the same clock (seconds from the spawn).

    python bench/fresh_kernels.py [--serve-arg=--batch-invariant-limit=8 ...] [--until answer]
                                  [--out FILE] [--log FILE]

On the lent GPU (bench/README.md, "On the lent H200") pass `--serve-arg=--cpu-blas=reference`.
On CUDA MLX compiles a kernel module at its first use (NVRTC, then the driver); on the CPU and
Metal it compiles none, and the list is empty. Measures and prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import datetime
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from startup import PlainRequest, cache_env, launch, stop, wait_for_guarantee, wait_for_health  # noqa: E402

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def modules_by_time(cache: Path, spawned: float) -> list[tuple[float, int, str]]:
    """(seconds from the spawn, bytes, name) of each compiled module (its `.ptx`) in `cache`."""
    rows = [(p.stat().st_mtime - spawned, p.stat().st_size, str(p.relative_to(cache))) for p in cache.rglob("*.ptx")]
    return sorted(rows)


def log_by_time(log: Path, spawned: float) -> list[tuple[float, str]]:
    """The server log's timestamped lines, each at its seconds from the spawn."""
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        match = LOG_TIME.match(line)
        if match:
            at = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S").timestamp() + int(match[2]) / 1000
            rows.append((at - spawned, line[match.end():]))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `lockstep serve` argument (repeat)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for /health, the answer and the guarantee")
    parser.add_argument("--out", help="also write the timeline here")
    parser.add_argument("--log", help="keep the server log here (default: a temporary file)")
    parser.add_argument("--until", choices=("guarantee", "answer"), default="guarantee",
                        help="stop the server once the guarantee is settled (default) or at the first answer")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fresh-kernels-"))
    env = cache_env(work / "caches")
    log = Path(args.log) if args.log else work / "serve.log"
    spawned = time.time()
    proc, base, t0, deadline = launch(args.serve_arg, env, log, args.timeout)
    try:
        health = wait_for_health(base, proc, deadline)
        health_s = time.perf_counter() - t0
        request = PlainRequest(base, t0, args.timeout)
        request.start()
        request.join(args.timeout)
        settled_s = None
        if args.until == "guarantee":
            wait_for_guarantee(base, proc, deadline, health)
            settled_s = time.perf_counter() - t0
    finally:
        stop(proc)
    events = [(t, f"kernel {name} ({size / 1e6:.2f} MB)") for t, size, name in
              modules_by_time(Path(env["MLX_PTX_CACHE_DIR"]), spawned)]
    events += [(t, f"log   {text[:160]}") for t, text in log_by_time(log, spawned)]
    lines = [f"/health {health_s:.1f} s, first plain answer "
             + (f"{request.seconds:.1f} s" if request.seconds else f"none ({request.error})")
             + (f", guarantee settled {settled_s:.1f} s" if settled_s else "") + f"; {sum(e.startswith('kernel') for _, e in events)} kernel modules",
             *(f"{t:7.2f}  {text}" for t, text in sorted(events))]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
