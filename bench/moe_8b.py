"""MoE deterministic decode at a real expert layout (issue 30): Qwen3-30B-A3B's experts (hidden
2048, 128 experts of 768, top-8, 32/4 heads of 128, vocabulary 151936) with fewer layers,
random weights, bf16 and nvfp4, on mlx-lm's own qwen3_moe classes.

For each B in --rows and each weights format: the native step time; the step with the
canonical forms installed for L = max(rows), once per --expert-rows form, side by side on the
same model and cache (kernels/invariance/expert_rows.py: `per_row`, each token row the expert
block's own call, 3 gather launches a row; `auto`, all rows in one unsorted gather call per
projection where the startup proof shows each row keeps its per-row bits, else per row: the
column says which was installed); each one's ratio to native; and how many of the B rows of
each canonical step equal, bitwise, the same token fed alone (the negative control: how many
native rows do).

    python bench/moe_8b.py --layers 4 --rows 1,8,16 --weights bf16,nvfp4 --expert-rows per_row,auto
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


# --small: the same top-8 layout shrunk (hidden 256, 16 experts of 128, vocabulary 4096), to show
# the script runs where the full shape does not fit (the CPU: float32 only)
SMALL = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 16,
         "moe_intermediate_size": 128, "intermediate_size": 768, "vocab_size": 4096}


def build(weights: str, layers: int, seed: int = 0, small: bool = False):
    args = qwen3_moe.ModelArgs.from_dict({
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": layers, "intermediate_size": 6144,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768,
        "rms_norm_eps": 1e-6, "vocab_size": 151936, "rope_theta": 1e6, "tie_word_embeddings": False,
        "max_position_embeddings": 40960, "norm_topk_prob": True, **(SMALL if small else {})})
    mx.random.seed(seed)
    model = qwen3_moe.Model(args)
    if weights != "float32":  # (float32: MLX's CPU gather_mm takes no other type)
        model.set_dtype(mx.bfloat16)
    if QUANT[weights]:
        mode, group, bits = QUANT[weights]
        nn.quantize(model, group_size=group, bits=bits, mode=mode)
    mx.eval(model.parameters())
    return model


def run(model, rows: list[int], limit: int, repeats: int, forms: list[str], strategy: str, log) -> list[tuple]:
    table = []
    for b in rows:
        cache = context(model, 512)
        tokens = mx.random.randint(0, model.args.vocab_size, (b,), key=mx.random.key(100 + b)).tolist()
        step = lambda t: model(mx.array([t]), cache=cache)[0]  # noqa: E731
        set_batch_invariant_limit(model, 0)
        native = step_ms(step, cache, tokens, repeats)
        native_same = rows_identical(step, cache, tokens) if b > 1 else 1
        columns = []
        for form in forms:
            invariance = set_batch_invariant_limit(model, limit, strategy, expert_rows=form)
            canonical = step_ms(step, cache, tokens, repeats)
            same = rows_identical(step, cache, tokens) if b > 1 else 1
            experts = invariance.expert_rows
            installed = ("native call" if experts is None else "per row" if not experts.one_call_rows
                         else f"one call <={experts.one_call_rows}")
            columns.append((form, installed, canonical, same, invariance.strategy, invariance.guaranteed))
            log(f"B={b:<3} native {native:8.2f} ms  deterministic, experts {form} -> {installed} "
                f"({invariance.strategy}, proven {invariance.guaranteed}) {canonical:8.2f} ms = "
                f"{canonical / native:5.2f}x  rows == single-row call: {same}/{b} (native: {native_same}/{b})")
            if experts is not None and not experts.one_call_rows and form == "auto":
                log(f"      one call not proven: {experts.reason}")
        set_batch_invariant_limit(model, 0)
        table.append((b, native, native_same, columns))
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--weights", default="bf16,nvfp4")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--strategy", default="auto", help="the canonical forms' strategy (auto: proven, fastest)")
    ap.add_argument("--small", action="store_true", help="a shrunk layout (see SMALL), to try the script on the CPU")
    ap.add_argument("--expert-rows", default="per_row,auto",
                    help="expert-row forms to time side by side: per_row, auto (one call where proven)")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    forms = a.expert_rows.split(",")
    if not set(forms) <= {"per_row", "auto"}:
        ap.error(f"--expert-rows {a.expert_rows!r}: a list of per_row, auto")
    log = lambda s: print(s, flush=True)  # noqa: E731
    shape = "a shrunk top-8 layout (--small)" if a.small else "Qwen3-30B-A3B expert layout"
    log(f"MoE step, {shape}, {a.layers} layers, context 512, {mx.default_device()}, strategy {a.strategy}")
    summary = []
    for weights in a.weights.split(","):
        model = build(weights, a.layers, small=a.small)
        log(f"\n## {weights}: {weight_bytes(model) / 1e9:.2f} GB of weights")
        summary += [(weights, *r) for r in run(model, rows, max(rows), a.repeats, forms, a.strategy, log)]
    log("\n| weights | B | native ms | experts | installed | deterministic ms | ÷ native | rows == single-row call "
        "| native rows == |")
    log("|---|---|---|---|---|---|---|---|---|")
    for w, b, n, nsame, columns in summary:
        for form, installed, c, same, strategy, proven in columns:
            log(f"| {w} | {b} | {n:.2f} | {form} | {installed} | {c:.2f} ({strategy}) | {c / n:.2f}x | {same}/{b} "
                f"| {nsame}/{b} |")


if __name__ == "__main__":
    main()
