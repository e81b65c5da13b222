"""A restart after a start stopped mid-proof (issue 54), as launchd or Ctrl-C stops a server.

Each round, with empty
caches: a start stopped (SIGTERM, as launchd or Ctrl-C) once `/v1/models`'
`batching.deterministic_pass_rows` reaches `--interrupt-at` of the widest pass, then the measured
restart: its first /health 200, its first plain and first deterministic answers (one chat request
each, sent at /health) and the moment every width is in force (`deterministic_pass_rows` = the widest
pass). One warm round first, unmeasured, then `--restarts` rounds and their median.
`--interrupt-at 1`: the first start runs until its startup work is all done (a restart whose proofs
are all recorded).
`--baseline-src DIR`: the same rounds also for another source tree (e.g. `git archive main`),
its packages linked into a namespace on PYTHONPATH; the two alternate within each round.

    .venv/bin/python bench/startup_interrupted.py --only embedded --restarts 3 \
        --baseline-src /tmp/main --serve-arg=--batch-invariant-limit=4

Starts, caches and cases are bench/startup.py's (its docstring says what a fresh start empties).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import table as markdown_table  # noqa: E402
from startup import (CASES, DEFAULT_CASES, LOG_DIR, LOG_LEVEL, PLAIN_REQUEST, POLL_S, PlainRequest,  # noqa: E402
                     StartFailed, cache_env, case_args, check_alive, get_json, launch, log_file, poll_health,
                     seconds, stop, wait_for_health)


# ---------------------------------------------------------------- a restart after a stop mid-proof

DETERMINISTIC_REQUEST = {**PLAIN_REQUEST, "temperature": 0, "deterministic": True}
RESUMED = "were proven by an earlier start that stopped mid-proof"


@dataclass
class Resumed:
    label: str
    log: Path
    stopped_at: int | None = None      # deterministic_pass_rows seen when the first start was stopped
    kept: int | None = None            # widths the restart took from the record (its log), None: none
    health_s: float | None = None
    first_plain_s: float | None = None
    first_deterministic_s: float | None = None
    guaranteed: bool | None = None     # the deterministic answer's lockstep.guaranteed
    all_widths_s: float | None = None  # deterministic_pass_rows reached the widest pass
    widest: int | None = None
    failure: str | None = None


class DeterministicRequest(PlainRequest):
    def request(self) -> dict:
        return DETERMINISTIC_REQUEST

    def answered(self, body: dict) -> None:
        self.guaranteed = (body.get("lockstep") or {}).get("guaranteed")


def batching(base: str) -> dict | None:
    """/v1/models' batching details, or None while it does not answer."""
    try:
        card = get_json(base + "/v1/models", timeout=5)["data"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return None
    return (card.get("lockstep") or {}).get("batching")


def stop_mid_proof(serve_args: list[str], env: dict, log: Path, timeout: float, fraction: float) -> int:
    """A start stopped once deterministic passes of `fraction` of the widest pass are in force;
    returns the width it had reached. `fraction` 1 or more: stopped once its startup work is all
    done (/health's "starting" false: every proof recorded)."""
    proc, base, _, deadline = launch(serve_args, env, log, timeout)
    try:
        while True:
            check_alive(proc, deadline, "the ragged proof to reach the stopping width")
            if fraction >= 1:
                health, seen = poll_health(base), batching(base)
                if health and health.get("starting") is False and seen:
                    return seen["deterministic_pass_rows"]
                time.sleep(POLL_S)
                continue
            seen = batching(base)
            if seen and seen.get("deterministic_pass_rows", 0) >= max(1, int(fraction * seen["max_batch_rows"])):
                if seen["deterministic_pass_rows"] >= seen["max_batch_rows"]:
                    raise StartFailed("the proof finished before the stop")
                return seen["deterministic_pass_rows"]
            time.sleep(POLL_S)
    finally:
        stop(proc)


def measure_resumed(label: str, serve_args: list[str], env: dict, log: Path, timeout: float) -> Resumed:
    result = Resumed(label, log)
    proc, base, t0, deadline = launch(serve_args, env, log, timeout)
    asked = plain = None
    try:
        wait_for_health(base, proc, deadline)
        result.health_s = time.perf_counter() - t0
        asked = DeterministicRequest(base, t0, timeout=max(1.0, deadline - time.perf_counter()))
        plain = PlainRequest(base, t0, timeout=max(1.0, deadline - time.perf_counter()))
        asked.start()
        plain.start()
        while True:
            check_alive(proc, deadline, "every width in force")
            seen = batching(base)
            if seen and seen.get("deterministic_pass_rows") == seen.get("max_batch_rows"):
                result.all_widths_s, result.widest = time.perf_counter() - t0, seen["max_batch_rows"]
                break
            time.sleep(POLL_S)
        for request in (asked, plain):
            request.join(timeout=max(0.0, deadline - time.perf_counter()))
        if asked.is_alive() or plain.is_alive():
            raise StartFailed("timed out waiting for the first answers")
    except StartFailed as exc:
        result.failure = str(exc)
    finally:
        killed = stop(proc)
        if killed:
            result.failure = "; ".join(filter(None, (result.failure, killed)))
    if asked is not None and not asked.is_alive():
        result.first_deterministic_s = asked.seconds
        result.guaranteed = getattr(asked, "guaranteed", None)
        if asked.error:
            result.failure = "; ".join(filter(None, (result.failure, asked.error)))
    if plain is not None and not plain.is_alive():
        result.first_plain_s = plain.seconds
        if plain.error:
            result.failure = "; ".join(filter(None, (result.failure, plain.error)))
    try:
        for line in log.read_text(errors="replace").splitlines():
            if RESUMED in line:
                result.kept = int(line.split("passes of 1..", 1)[1].split(" ", 1)[0])
    except (OSError, ValueError, IndexError):
        pass
    return result


def source_env(env: dict, src: Path | None, work: Path, name: str) -> dict:
    """`env` running the lockstep packages of `src` (None: this tree, as installed)."""
    if src is None:
        return env
    ns = work / f"ns-{name}" / "lockstep"
    ns.mkdir(parents=True, exist_ok=True)
    for package in ("server", "kernels", "models"):
        link = ns / package
        if not link.exists():
            link.symlink_to(Path(src).resolve() / package)
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, (str(ns.parent), env.get("PYTHONPATH"))))}


