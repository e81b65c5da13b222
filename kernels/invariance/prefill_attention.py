"""Causal attention of a long prompt chunk on the CPU, in blocks of query rows.

MLX's CPU attention builds, masks and exponentiates the whole (rows x keys) score matrix,
with scalar math on x86; for a causal prompt chunk the masked upper triangle is half of that
work (a layer's attention of 500 rows whole and in blocks:
bench/results/history/2026-11-30-cpu-default-prefill-blocks-issue10.md).
Each block of BLOCK query rows here attends only the keys up to its last row, through
the model's own attention call with its causal mask, and the blocks are concatenated.

The blocks are cut by the chunk's own length, counted from its first row, so a chunk's
output (and the prompt KV written after it) is a function of the chunk alone; chunks are
aligned to absolute positions (kernels/invariance/prefill.py), so prefix-cache hits and misses still
compute the same bits. GPUs keep MLX's fused attention.
"""
from __future__ import annotations

import os

import mlx.core as mx

# Query rows per block; LOCKSTEP_PREFILL_ATTENTION_BLOCK=0 attends whole chunks (benchmarks).
BLOCK = int(os.environ.get("LOCKSTEP_PREFILL_ATTENTION_BLOCK", "32"))


def wants_blocks(queries: mx.array, keys: mx.array, mask) -> bool:
    """A causal chunk of more than one block, on the CPU."""
    return (BLOCK > 0 and isinstance(mask, str) and mask == "causal" and queries.shape[2] > BLOCK
            and keys.shape[2] >= queries.shape[2] and mx.default_device() == mx.cpu)


def blocked_causal(sdpa, queries: mx.array, keys: mx.array, values: mx.array, **kwargs) -> mx.array:
    """sdpa(queries, keys, values, mask="causal") with queries (B, H, T, D) the last T
    positions of keys/values (B, Hkv, S, D), one call per block of BLOCK query rows."""
    rows, first = queries.shape[2], keys.shape[2] - queries.shape[2]
    outs = []
    for start in range(0, rows, BLOCK):
        end = min(rows, start + BLOCK)
        outs.append(sdpa(queries[:, :, start:end], keys[:, :, :first + end], values[:, :, :first + end],
                         mask="causal", **kwargs))
    return mx.concatenate(outs, axis=2)
