"""Rows of a 4-bit linear through `qmv_mma` (tensor cores, lockstep's order) beside MLX's own
quantized matmul, `qmv_split` and `qmv_rows`, at every linear of the Llama-3-8B shape and at
1, 8 and 16 rows, read from HBM.

Per call: 64 calls (on 16 inputs) in one eval, / 64, median of 7, the calls rotating over
copies of the weight that together exceed the H200's 50 MB L2 (bench/one_row_gemv.py's
method). Beside each time, the share of the HBM floor (the weight's bytes at 4.8 TB/s), and
whether every row of the call equals its one-row call. Random weights. Measures and prints;
asserts nothing. CUDA only.

    python bench/qmv_mma.py [--formats nvfp4,affine4] [--rows 1,8,16] [--variants 2x4,1x2,4x1x2] [--out t.md]

A variant is NTxDEPTH[xCG] (CG: column groups of the staged tile, which reads x through shared
memory; 0 the tile that reads it from global memory); `== default` says whether its rows equal
the default launch's bit for bit (a launch shape never changes an output's order).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from lockstep.kernels.custom import qmv_mma, qmv_rows, qmv_split  # noqa: E402
from one_row_gemv import CALLS, ROTATION_BYTES, per_call_us  # noqa: E402
from qmv_split import FORMATS, HBM_BYTES_PER_S, SHAPES  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="nvfp4,affine4")
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--variants", default="", help="NTxDEPTH[xCG] launch shapes of qmv_mma beside its default")
    ap.add_argument("--out")
    a = ap.parse_args()
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    variants = [None] + [tuple(int(v) for v in s.split("x")) for s in a.variants.split(",") if s]
    log(f"backend {mx.default_device()}, MLX {mx.__version__}; x bfloat16")
    for label in a.formats.split(","):
        mode, _ = FORMATS[label]
        log(f"{label}: qmv_mma {qmv_mma.unavailable_reason(mode) or 'smoke test passed'}; "
            f"qmv_split {qmv_split.unavailable_reason(mode) or 'smoke test passed'}")
    log("| format | linear | M | MLX µs (% floor) | qmv_split µs | qmv_rows µs | qmv_mma NTxDEPTHxCG µs (% floor) | "
        "mma ÷ MLX | mma ÷ split | rows == alone | == default |")
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    key = mx.random.key(5)
    rows = [int(r) for r in a.rows.split(",")]
    for label in a.formats.split(","):
        mode, group = FORMATS[label]
        kw_ = dict(group_size=group, bits=4, mode=mode)
        for name, n, k in SHAPES:
            kx, kw, key = mx.random.split(key, 3)
            w = (mx.random.normal((n, k), key=kw) * 0.02).astype(mx.bfloat16)
            first = mx.quantize(w, group, 4, mode=mode)
            nbytes = sum(v.nbytes for v in first)
            copies = max(1, int(-(-ROTATION_BYTES // nbytes)))
            qs = [first] + [mx.quantize(w + 0.001 * i, group, 4, mode=mode) for i in range(1, copies)]
            qs = [(q[0], q[1], q[2] if len(q) > 2 else None) for q in qs]
            mx.eval([v for q in qs for v in q if v is not None])
            del w
            floor_us = 1e6 * nbytes / HBM_BYTES_PER_S
            for m in rows:
                xs = [(mx.random.normal((m, k), key=s)).astype(mx.bfloat16) for s in mx.random.split(kx, 16)]
                mx.eval(*xs)

                def calls(fn):
                    return lambda count: [fn(xs[i % len(xs)], i % copies) for i in range(count)]

                def timed(fn):
                    try:
                        return per_call_us(calls(fn), CALLS)
                    except Exception as exc:  # a kernel that does not take the shape
                        log(f"  ({type(exc).__name__}: {str(exc)[:120]})")
                        return float("nan")

                base = timed(lambda x, j: mx.quantized_matmul(x, *qs[j], transpose=True, **kw_))
                split = timed(lambda x, j: qmv_split.matmul(x, *qs[j], **kw_))
                rows_t = timed(lambda x, j: qmv_rows.matmul(x, *qs[j], **kw_)) if m > 1 else float("nan")
                default = None
                for v in variants:
                    tiles, ahead, groups = (tuple(v) + (None,) * 3)[:3] if v else (None, None, None)
                    fn = lambda x, j, t=tiles, d=ahead, g=groups: qmv_mma.matmul(  # noqa: E731
                        x, *qs[j], tiles=t, ahead=d, groups=g, **kw_)
                    t = timed(fn)
                    try:
                        block = fn(xs[0], 0)
                        alone = mx.concatenate([fn(xs[0][i : i + 1], 0) for i in range(m)], axis=0)
                        same = bool(mx.array_equal(block, alone).item())
                        default = block if default is None else default
                        as_default = bool(mx.array_equal(block, default).item())
                    except Exception:  # a launch shape that does not take the call (timed says why)
                        same = as_default = None
                    shape = "default" if v is None else "x".join(str(e) for e in v)
                    log(f"| {label} | {name} {n}x{k} | {m} | {base:.1f} ({100 * floor_us / base:.0f} %) | {split:.1f} | "
                        f"{rows_t:.1f} | {shape}: {t:.1f} ({100 * floor_us / t:.0f} %) | {t / base:.2f} | "
                        f"{t / split:.2f} | {same} | {as_default} |")
            mx.clear_cache()
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
