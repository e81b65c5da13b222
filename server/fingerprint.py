"""`system_fingerprint`: names everything that can change a deterministic answer's bits.

Weights (file contents plus any load-time transformation), the kernel strategy, the
backend and MLX version, the batch-invariant limit, the prefill chunk and the CPU BLAS (and, distributed, the topology). Two servers
with the same fingerprint return the same tokens for the same deterministic request.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx

from lockstep.server.weights_digest import weights_digest


def system_fingerprint(model_dir: str | Path, *, transform: str, strategy: str, limit: int,
                       blas: str, prefill_chunk: int, topology: str | None = None,
                       kv_pool: str = "off") -> str:
    """`fp_` + 16 hex digits over every input that can change the output bits.

    topology: a distributed deployment's world size, backend and parallel mode (e.g.
    "tensor/3/ring"): its split reductions give other bits than one device. None (one
    device) leaves the fingerprint as it always was."""
    parts = {
        "weights": weights_digest(str(model_dir)),
        "transform": transform,  # e.g. load-time quantization and audit workarounds
        "strategy": strategy,
        "limit": limit,
        "backend": str(mx.default_device()),
        "mlx": mx.__version__,
        "blas": blas,
        "prefill_chunk": prefill_chunk,  # chunks wider than L change prompt KV bits
    }
    if topology is not None:
        parts["topology"] = topology
    if kv_pool != "off":  # the pooled attention form (kernels/batching/kv_pool.py) has its own bits
        parts["kv_pool"] = kv_pool
    blob = json.dumps(parts, sort_keys=True).encode()
    return "fp_" + hashlib.sha256(blob).hexdigest()[:16]
