"""Decode tok/s of one device vs tensor parallel over the ranks of an mlx.launch (issue 14).

On an 8B-shaped llama with random weights (bench/invariant_8b.py's model: no download, speed
does not depend on the values), B = 1 and B = 16 streams each after a `--context`-token
prompt, every decode step one ragged pass over the B streams' rows (kernels/batching/ragged.py, the
engine's decode path). Phase 1: rank 0 alone runs the unsharded model (the other ranks wait
at a barrier); phase 2: every rank runs its tensor-parallel shard (mlx-lm `shard()` plus
lockstep's invariant sharded layers, server/distributed/sharded_layers.py). With `--limit L`
batch invariance (strategy `--strategy`) is installed on both, unproven (timing only).
Rank 0 prints a table and the speed-ups; measures and asserts nothing.

    # 2 GPUs of one host (CUDA):
    mlx.launch --backend nccl -n 2 -- python bench/distributed.py [--weights bf16] [--out t.md]
    # check the script on a CPU (tiny shape, ring over localhost):
    mlx.launch --backend ring -n 2 -- python bench/distributed.py --tiny
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from lockstep.kernels.batching.ragged import enable_ragged, ragged_forward  # noqa: E402
from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402
from lockstep.server.distributed.sharded_layers import make_invariant  # noqa: E402

SHAPES = {  # (hidden, layers, intermediate, heads, kv heads, vocab)
    "8b": (4096, 32, 14336, 32, 8, 128256),
    "tiny": (256, 4, 512, 8, 4, 1024),
}
WEIGHTS = {"bf16": None, "affine4": ("affine", 64, 4), "nvfp4": ("nvfp4", 16, 4)}


def build(shape: str, weights: str, seed: int = 0):
    hidden, layers, inter, heads, kv, vocab = SHAPES[shape]
    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                           rms_norm_eps=1e-5, vocab_size=vocab, rope_theta=500000.0,
                           tie_word_embeddings=False)
    mx.random.seed(seed)  # the same weights on every rank: each keeps its own shard of them
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32)
    if WEIGHTS[weights]:
        mode, group, bits = WEIGHTS[weights]
        nn.quantize(model, group_size=group, bits=bits, mode=mode)
    mx.eval(model.parameters())
    return model


def prepare(model, limit: int, strategy: str):
    if limit:
        set_batch_invariant_limit(model, limit, strategy, verify=False)
    enable_ragged(model)


def decode_tok_s(model, streams: int, context: int, steps: int) -> float:
    vocab = model.args.vocab_size
    caches = []
    for s in range(streams):
        cache = make_prompt_cache(model)
        prompt = mx.random.randint(0, vocab, (1, context), key=mx.random.key(100 + s))
        mx.eval(model(prompt, cache=cache))
        caches.append(cache)
    tokens = [[1] for _ in range(streams)]

    def step():
        logits = ragged_forward(model, [(c, t) for c, t in zip(caches, tokens)])
        mx.eval(logits)

    step()  # warm-up (kernel builds)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return streams * steps / (time.perf_counter() - start)


def barrier(group) -> None:
    mx.eval(mx.distributed.all_sum(mx.ones(1), group=group))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (check the script on a CPU)")
    parser.add_argument("--weights", choices=sorted(WEIGHTS), default="bf16")
    parser.add_argument("--streams", default="1,16", help="B values (default 1,16)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--limit", type=int, default=0, help="batch-invariant L (0: native)")
    parser.add_argument("--strategy", default="strided_gemv")
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    shape = "tiny" if args.tiny else "8b"
    if args.tiny:
        args.context, args.steps = min(args.context, 32), min(args.steps, 8)
    streams = [int(b) for b in args.streams.split(",")]

    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    results = {}
    if rank == 0:  # phase 1: one device, the whole model
        model = build(shape, args.weights)
        prepare(model, args.limit, args.strategy)
        results[1] = {b: decode_tok_s(model, b, args.context, args.steps) for b in streams}
        del model
        mx.clear_cache()
    if size > 1:  # phase 2: tensor parallel over every rank
        barrier(group)
        model = build(shape, args.weights)
        model.shard(group)
        make_invariant(model, args.limit)
        mx.eval(model.parameters())
        prepare(model, args.limit, args.strategy)
        results[size] = {b: decode_tok_s(model, b, args.context, args.steps) for b in streams}
    if rank != 0:
        return
    device = str(mx.default_device())
    dense = "bfloat16" if mx.default_device() == mx.gpu else "float32"
    lines = [f"decode tok/s, {shape} llama ({args.weights}, dense {dense}), context {args.context}, "
             f"{args.steps} steps, L={args.limit or 'off'}, {device}, mlx {mx.__version__}", "",
             "| B | " + " | ".join(f"{n} device(s)" for n in results) + " | speed-up |",
             "|---|" + "---|" * (len(results) + 1)]
    for b in streams:
        row = [results[n][b] for n in results]
        ratio = row[-1] / row[0] if len(row) > 1 else 1.0
        lines.append(f"| {b} | " + " | ".join(f"{v:.1f}" for v in row) + f" | {ratio:.2f}x |")
    table = "\n".join(lines)
    print(table)
    print(json.dumps({"results": results, "shape": shape, "weights": args.weights}))
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
