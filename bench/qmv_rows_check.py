"""qmv_rows (kernels/custom/qmv_rows.cu) against MLX's own quantized GEMV on a CUDA GPU.

1. The smoke verdicts: which dequantization variant matched MLX's single-row call for each
   quantization and dtype (or none).
2. Agreement at every linear shape of the Llama-3-8B and SmolLM2-135M models: every row of a
   block of M = 2..32 rows equal, bit for bit, to MLX's single-row quantized_matmul.
3. Microseconds per call at each shape: MLX's call at M = 1 (the decode step), and at M = 8 and
   16 MLX's own call, MLX in chunks of 7 rows (per row its GEMV), the skinny kernel and qmv_rows.

Random weights (speed does not depend on their values). Measures and prints; asserts nothing.

    python bench/qmv_rows_check.py [--out table.md] [--quick]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from lockstep.kernels import custom  # noqa: E402
from lockstep.kernels.custom import qmv_rows  # noqa: E402
from lockstep.kernels.custom.qmv_order import weight_bits  # noqa: E402

# (name, N, K) of each linear: q / o, k / v, gate / up, down, head
SHAPES = {
    "8B": [("q,o", 4096, 4096), ("k,v", 1024, 4096), ("gate,up", 14336, 4096), ("down", 4096, 14336),
           ("head", 128256, 4096)],
    "SmolLM2": [("q,o", 576, 576), ("k,v", 192, 576), ("gate,up", 1536, 576), ("down", 576, 1536),
                ("head", 49152, 576)],
}
# (label, mode, group, bits, dtype)
FORMATS = [("nvfp4", "nvfp4", 16, 4, mx.bfloat16), ("affine4", "affine", 64, 4, mx.bfloat16),
           ("mxfp4", "mxfp4", 32, 4, mx.bfloat16), ("mxfp8", "mxfp8", 32, 8, mx.bfloat16),
           ("affine8", "affine", 64, 8, mx.bfloat16), ("nvfp4 f16", "nvfp4", 16, 4, mx.float16),
           ("affine4 f16", "affine", 64, 4, mx.float16), ("affine4 g32", "affine", 32, 4, mx.bfloat16),
           ("affine4 g128", "affine", 128, 4, mx.bfloat16)]
WIDTHS = (2, 3, 5, 8, 16, 32)
ROWS_PER_WARP = (2, 4, 8)
# (output columns, rows) per warp tried by --shapes
WARP_SHAPES = ((1, 4), (2, 2), (2, 4), (4, 2), (4, 4), (8, 2))


def weights(n, k, mode, group, bits, dtype, seed=0):
    w = (mx.random.normal((n, k), key=mx.random.key(seed)) * 0.02).astype(dtype)
    wq, scales, *rest = mx.quantize(w, group, bits, mode=mode)
    mx.eval(wq, scales, *rest)
    return wq, scales, (rest[0] if rest else None)


def per_call_us(fn, xs, repeats=5) -> float:
    """Median over `repeats` of (one eval of fn on every x in xs) / len(xs)."""
    mx.eval([fn(x) for x in xs])
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval([fn(x) for x in xs])
        times.append((time.perf_counter() - t) / len(xs))
    return 1e6 * float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="8B nvfp4 / affine4 timings only")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--shapes", action="store_true", help="only: qmv_rows per warp shape at the 8B's linears")
    ap.add_argument("--formats", default="nvfp4,affine4", help="with --shapes: FORMATS labels, comma-separated")
    ap.add_argument("--rows", default="2,8,16", help="with --shapes: call widths M, comma-separated")
    a = ap.parse_args()
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    log(f"backend {mx.default_device()}, MLX {mx.__version__}")
    log("\n## smoke verdicts (variant: 0 = dequantization rounded after each step, 1 = once)")
    for label, mode, group, bits, dtype in FORMATS:
        t = time.perf_counter()
        v = qmv_rows.proven_variant(mode, weight_bits(mode, bits), dtype)
        log(f"{label:>13}: {'variant ' + str(v) if v is not None else 'NONE matched'}"
            f"  ({time.perf_counter() - t:.1f} s)")
        if v is None:  # how far each variant is from MLX, for the record
            wq, scales, biases = weights(70, 640, mode, group, bits, dtype)
            x = mx.random.normal((5, 640), key=mx.random.key(1)).astype(dtype)
            kw = dict(group_size=group, bits=bits, mode=mode)
            alone = mx.concatenate([mx.quantized_matmul(x[i:i + 1], wq, scales, biases, transpose=True, **kw)
                                    for i in range(5)])
            for fused in (0, 1):
                got = qmv_rows.matmul(x, wq, scales, biases, fused=fused, **kw)
                diff = (got != alone).sum().item()
                log(f"{'':>15} variant {fused}: {diff}/{got.size} elements differ, max "
                    f"{mx.abs(got.astype(mx.float32) - alone.astype(mx.float32)).max().item():.3g}")

    if a.shapes:
        warp_shapes(log, tuple(a.formats.split(",")), tuple(int(m) for m in a.rows.split(",")))
        if a.out:
            Path(a.out).write_text("\n".join(lines) + "\n")
        return
    if not a.skip_agreement:
        agreement(log)
    timings(log, a.quick)
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


def warp_shapes(log, labels=("nvfp4", "affine4"), ms=(2, 8, 16)):
    log("\n## qmv_rows µs per call by (columns, rows) per warp; rows != MLX's single-row call")
    log("| format | linear | M | " + " | ".join(f"{c}x{r}" for c, r in WARP_SHAPES) + " |")
    log("|---|---|---|" + "---|" * len(WARP_SHAPES))
    for label, mode, group, bits, dtype in [f for f in FORMATS if f[0] in labels]:
        fused = qmv_rows.proven_variant(mode, weight_bits(mode, bits), dtype)
        for name, n, k in SHAPES["8B"]:
            wq, scales, biases = weights(n, k, mode, group, bits, dtype)
            kw = dict(group_size=group, bits=bits, mode=mode)
            xs = [mx.random.normal((max(ms), k), key=mx.random.key(20 + i)).astype(dtype) for i in range(16)]
            alone = mx.concatenate([mx.quantized_matmul(xs[0][i:i + 1], wq, scales, biases, transpose=True, **kw)
                                    for i in range(max(ms))])
            for m in ms:
                cells = []
                for c, r in WARP_SHAPES:
                    def run(x):
                        return qmv_rows.matmul(x[:m], wq, scales, biases, fused=fused, rows=r, columns=c, **kw)
                    bad = (run(xs[0]) != alone[:m]).sum().item()
                    cells.append(f"{per_call_us(run, xs):.1f}" + (f" ({bad} differ)" if bad else ""))
                log(f"| {label} | {name} {n}x{k} | {m} | " + " | ".join(cells) + " |")
            mx.clear_cache()


def agreement(log):
    log("\n## agreement: rows of M-row blocks != MLX's single-row call (M = " + ", ".join(map(str, WIDTHS)) + ")")
    key = mx.random.key(5)
    for model, shapes in SHAPES.items():
        for label, mode, group, bits, dtype in FORMATS:
            if qmv_rows.proven_variant(mode, weight_bits(mode, bits), dtype) is None:
                continue
            cells = []
            for name, n, k in (s for s in shapes if s[2] % group == 0):
                wq, scales, biases = weights(n, k, mode, group, bits, dtype)
                kw = dict(group_size=group, bits=bits, mode=mode)
                kx, key = mx.random.split(key)
                x = mx.random.normal((max(WIDTHS), k), key=kx).astype(dtype)
                alone = [mx.quantized_matmul(x[i:i + 1], wq, scales, biases, transpose=True, **kw)
                         for i in range(max(WIDTHS))]
                mx.eval(alone)
                bad = 0
                for m in WIDTHS:
                    block = qmv_rows.try_matmul(x[:m], wq, scales, biases, **kw)
                    mx.eval(block)
                    bad += sum(not mx.array_equal(block[i], alone[i][0]).item() for i in range(m))
                cells.append(f"{name} {bad}")
                del wq, scales, biases
            log(f"{model:>8} {label:>13}: " + ", ".join(cells) + f"  (of {sum(WIDTHS)} rows each)")


def timings(log, quick: bool):
    log("\n## µs per call (one eval of 16 calls / 16)")
    log("| model | format | linear | MLX M=1 | M | MLX native | MLX chunks of 7 | skinny | qmv_rows | "
        + " | ".join(f"qmv_rows {r} rows/warp" for r in ROWS_PER_WARP) + " |")
    log("|---|---|---|---|---|---|---|---|---|" + "---|" * len(ROWS_PER_WARP))
    formats = FORMATS[:2] if quick else FORMATS[:5]
    for model, shapes in SHAPES.items():
        if quick and model != "8B":
            continue
        for label, mode, group, bits, dtype in formats:
            for name, n, k in shapes:
                wq, scales, biases = weights(n, k, mode, group, bits, dtype)
                kw = dict(group_size=group, bits=bits, mode=mode)
                xs = [mx.random.normal((16, k), key=mx.random.key(20 + i)).astype(dtype) for i in range(16)]
                mx.eval(xs)

                def mlx(x):
                    return mx.quantized_matmul(x, wq, scales, biases, transpose=True, **kw)

                one = per_call_us(lambda x: mlx(x[:1]), xs)
                for m in (8, 16):
                    native = per_call_us(lambda x: mlx(x[:m]), xs)
                    chunks = per_call_us(lambda x: mx.concatenate([mlx(x[i:i + 7]) for i in range(0, m, 7)]), xs)
                    sk = "-"
                    if custom.available() and custom.quantized_serves(xs[0][:m], scales, **kw):
                        sk = f"{per_call_us(lambda x: custom.quantized_matmul(x[:m], wq, scales, biases, **kw), xs):.1f}"
                    qr = "-"
                    if qmv_rows.try_matmul(xs[0][:m], wq, scales, biases, **kw) is not None:
                        qr = f"{per_call_us(lambda x: qmv_rows.try_matmul(x[:m], wq, scales, biases, **kw), xs):.1f}"
                    per_rows = []
                    fused = qmv_rows.proven_variant(mode, weight_bits(mode, bits), dtype)
                    for r in ROWS_PER_WARP:
                        per_rows.append("-" if fused is None else f"{per_call_us(lambda x: qmv_rows.matmul(x[:m], wq, scales, biases, fused=fused, rows=r, **kw), xs):.1f}")
                    log(f"| {model} | {label} | {name} {n}x{k} | {one:.1f} | {m} | {native:.1f} | {chunks:.1f} | {sk} | {qr} | "
                        + " | ".join(per_rows) + " |")
                mx.clear_cache()


if __name__ == "__main__":
    main()
