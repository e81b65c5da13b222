"""Sibling layers of the Llama-3-8B shape (q/k/v: 4096, 1024, 1024 × 4096; gate/up: 14336,
14336 × 4096) as one `qmv_mma_parts` launch beside each layer's own launch, at 1, 8 and 16
rows, read from HBM.

"own, plain" runs each layer as a plain call runs it (custom/split_rows.kernel_for, else MLX's
quantized matmul); "own, canonical" as a canonical call runs it (kernel_for, else the form's
call: MLX's at one row, qmv_rows above). Per group call: 64 calls (on 16 inputs) in one eval,
/ 64, median of 7, the weights rotating over copies that together exceed the H200's 50 MB L2
(bench/one_row_gemv.py's method). Beside the parts launch: whether every part equals its
layer's own qmv_mma call. Random weights. Measures and prints; asserts nothing. CUDA only.

    python bench/qmv_mma_parts.py [--formats nvfp4,affine4] [--rows 1,8,16] [--variants 4x2,8x2] [--out t.md]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from lockstep.kernels.custom import qmv_mma, qmv_mma_parts, qmv_rows, split_rows  # noqa: E402
from one_row_gemv import CALLS, ROTATION_BYTES, per_call_us  # noqa: E402
from qmv_split import FORMATS, HBM_BYTES_PER_S  # noqa: E402

GROUPS = (("q/k/v", (4096, 1024, 1024), 4096), ("gate/up", (14336, 14336), 4096))


def own_call(n, k, mode, m, canonical, kw):
    """How a layer's own call runs these rows: f(x, weight, scales, biases)."""
    kernel = split_rows.kernel_for(n, k, mode, mx.bfloat16, m, canonical)
    if kernel is not None:
        return lambda x, *q: kernel.matmul(x, *q, **kw)
    if canonical and m > 1:
        return lambda x, *q: qmv_rows.matmul(x, *q, **kw)
    return lambda x, *q: mx.quantized_matmul(x, *q, transpose=True, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="nvfp4,affine4")
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--variants", default="", help="NT x DEPTH launch shapes of the parts launch beside its default")
    ap.add_argument("--out")
    a = ap.parse_args()
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    variants = [None] + [tuple(int(v) for v in s.split("x")) for s in a.variants.split(",") if s]
    log(f"backend {mx.default_device()}, MLX {mx.__version__}; x bfloat16")
    log("| format | group | M | own, plain µs | own, canonical µs | parts NTxDEPTH µs (% floor) | parts ÷ own plain | "
        "parts ÷ own canonical | parts == own qmv_mma |")
    log("|---|---|---|---|---|---|---|---|---|")
    key = mx.random.key(5)
    for label in a.formats.split(","):
        mode, group = FORMATS[label]
        kw = dict(group_size=group, bits=4, mode=mode)
        for name, ns, k in GROUPS:
            firsts = []
            for n in ns:
                kw_key, key = mx.random.split(key)
                firsts.append((mx.random.normal((n, k), key=kw_key) * 0.02).astype(mx.bfloat16))
            quantized = [mx.quantize(w, group, 4, mode=mode) for w in firsts]
            nbytes = sum(v.nbytes for q in quantized for v in q)
            copies = max(1, int(-(-ROTATION_BYTES // nbytes)))
            sets = [[(q[0], q[1], q[2] if len(q) > 2 else None) for q in quantized]]
            for i in range(1, copies):
                sets.append([(q[0], q[1], q[2] if len(q) > 2 else None)
                             for q in (mx.quantize(w + 0.001 * i, group, 4, mode=mode) for w in firsts)])
            mx.eval([v for s in sets for q in s for v in q if v is not None])
            del firsts
            floor_us = 1e6 * nbytes / HBM_BYTES_PER_S
            for m in (int(r) for r in a.rows.split(",")):
                kx, key = mx.random.split(key)
                xs = [mx.random.normal((m, k), key=s).astype(mx.bfloat16) for s in mx.random.split(kx, 16)]
                mx.eval(*xs)

                def timed(fn):
                    try:
                        return per_call_us(lambda count: [fn(xs[i % len(xs)], sets[i % copies]) for i in range(count)],
                                           CALLS)
                    except Exception as exc:  # a kernel that does not take the shape
                        log(f"  ({type(exc).__name__}: {str(exc)[:120]})")
                        return float("nan")

                plain = [own_call(n, k, mode, m, False, kw) for n in ns]
                canonical = [own_call(n, k, mode, m, True, kw) for n in ns]
                own_plain = timed(lambda x, s: [f(x, *q) for f, q in zip(plain, s)])
                own_canonical = timed(lambda x, s: [f(x, *q) for f, q in zip(canonical, s)])
                for v in variants:
                    tiles, ahead = v or (None, None)

                    def parts(x, s, t=tiles, d=ahead):
                        return qmv_mma_parts.matmuls(x, s, tiles=t, ahead=d, **kw)

                    t = timed(parts)
                    try:
                        got = parts(xs[0], sets[0])
                        same = all(bool(mx.array_equal(y, qmv_mma.matmul(xs[0], *q, **kw)).item())
                                   for y, q in zip(got, sets[0]))
                    except Exception as exc:
                        same = f"{type(exc).__name__}"
                    shape = "default" if v is None else f"{tiles}x{ahead}"
                    log(f"| {label} | {name} | {m} | {own_plain:.1f} | {own_canonical:.1f} | {shape}: {t:.1f} "
                        f"({100 * floor_us / t:.0f} %) | {t / own_plain:.2f} | {t / own_canonical:.2f} | {same} |")
            del sets
            mx.clear_cache()
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