def run_interrupted(name: str, serve_args: list[str], work: Path, rounds: int, timeout: float,
                    fraction: float, baseline: Path | None) -> list[Resumed]:
    """One warm round and `rounds` measured ones; each: per tree (the baseline first), a start
    stopped mid-proof then the measured restart, with caches of their own."""
    trees = ([("before ", baseline)] if baseline else []) + [("", None)]
    rows: dict[str, list[Resumed]] = {prefix: [] for prefix, _ in trees}
    for n in range(rounds + 1):
        label = "warm-up" if n == 0 else f"restart {n}"
        for prefix, src in trees:
            cache_root = work / f"cache-{name}-interrupted-{prefix.strip() or 'after'}"
            shutil.rmtree(cache_root, ignore_errors=True)
            env = source_env(cache_env(cache_root), src, work, prefix.strip() or "after")
            tag = f"{name}-{prefix.strip() or 'after'}-{label.replace(' ', '')}"
            try:
                stopped = stop_mid_proof(serve_args, env, log_file(work, f"{tag}-stopped.log"), timeout, fraction)
                result = measure_resumed(prefix + label, serve_args, env, log_file(work, f"{tag}.log"), timeout)
                result.stopped_at = stopped
            except StartFailed as exc:
                result = Resumed(prefix + label, log_file(work, f"{tag}-stopped.log"), failure=f"first start: {exc}")
            finally:
                shutil.rmtree(cache_root, ignore_errors=True)
            print(f"{name} {prefix}{label}: " + "; ".join(resumed_row(result)[1:]) + f"  (log {result.log})",
                  flush=True)
            if n:
                rows[prefix].append(result)
    out = []
    for prefix, runs in rows.items():
        out += runs
        if len(runs) > 1:
            out.append(median_resumed(runs, prefix))
    return out


