"""The plain passes' pool attention (`split_attention`) with one or several query heads of a
KV head a block (HG: each key and value loaded once for all of them), at the Llama-3-8B's
heads (32 query, 8 KV, head size 128, bfloat16), R rows of one query each, every row's keys
its own run of the pool. Per call: 64 calls in one eval, / 64, median of 7. Beside each time,
the KV bytes read at the HBM rate, and whether the output equals HG = 1's bit for bit.
Measures and prints; asserts nothing. CUDA only.

    python bench/split_attention_heads.py [--rows 1,16,32] [--context 128,512,2048] [--heads-a-block 1,2,4]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from lockstep.kernels.custom import split_attention  # noqa: E402
from lockstep.kernels.custom.attention import PoolRows  # noqa: E402
from one_row_gemv import CALLS, per_call_us  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128
HBM_BYTES_PER_S = 3.35e12  # the H100's; the H200's is 4.8e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,32")
    ap.add_argument("--context", default="128,512,2048")
    ap.add_argument("--heads-a-block", default="1,2,4")
    a = ap.parse_args()
    dtype = mx.bfloat16
    print(f"backend {mx.default_device()}, MLX {mx.__version__}; {HEADS} / {KV_HEADS} heads of {DIM}, bfloat16")
    print("| rows | context | HG | µs | KV at 3.35 TB/s µs | == HG 1 | the default |")
    print("|---|---|---|---|---|---|---|")
    for r in (int(v) for v in a.rows.split(",")):
        for ctx in (int(v) for v in a.context.split(",")):
            slots = r * ctx
            key = mx.random.key(r * 7919 + ctx)
            kq, kk, kv = mx.random.split(key, 3)
            q = mx.random.normal((1, HEADS, r, DIM), key=kq).astype(dtype)
            kp = mx.random.normal((KV_HEADS, slots, DIM), key=kk).astype(dtype)
            vp = mx.random.normal((KV_HEADS, slots, DIM), key=kv).astype(dtype)
            rows = PoolRows([i * ctx for i in range(r)], [ctx] * r)
            mx.eval(q, kp, vp)
            floor = 1e6 * 2 * kp.nbytes / HBM_BYTES_PER_S
            one = None
            for hg in (int(v) for v in a.heads_a_block.split(",")):
                def call(hg=hg):
                    return split_attention.kernel_attention(q, kp, vp, rows, DIM ** -0.5, per_block=hg)
                try:
                    us = per_call_us(lambda n: [call() for _ in range(n)], CALLS)
                except Exception as exc:  # an HG the kernel cannot take
                    print(f"| {r} | {ctx} | {hg} | {type(exc).__name__}: {str(exc)[:80]} | | |")
                    continue
                out = call()
                one = out if one is None else one
                default = hg == split_attention.heads_a_block(dtype, DIM, HEADS // KV_HEADS, r)
                print(f"| {r} | {ctx} | {hg} | {us:.1f} | {floor:.1f} | {bool(mx.array_equal(out, one).item())} | "
                      f"{'yes' if default else ''} |", flush=True)


if __name__ == "__main__":
    main()
