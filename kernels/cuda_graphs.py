"""Whether MLX's CUDA backend records kernels into CUDA graphs or launches each one directly.

MLX records every ~100 ops into a CUDA graph, keys it by its node structure, and updates or
instantiates an executable graph at each commit. Launching each kernel directly skips that host
work and loses what graphs save at launch; which is faster depends on the model and the load
(
bench/results/history/2026-12-02-h200-launch-cost-cuda-graphs-issues27-28.md),
so `auto` keeps MLX's own default. MLX reads
MLX_USE_CUDA_GRAPHS once, at its first GPU command: `apply` sets it before that. The same
kernels run either way, in the same order on one stream, so a row's bits do not depend on the
choice (and the startup proofs run under it). Elsewhere than CUDA the variable is never read.
"""
from __future__ import annotations

import os

ENV = "MLX_USE_CUDA_GRAPHS"
CHOICES = ("auto", "on", "off")
DEFAULT = "auto"


def resolve(choice: str) -> str | None:
    """The value `choice` puts in ENV, or None to leave the process's own (auto: the environment's
    value, else MLX's default, graphs on)."""
    if choice not in CHOICES:
        raise ValueError(f"cuda graphs: {choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "on":
        return "1"
    if choice == "off":
        return "0"
    return None


def apply(choice: str) -> None:
    """Set ENV for `choice` (call before MLX runs anything on the GPU)."""
    value = resolve(choice)
    if value is not None:
        os.environ[ENV] = value