def median_resumed(runs: list[Resumed], prefix: str) -> Resumed:
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    failures = [r.failure for r in runs if r.failure]
    return Resumed(f"{prefix}restart (median of {len(runs)})", runs[0].log,
                   stopped_at=med(r.stopped_at for r in runs), kept=med(r.kept for r in runs),
                   health_s=med(r.health_s for r in runs), first_plain_s=med(r.first_plain_s for r in runs),
                   first_deterministic_s=med(r.first_deterministic_s for r in runs),
                   guaranteed=all(r.guaranteed for r in runs) if all(r.guaranteed is not None for r in runs)
                   else None,
                   all_widths_s=med(r.all_widths_s for r in runs), widest=runs[0].widest,
                   failure=f"{len(failures)} of {len(runs)} failed" if failures else None)


def resumed_row(r: Resumed) -> list[str]:
    stopped = "—" if r.stopped_at is None else f"1..{r.stopped_at:g} in force"
    kept = "none" if r.kept is None else f"1..{r.kept:g}"
    if r.stopped_at is not None and r.widest is not None and r.stopped_at >= r.widest:
        stopped, kept = stopped + ", its proofs done", "every width (finished records)"
    answer = seconds(r.first_deterministic_s) + ("" if r.guaranteed is None else
                                                 " (guaranteed)" if r.guaranteed else " (not guaranteed)")
    widths = seconds(r.all_widths_s) + ("" if r.widest is None else f" (1..{r.widest})")
    health = seconds(r.health_s) + (f" [{r.failure}]" if r.failure else "")
    return [r.label, stopped, kept, health, seconds(r.first_plain_s), answer, widths]


def resumed_table(name: str, serve_args: list[str], runs: list[Resumed], baseline: Path | None) -> str:
    header = ["restart", "first start stopped at", "widths kept", "health", "first plain answer",
              "first deterministic answer", "every width in force"]
    before = f"; before: the tree at `{baseline}`" if baseline else ""
    finished = any(r.stopped_at is not None and r.widest is not None and r.stopped_at >= r.widest for r in runs)
    after = "a start that finished its proofs" if finished else "a start stopped mid-proof"
    lines = [f"### {name}, a restart after {after}", "",
             f"`lockstep serve {' '.join(serve_args)}`{before}", "",
             markdown_table(header, [resumed_row(r) for r in runs])]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--only", action="append", choices=tuple(CASES), default=None,
                        help=f"case to run (repeat for several; default {' and '.join(DEFAULT_CASES)})")
    parser.add_argument("--restarts", type=int, default=1, help="measured rounds after the warm one")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a start may take (default 600)")
    parser.add_argument("--model-dir", default=None, help="where to build/keep the nvfp4 model")
    parser.add_argument("--out", default=None, help="also write the tables (markdown) here")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `lockstep serve` argument (repeat), e.g. --serve-arg=--batch-invariant-limit=4")
    parser.add_argument("--server-log-level", default="INFO", help="lockstep's log level")
    parser.add_argument("--logs", default=None, help="write each start's server log here")
    parser.add_argument("--interrupt-at", type=float, default=0.5,
                        help="stop the first start once this share of the widest pass is in force (default "
                             "0.5; 1: once its startup work is all done, so the restart finds every proof recorded)")
    parser.add_argument("--baseline-src", default=None, help="a source tree measured beside this one (before)")
    args = parser.parse_args()
    LOG_LEVEL[1] = args.server_log_level
    if args.logs:
        LOG_DIR[0] = Path(args.logs)
        LOG_DIR[0].mkdir(parents=True, exist_ok=True)
    if args.restarts < 1:
        parser.error("--restarts must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="lockstep-startup-"))
    model_dir = Path(args.model_dir) if args.model_dir else work / "nvfp4-1040"
    print(f"logs in {LOG_DIR[0] or work}", flush=True)
    baseline = Path(args.baseline_src) if args.baseline_src else None
    tables = []
    for name in args.only or DEFAULT_CASES:
        serve_args = case_args(name, work if name.startswith("8b-") else model_dir) + args.serve_arg
        runs = run_interrupted(name, serve_args, work, args.restarts, args.timeout, args.interrupt_at, baseline)
        tables.append(resumed_table(name, serve_args, runs, baseline))
        print("\n" + tables[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
