"""One row of a 4-bit linear through `qmv_split` (K split across a block, lockstep's order)
against MLX's own quantized GEMV, at every linear of the Llama-3-8B shape, read from HBM.

Per call: 64 calls (on 16 inputs) in one eval, / 64, median of 7, the calls rotating over
copies of the weight that together exceed the H200's 50 MB L2 (bench/one_row_gemv.py's
method). First, what a plain read of 9, 33 and 128 MB costs the same way (a kernel that
only loads 16 bytes a thread, four loads in flight, and folds them): the rate this machine
streams at, beside the nominal 4.8 TB/s. Beside each linear's time, the share of the HBM
floor (the weight's bytes, scales included, at 4.8 TB/s), each side's largest error against
x @ dequantized W in float32 (relative to the largest output), and whether every row of a
4-row call equals its one-row call (--rows: the rows of the timed calls). Random weights.
Measures and prints; asserts nothing. CUDA only.

    python bench/qmv_split.py [--formats nvfp4,affine4,mxfp4] [--shapes 4x660,2x1056] [--rows 1,4]
                              [--out t.md]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from lockstep.kernels.custom import qmv_split  # noqa: E402
from one_row_gemv import CALLS, ROTATION_BYTES, per_call_us  # noqa: E402

SHAPES = [("q,o", 4096, 4096), ("k,v", 1024, 4096), ("gate,up", 14336, 4096), ("down", 4096, 14336),
          ("head", 128256, 4096)]
FORMATS = {"nvfp4": ("nvfp4", 16), "affine4": ("affine", 64), "mxfp4": ("mxfp4", 32)}
HBM_BYTES_PER_S = 4.8e12

# A plain read: each thread loads 16 bytes at a time, four loads in flight, and folds them
# into one word it stores (so the loads are kept).
_READ = mx.fast.cuda_kernel(name="lockstep_bench_read", input_names=["a"], output_names=["out"], source="""
    const uint4* p = reinterpret_cast<const uint4*>(a);
    const size_t n = WORDS / 4, stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint32_t fold = 0;
    for (; i + 3 * stride < n; i += 4 * stride) {
      const uint4 v0 = __ldg(p + i), v1 = __ldg(p + i + stride), v2 = __ldg(p + i + 2 * stride),
                  v3 = __ldg(p + i + 3 * stride);
      fold ^= v0.x ^ v0.y ^ v0.z ^ v0.w ^ v1.x ^ v1.y ^ v1.z ^ v1.w ^ v2.x ^ v2.y ^ v2.z ^ v2.w ^ v3.x ^ v3.y
              ^ v3.z ^ v3.w;
    }
    for (; i < n; i += stride) {
      const uint4 v = __ldg(p + i);
      fold ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    out[(size_t)blockIdx.x * blockDim.x + threadIdx.x] = fold;
""")
READ_THREADS, READ_BLOCKS = 256, 132 * 8


def read_us(nbytes: int) -> float:
    """Per call, a plain read of nbytes, rotating over copies beyond L2 like the linears."""
    words = nbytes // 4
    copies = max(1, int(-(-ROTATION_BYTES // nbytes)))
    arrays = [mx.random.randint(0, 1 << 30, (words,), dtype=mx.uint32) for _ in range(copies)]
    mx.eval(*arrays)

    def read(a):
        return _READ(inputs=[a], template=[("WORDS", words)], grid=(READ_BLOCKS * READ_THREADS, 1, 1),
                     threadgroup=(READ_THREADS, 1, 1), output_shapes=[(READ_BLOCKS * READ_THREADS,)],
                     output_dtypes=[mx.uint32])[0]

    return per_call_us(lambda count: [read(arrays[i % copies]) for i in range(count)], CALLS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default="4x660,8x660,4x1056,2x1056",
                    help="C x blocks launch shapes of qmv_split")
    ap.add_argument("--rows", default="1", help="rows of x a call (M)")
    ap.add_argument("--out")
    a = ap.parse_args()
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    launch_shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    rows_list = [int(v) for v in a.rows.split(",")]
    log(f"backend {mx.default_device()}, MLX {mx.__version__}; x bfloat16; qmv_split: "
        f"{qmv_split.unavailable_reason('nvfp4') or 'smoke test passed'}")
    log("| plain read | µs a call | TB/s | % of 4.8 TB/s |")
    log("|---|---|---|---|")
    for megabytes in (9, 33, 128):
        t = read_us(megabytes << 20)
        log(f"| {megabytes} MB | {t:.1f} | {(megabytes << 20) / t / 1e6:.2f} | "
            f"{100 * (megabytes << 20) / t / 1e6 / 4.8:.0f} % |")
    log()
    log("| format | linear | M | MLX µs (% floor) | MLX error | C x blocks | split µs (% floor) "
        "| split ÷ MLX | split error | 4 rows == alone |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    key = mx.random.key(5)
    for label in a.formats.split(","):
        mode, group = FORMATS[label]
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
            kw_ = dict(group_size=group, bits=4, mode=mode)
            floor_us = 1e6 * nbytes / HBM_BYTES_PER_S
            singles = [(mx.random.normal((1, k), key=s)).astype(mx.bfloat16) for s in mx.random.split(kx, 16)]
            exact = [x.astype(mx.float32) @ mx.dequantize(*qs[0], **kw_).astype(mx.float32).T for x in singles[:4]]
            scale = max(mx.max(mx.abs(e)).item() for e in exact)

            def error(fn):
                return max(mx.max(mx.abs(fn(x, 0).astype(mx.float32) - e)).item()
                           for x, e in zip(singles, exact)) / scale

            four = mx.concatenate(singles[:4], axis=0)
            for rows in rows_list:
                xs = [mx.concatenate([singles[(i + r) % 16] for r in range(rows)], axis=0) for i in range(16)]
                mx.eval(*xs)

                def calls(fn):
                    return lambda count: [fn(xs[i % len(xs)], i % copies) for i in range(count)]

                mlx_call = lambda x, j: mx.quantized_matmul(x, *qs[j], transpose=True, **kw_)  # noqa: E731
                base = per_call_us(calls(mlx_call), CALLS)
                base_error = error(mlx_call)
                for c, blocks in launch_shapes:
                    fn = lambda x, j, c=c, b=blocks: qmv_split.matmul(  # noqa: E731
                        x, *qs[j], columns=c, blocks=b, **kw_)
                    t = per_call_us(calls(fn), CALLS)
                    block = fn(four, 0)
                    alone = mx.concatenate([fn(x, 0) for x in singles[:4]], axis=0)
                    same = bool(mx.array_equal(block, alone).item())
                    log(f"| {label} | {name} {n}x{k} | {rows} | {base:.1f} ({100 * floor_us / base:.0f} %) | "
                        f"{base_error:.2e} | {c}x{blocks} | {t:.1f} ({100 * floor_us / t:.0f} %) | "
                        f"{t / base:.2f} | {error(fn):.2e} | {same} |")
            mx.clear_cache()
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
