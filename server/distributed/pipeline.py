"""Pipeline parallel for mlx-lm's llama, from outside its model file.

mlx-lm pipelines some architectures (mlx_lm/models/pipeline.py `PipelineMixin`, e.g. qwen2); its
llama has no `pipeline()`. `pipeline_llama` gives a loaded llama the same behaviour by a
class swap of its inner `LlamaModel` (same parameters), following mlx-lm's convention:
- the layers are split evenly, the low ranks taking any extra, in reverse: the last rank
  runs the first layers and rank 0 the last ones (and so holds the final hidden state);
- each rank but the last receives the hidden state from rank + 1, runs its layers and
  sends to rank - 1; an all_gather then hands rank 0's output to every rank, so every rank
  computes the same logits (the replicated engine samples on every rank).
Each rank keeps only its own layers (and their KV caches: `make_cache` covers them alone).
No reduction is split, so a pipelined pass adds the same numbers in the same order as one
device; the deployment still only promises bits per topology (docs/DETERMINISM.md).

Backends without point-to-point messages (MLX 0.32.4's NCCL: "Send has no CUDA
implementation") hand the hidden state on with collectives instead (`handoff="all_sum"`):
after each stage every rank adds zeros to the sender's hidden state, which passes it on
exactly (x + 0 = x; only a -0.0 becomes +0.0, the same on every run).
"""
from __future__ import annotations

import threading

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask


def layer_split(layers: int, ranks: int) -> list[int]:
    """Layers per rank (index = rank): even, the low ranks taking the extra ones."""
    if layers < ranks:
        raise ValueError(f"{layers} layers cannot be split over {ranks} pipeline ranks")
    base, extra = divmod(layers, ranks)
    return [base + (1 if r < extra else 0) for r in range(ranks)]


_classes: dict[type, type] = {}


def _pipelined_class(cls: type) -> type:
    """`cls` (an mlx-lm LlamaModel) with a pipelined forward over its own slice of layers."""
    if cls not in _classes:

        def __call__(self, inputs, cache=None, input_embeddings=None):
            group, rank, size = self.pipeline_group, self.pipeline_rank, self.pipeline_size
            h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
            if cache is None:
                cache = [None] * len(self.layers)
            # The same mask rule as the model's own call (sliding windows are refused earlier).
            mask = create_attention_mask(h, cache[0])
            if self.pipeline_handoff == "all_sum":
                return self.norm(_collective_pipeline(self, h, mask, cache))
            if rank < size - 1:
                h = mx.distributed.recv_like(h, rank + 1, group=group)
            for layer, c in zip(self.layers, cache):
                h = layer(h, mask, cache=c)
            if rank != 0:
                h = mx.distributed.send(h, rank - 1, group=group)
                if cache[-1] is not None and getattr(cache[-1], "keys", None) is not None:
                    # keep the send in the graph of what the caller evaluates
                    cache[-1].keys = mx.depends(cache[-1].keys, h)
            h = mx.distributed.all_gather(h, group=group)[: h.shape[0]]
            return self.norm(h)

        _classes[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _classes[cls]


class _Tail:
    """The last hand-off's output (a plain object: an array attribute of a Module would
    become one of its parameters)."""

    array = None
    thread = None


def _collective_pipeline(inner, h, mask, cache):
    """Stages in order (the last rank first); after each, the stage's output goes to every
    rank as an all_sum to which only the sender contributes."""
    group, rank = inner.pipeline_group, inner.pipeline_rank
    tail = inner.pipeline_tail.array
    if tail is not None and inner.pipeline_tail.thread == threading.get_ident():
        # after the previous forward's hand-offs, even when both are evaluated together (only
        # on one thread: MLX's CUDA streams are per thread, the engine's is not the loader's)
        h = mx.depends(h, tail)
    for stage in reversed(range(inner.pipeline_size)):
        if stage == rank:
            for layer, c in zip(inner.layers, cache):
                h = layer(h, mask, cache=c)
        # The zeros depend on h, so each rank runs every hand-off in order (a bare zeros_like
        # would leave the previous all_sum out of this rank's graph).
        h = mx.distributed.all_sum(h if stage == rank else mx.depends(mx.zeros_like(h), h), group=group)
    if cache and cache[-1] is not None and getattr(cache[-1], "keys", None) is not None:
        # Evaluating only the caches (a prompt chunk) still runs every hand-off, in order.
        cache[-1].keys = mx.depends(cache[-1].keys, h)
    inner.pipeline_tail.array, inner.pipeline_tail.thread = h, threading.get_ident()
    return h


def pipeline_llama(model, group, handoff: str = "sendrecv") -> tuple[int, int]:
    """Keep this rank's layers of a loaded llama and pipeline its forward over `group`
    (`handoff`: "sendrecv", or "all_sum" where the backend has no send/recv).
    Returns (first, end) layer indices this rank runs."""
    inner = model.model
    size, rank = group.size(), group.rank()
    split = layer_split(len(inner.layers), size)
    start = sum(split[rank + 1:])
    end = start + split[rank]
    inner.layers = inner.layers[start:end]  # the others' weights are dropped with them
    inner.pipeline_group = group
    inner.pipeline_rank = rank
    inner.pipeline_size = size
    inner.pipeline_handoff = handoff
    inner.pipeline_tail = _Tail()
    inner.__class__ = _pipelined_class(type(inner))
    return start, end
