"""A custom kernel's smoke-test verdict, kept per machine (kernels/verdict_cache.py).

A smoke test compiles a kernel's instances and runs them against MLX (most of a fresh GPU
start's self-test:
bench/results/history/2026-12-01-h200-gemv-rows-issue9.md),
and without this a restart whose self-test proof comes from
the verdict cache would still pay that at every start. A pass is kept under a key naming the
kernel, the digest of its source files and loader, MLX, the backend and the device; a
failure is never kept, so it is tried again at the next start.
"""
from __future__ import annotations

from ..verdict_cache import VerdictCache, environment, files_version

NAMESPACE = "kernels"
_afresh = False


def prove_afresh(on: bool) -> None:
    """Run every smoke test again and overwrite its verdict (`--audit fresh`)."""
    global _afresh
    _afresh = on


def smoke_verdict(name: str, run, *sources) -> str | None:
    """run() (None: passed, else what went wrong), or a pass kept for the same kernel,
    sources and machine. Exceptions from run() pass through and are not kept."""
    key = {"kernel": name, "code": files_version(*sources), **environment()}
    cache = VerdictCache(NAMESPACE)
    if not _afresh and cache.get(key) == {"passed": True}:
        return None
    problem = run()
    if problem is None:
        cache.put(key, {"passed": True})
    return problem
