"""What an 8B-shaped decode step costs apart from reading weights, on the running backend.

(a) The Llama-3-8B-shaped step at B = 1 after 512 tokens of context, native MLX (random
    weights, as bench/invariant_8b.py builds them), against its HBM floor (every weight byte
    read once at 4.8 TB/s).
(b) The same step with tiny matrices (hidden 256, MLP 512, vocab 1024; the same 32 layers,
    the same op count and the same attention shapes): the part of a step that is not weight
    reads (op dispatch, launches, attention, norms).
(c) Each linear of one layer alone at M = 1 (50 launches in one eval), against its bytes.

Measures and prints; asserts nothing. Meant for the GPU: on MLX's CPU backend bfloat16 and
4-bit matmuls are slow enough that (b) measures them, not dispatch.

    python bench/op_floor_8b.py [--weights bf16,nvfp4,affine4]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from invariant_8b import HBM_BYTES_PER_S, WEIGHTS  # noqa: E402


def model_of(hidden: int, intermediate: int, vocab: int, weights: str):
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=32, intermediate_size=intermediate,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        vocab_size=vocab, rope_theta=500000.0, tie_word_embeddings=False,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    if WEIGHTS[weights]:
        mode, group, bits = WEIGHTS[weights]
        nn.quantize(model, group_size=group, bits=bits, mode=mode)
    mx.eval(model.parameters())
    return model


def nbytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def step_ms(model, repeats: int = 10) -> float:
    """Median ms of one decode step after 512 tokens of context (the cache rewound each time)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, model.args.vocab_size, (1, 512)), cache=cache))
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        mx.eval(model(mx.array([[3]]), cache=cache))
        times.append(time.perf_counter() - start)
        for c in cache:
            c.trim(1)
    return 1e3 * float(np.median(times[2:]))


def linears(model, weights: str) -> str:
    layer = model.model.layers[0]
    cells = []
    for name, module in (("q", layer.self_attn.q_proj), ("k", layer.self_attn.k_proj),
                         ("o", layer.self_attn.o_proj), ("gate", layer.mlp.gate_proj),
                         ("down", layer.mlp.down_proj), ("head", model.lm_head)):
        k = module.weight.shape[1] * (1 if weights == "bf16" else 32 // module.bits)
        x = mx.random.normal((1, 1, k)).astype(mx.bfloat16)
        mx.eval(module(x))
        start = time.perf_counter()
        mx.eval([module(x) for _ in range(50)])
        us = 1e6 * (time.perf_counter() - start) / 50
        cells.append(f"{name} {us:.1f} us ({100 * nbytes(module) / HBM_BYTES_PER_S / (us * 1e-6):.0f} % of floor)")
    return ", ".join(cells)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="bf16,nvfp4,affine4")
    args = ap.parse_args()
    print(f"backend {mx.default_device()}, MLX {mx.__version__}")
    for weights in args.weights.split(","):
        tiny = step_ms(model_of(256, 512, 1024, weights))
        model = model_of(4096, 14336, 128256, weights)
        full = step_ms(model)
        floor = 1e3 * nbytes(model) / HBM_BYTES_PER_S
        print(f"{weights}: 8B step {full:.2f} ms, floor {floor:.2f} ms ({100 * floor / full:.0f} %); "
              f"same ops, tiny matrices {tiny:.2f} ms; 40 % of floor = {floor / 0.4:.2f} ms | "
              f"{linears(model, weights)}", flush=True)
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
