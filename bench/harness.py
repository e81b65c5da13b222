"""The measuring loop the bench scripts share: variants side by side in one process.

    from harness import measure, timed, summary

    results = measure({"separate": timed(step_a), "fused": timed(step_b)}, rounds=7)
    print(summary(results, baseline="separate", unit="ms", scale=1e3))

Why this shape: the machines drift (the lent H200 up to 2x within one call, the shared CPU by
10 % or more between rounds), so two configurations are only compared when they ran in the
same rounds. Every variant runs once unmeasured first (compiles, caches, allocator), then
each round runs every variant once, the order rotated by one a round so that none always
runs first or after the same neighbour. Figures are medians over rounds, and a ratio is the
median of the rounds' own ratios (round i of a variant over round i of the baseline), which
cancels what drifts between rounds.

A variant is a callable that returns its measurement (a number, or a tuple / dict of them:
`value=` picks one). `drive` is the in-process load the engine benches measure: N requests
submitted to an engine at once, every answer read to its end. Nothing here imports MLX or
lockstep (a script measuring another source tree's engine can import it).
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]


def lockstep_command() -> list[str]:
    """The `lockstep` command: the project's venv's script here; elsewhere (the lent GPU, the
    packages staged on PYTHONPATH) this python's module."""
    script = ROOT / ".venv/bin/lockstep"
    return [str(script)] if script.exists() else [sys.executable, "-m", "lockstep.server.cli"]


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    """`fn` as a variant whose measurement is its wall time in seconds."""
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return run


def rotation(names: list, round_index: int) -> list:
    """The order of round `round_index`: `names` rotated left by the round's index."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def measure(variants: dict, rounds: int, warmup: int = 1) -> dict:
    """{name: [measurement of round 0, 1, ...]} after `warmup` unmeasured rounds."""
    if rounds < 1 or not variants:
        raise ValueError("measure needs at least one variant and one round")
    names = list(variants)
    for r in range(warmup):
        for name in rotation(names, r):
            variants[name]()
    results = {name: [] for name in names}
    for r in range(rounds):
        for name in rotation(names, r):
            results[name].append(variants[name]())
    return results


def _identity(x):
    return x


def median(values: Iterable, value: Callable = _identity) -> float:
    return statistics.median(value(v) for v in values)


def paired_ratios(results: dict, name: str, baseline: str, value: Callable = _identity) -> list:
    """Round i of `name` over round i of `baseline`, for every round."""
    return [value(a) / value(b) for a, b in zip(results[name], results[baseline])]


def table(headers: list, rows: list) -> str:
    """A markdown table; cells are written as given (format numbers before)."""
    lines = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def summary(results: dict, baseline: str, unit: str = "s", scale: float = 1.0,
            value: Callable = _identity, digits: int = 2) -> str:
    """Each variant's median (times `scale`, in `unit`), its rounds, and its paired-median
    ratio to `baseline`, as a markdown table."""
    rows = []
    for name, got in results.items():
        ratios = paired_ratios(results, name, baseline, value)
        rows.append([name, f"{median(got, value) * scale:.{digits}f}",
                     " ".join(f"{value(v) * scale:.{digits}f}" for v in got),
                     f"{median(ratios):.3f}"])
    return table(["variant", f"median {unit}", f"rounds {unit}", f"÷ {baseline} (paired median)"], rows)


async def drive(engine, requests: list, plans: list) -> int:
    """Submit every request (with its plan) to `engine` before reading any answer, so they
    decode together, then read every answer to its end; the completion tokens of all."""
    handles = [engine.submit(request, plan) for request, plan in zip(requests, plans)]

    async def consume(handle) -> int:
        last = None
        async for delta in handle:
            last = delta
        return last.completion_tokens

    return sum(await asyncio.gather(*(consume(handle) for handle in handles)))
