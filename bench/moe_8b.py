"""MoE deterministic decode at a real expert layout (issue 30): Qwen3-30B-A3B's experts (hidden
2048, 128 experts of 768, top-8, 32/4 heads of 128, vocabulary 151936) with fewer layers,
random weights, bf16 and nvfp4, on mlx-lm's own qwen3_moe classes.

For each B in --rows and each weights format: the native step time; the step with the
canonical forms installed for L = max(rows) (the experts run each token row as its own call,
kernels/invariance/layers.py); their ratio; and how many of the B rows of the canonical step
equal, bitwise, the same token fed alone (the negative control: how many native rows do).

    python bench/moe_8b.py --layers 4 --rows 1,8,16 --weights bf16,nvfp4
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models import qwen3_moe  # noqa: E402

from invariant_8b import context, rows_identical, step_ms, weight_bytes  # noqa: E402
from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402

QUANT = {"bf16": None, "float32": None, "nvfp4": ("nvfp4", 16, 4), "affine4": ("affine", 64, 4)}


def build(weights: str, layers: int, seed: int = 0):
    args = qwen3_moe.ModelArgs.from_dict({
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": layers, "intermediate_size": 6144,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768,
        "rms_norm_eps": 1e-6, "vocab_size": 151936, "rope_theta": 1e6, "tie_word_embeddings": False,
        "max_position_embeddings": 40960, "norm_topk_prob": True})
    mx.random.seed(seed)
    model = qwen3_moe.Model(args)
    if weights != "float32":  # (float32: MLX's CPU gather_mm takes no other type)
        model.set_dtype(mx.bfloat16)
    if QUANT[weights]:
        mode, group, bits = QUANT[weights]
        nn.quantize(model, group_size=group, bits=bits, mode=mode)
    mx.eval(model.parameters())
    return model


def run(model, rows: list[int], limit: int, repeats: int, log) -> list[tuple]:
    table = []
    for b in rows:
        cache = context(model, 512)
        tokens = mx.random.randint(0, model.args.vocab_size, (b,), key=mx.random.key(100 + b)).tolist()
        step = lambda t: model(mx.array([t]), cache=cache)[0]  # noqa: E731
        set_batch_invariant_limit(model, 0)
        native = step_ms(step, cache, tokens, repeats)
        native_same = rows_identical(step, cache, tokens) if b > 1 else 1
        invariance = set_batch_invariant_limit(model, limit, "auto")
        canonical = step_ms(step, cache, tokens, repeats)
        same = rows_identical(step, cache, tokens) if b > 1 else 1
        set_batch_invariant_limit(model, 0)
        table.append((b, native, canonical, same, native_same, invariance.strategy, invariance.guaranteed))
        log(f"B={b:<3} native {native:8.2f} ms  deterministic ({invariance.strategy}, proven {invariance.guaranteed}) "
            f"{canonical:8.2f} ms = {canonical / native:5.2f}x  rows == single-row call: {same}/{b} "
            f"(native: {native_same}/{b})")
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--weights", default="bf16,nvfp4")
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(f"MoE step, Qwen3-30B-A3B expert layout, {a.layers} layers, context 512, {mx.default_device()}")
    summary = []
    for weights in a.weights.split(","):
        model = build(weights, a.layers)
        log(f"\n## {weights}: {weight_bytes(model) / 1e9:.2f} GB of weights")
        summary += [(weights, *r) for r in run(model, rows, max(rows), a.repeats, log)]
    log("\n| weights | B | native ms | deterministic ms | ÷ native | rows == single-row call | native rows == |")
    log("|---|---|---|---|---|---|---|")
    for w, b, n, c, same, nsame, strategy, proven in summary:
        log(f"| {w} | {b} | {n:.2f} | {c:.2f} ({strategy}) | {c / n:.2f}x | {same}/{b} | {nsame}/{b} |")


if __name__ == "__main__":
    main()
