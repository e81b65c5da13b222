"""What an 8B-shaped decode step costs apart from reading weights, on the running backend.

(a) The Llama-3-8B-shaped step at B = 1 after 512 tokens of context, native MLX (random
    weights, bench/invariant_8b.py's `build`), against its HBM floor (every weight byte
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

from invariant_8b import HBM_BYTES_PER_S, build, context, forward, step_ms, weight_bytes  # noqa: E402


def decode_ms(model) -> float:
    """Median ms of one native decode step after 512 tokens of context."""
    cache = context(model, 512)
    return step_ms(forward(model, cache, None), cache, [3], repeats=10)


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
        cells.append(f"{name} {us:.1f} us ({100 * weight_bytes(module) / HBM_BYTES_PER_S / (us * 1e-6):.0f} % of floor)")
    return ", ".join(cells)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="bf16,nvfp4,affine4")
    args = ap.parse_args()
    print(f"backend {mx.default_device()}, MLX {mx.__version__}")
    for weights in args.weights.split(","):
        tiny = decode_ms(build(weights, 32, hidden=256, intermediate=512, vocab=1024))
        model = build(weights, 32)
        full = decode_ms(model)
        floor = 1e3 * weight_bytes(model) / HBM_BYTES_PER_S
        print(f"{weights}: 8B step {full:.2f} ms, floor {floor:.2f} ms ({100 * floor / full:.0f} %); "
              f"same ops, tiny matrices {tiny:.2f} ms; 40 % of floor = {floor / 0.4:.2f} ms | "
              f"{linears(model, weights)}", flush=True)
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
