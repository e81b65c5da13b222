"""One row (a decode step's linear) through lockstep's row kernels against MLX's own call.

A block of rows through `qmv_rows` / `gemv_rows` follows MLX's single-row GEMV order, so one
row through them has that call's bits too. Whether it is also faster is what this measures:
at every linear of the Llama-3-8B shape, per format, MLX's call at M = 1 against the kernel
at M = 1 with R output columns a warp, and whether every output equals MLX's bit for bit.

Time per call: 64 calls (on 16 inputs) in one eval, / 64, median of 7: launch and host cost
included, the calls running one after another on the stream as a decode step's do; the calls
rotate over copies of the weight that together exceed the L2 cache (a first version used one
copy: an 8B gate's 29 MB of nvfp4 stayed in the H200's 50 MB L2 and flattered the kernel).
Random weights. Measures and prints; asserts nothing.

    python bench/one_row_gemv.py [--formats nvfp4,affine4,mxfp4,mxfp8,affine8,bf16] [--out t.md]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from lockstep.kernels.custom import gemv_rows, qmv_rows  # noqa: E402
from lockstep.kernels.custom.qmv_order import weight_bits  # noqa: E402

SHAPES = [("q,o", 4096, 4096), ("k,v", 1024, 4096), ("gate,up", 14336, 4096), ("down", 4096, 14336),
          ("head", 128256, 4096)]
# label -> (mode, group, bits); "bf16": dense
FORMATS = {"nvfp4": ("nvfp4", 16, 4), "affine4": ("affine", 64, 4), "mxfp4": ("mxfp4", 32, 4),
           "mxfp8": ("mxfp8", 32, 8), "affine8": ("affine", 64, 8), "bf16": None}
COLUMNS = (1, 2, 4, 8)
DENSE_SHAPES = ((1, 1), (2, 1), (4, 1))  # gemv_rows (columns, rows) per warp
CALLS = 64
ROTATION_BYTES = 200 << 20  # > the H200's 50 MB L2


def per_call_us(make, n, repeats=7) -> float:
    """Median over `repeats` of one eval of n calls, / n."""
    mx.eval(make(n))
    times = []
    for _ in range(repeats):
        outs = make(n)
        t = time.perf_counter()
        mx.eval(outs)
        times.append((time.perf_counter() - t) / n)
    return 1e6 * float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out")
    a = ap.parse_args()
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    log(f"backend {mx.default_device()}, MLX {mx.__version__}; x bfloat16, M = 1")
    log("| format | linear | MLX µs | kernel shape | kernel µs | kernel ÷ MLX | outputs != MLX |")
    log("|---|---|---|---|---|---|---|")
    key = mx.random.key(5)
    for label in a.formats.split(","):
        spec = FORMATS[label]
        for name, n, k in SHAPES:
            kx, kw, key = mx.random.split(key, 3)
            xs = [(mx.random.normal((1, k), key=s)).astype(mx.bfloat16) for s in mx.random.split(kx, 16)]
            w = (mx.random.normal((n, k), key=kw) * 0.02).astype(mx.bfloat16)
            # Calls rotate over copies of the weight whose bytes together exceed the L2 cache,
            # so every call reads its weight from HBM, as a decode step does.
            per_weight = n * k * (2 if spec is None else spec[2] / 8)
            copies = max(1, int(-(-ROTATION_BYTES // per_weight)))
            if spec is None:
                ws = [w + 0 for _ in range(copies)]
                mx.eval(ws, *xs)
                mlx_call = lambda x, j: x @ ws[j].T  # noqa: E731
                variants = {f"{c}x{r}": (lambda x, j, s=(c, r): gemv_rows.matmul(x, ws[j], shape=s))
                            for c, r in DENSE_SHAPES}
            else:
                mode, group, bits = spec
                qs = [mx.quantize(w + 0.001 * i, group, bits, mode=mode) for i in range(copies)]
                qs = [(q[0], q[1], q[2] if len(q) > 2 else None) for q in qs]
                mx.eval([a for q in qs for a in q if a is not None], *xs)
                del w
                kw_ = dict(group_size=group, bits=bits, mode=mode)
                mlx_call = lambda x, j: mx.quantized_matmul(x, *qs[j], transpose=True, **kw_)  # noqa: E731
                fused = qmv_rows.proven_variant(mode, weight_bits(mode, bits), mx.bfloat16)
                if fused is None:
                    log(f"| {label} | {name} | qmv_rows not proven here | | | |")
                    continue
                variants = {f"R={c}": (lambda x, j, c=c: qmv_rows.matmul(x, *qs[j], fused=fused, rows=1, columns=c,
                                                                       **kw_)) for c in COLUMNS}

            def calls(fn):
                return lambda count: [fn(xs[i % len(xs)], i % copies) for i in range(count)]

            base = per_call_us(calls(mlx_call), CALLS)
            reference = [mlx_call(x, 0) for x in xs]
            for vname, fn in variants.items():
                got = [fn(x, 0) for x in xs]
                differ = sum(int((g != r).sum().item()) for g, r in zip(got, reference))
                t = per_call_us(calls(fn), CALLS)
                log(f"| {label} | {name} {n}x{k} | {base:.1f} | {vname} | {t:.1f} | {t / base:.2f} | "
                    f"{differ} of {n * len(xs)} |")
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
