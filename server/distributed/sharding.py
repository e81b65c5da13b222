"""Split a loaded model over the world: tensor parallel (mlx-lm's own `shard()`) or pipeline
parallel (server/distributed/pipeline.py), after checking that the model can be split so.

`shard_model` runs inside `build_runtime` (its `prepare_model` hook): after the load and the
quantized-kernel audit, before batch invariance is installed and self-tested, so the proof
is made on the sharded model every rank actually serves.
"""
from __future__ import annotations

import logging

from lockstep.server.distributed.world import DistributedStartupError, World

# Backends without send/recv in MLX 0.32.4 pass pipeline stages on with collectives.
PIPELINE_HANDOFF = {"nccl": "all_sum"}

log = logging.getLogger("lockstep.distributed")


def _args(model):
    args = getattr(model, "args", None)
    if args is None:
        raise DistributedStartupError("the model has no `args` (not an mlx-lm model)")
    return args


def tensor_parallel_problem(model, ranks: int) -> str | None:
    """Why `model` cannot be tensor-parallel over `ranks` (None: it can)."""
    if not hasattr(model, "shard"):
        return f"mlx-lm's {type(model).__module__} has no shard() (no tensor parallelism for it)"
    args = _args(model)
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    if heads is None:
        return "its config names no num_attention_heads"
    bad = [f"{name} {n}" for name, n in (("query heads", heads), ("KV heads", kv_heads)) if n % ranks]
    if bad:
        return (f"its {' and '.join(bad)} do not divide over {ranks} ranks (tensor parallel "
                f"splits whole heads; use a world size dividing both, or --parallel pipeline)")
    inter = getattr(args, "intermediate_size", None)
    if inter and inter % ranks:
        return f"its MLP width {inter} does not divide over {ranks} ranks"
    return None


def pipeline_problem(model, ranks: int) -> str | None:
    """Why `model` cannot be pipelined over `ranks` (None: it can)."""
    inner = getattr(model, "model", None)
    if type(model).__module__ != "mlx_lm.models.llama" or inner is None:
        return (f"pipeline parallel is implemented for llama models; this is "
                f"{type(model).__module__}")
    layers = len(inner.layers)
    if layers < ranks:
        return f"it has {layers} layers, fewer than the {ranks} pipeline ranks"
    if any(getattr(layer, "use_sliding", False) for layer in inner.layers):
        return "it has sliding-window layers (one mask rule per pipeline stage is assumed)"
    return None


def shard_model(model, world: World, invariant_rows: int) -> str:
    """Split `model` in place for `world`; returns the label the runtime adds to the model's
    transform (so proofs and the fingerprint are about the sharded model).

    invariant_rows: the batch-invariant limit L; tensor-parallel reductions of calls with
    at most L rows are summed in rank order (server/distributed/sharded_layers.py)."""
    problem = (tensor_parallel_problem if world.parallel == "tensor" else pipeline_problem)(model, world.size)
    if problem:
        raise DistributedStartupError(f"cannot run this model {world.parallel}-parallel over "
                                      f"{world.size} ranks: {problem}")
    patched = [type(m).__name__ for _, m in model.named_modules()
               if type(m).__module__.startswith("lockstep.kernels.audit.workarounds")]
    if patched:
        raise DistributedStartupError(
            f"the kernel audit replaced layers ({sorted(set(patched))}); sharding those stand-ins "
            f"is not supported: run --quantize with another mode or float weights")
    if world.parallel == "tensor":
        from lockstep.server.distributed.sharded_layers import make_invariant

        model.shard(world.group)
        swapped = make_invariant(model, invariant_rows)
        log.info("rank %d: tensor parallel, %d sharded linears (1/%d of each)", world.rank, swapped, world.size)
    else:
        from lockstep.server.distributed.pipeline import pipeline_llama

        start, end = pipeline_llama(model, world.group, handoff=PIPELINE_HANDOFF.get(world.backend, "sendrecv"))
        log.info("rank %d: pipeline stage, layers %d..%d", world.rank, start, end - 1)
    import mlx.core as mx

    mx.eval(model.parameters())  # the shards materialised now, on the loading thread
    return f"parallel={world.parallel}/{world.size}/{world.backend}"
