"""What a precompiled kernel's cubin size costs the host at every launch (issue 50): MLX's CUDA
backend names a precompiled kernel's module by `std::hash` of its whole source at each launch
(`CustomKernel::eval_gpu`), so a step's submit grows with the bytes of its kernels' cubins.

One tiny kernel (y = x + 1 on 256 floats), compiled here by NVRTC, its cubin padded at the end
with 0, 16, 32 and 64 KB (the loader reads the ELF by its offsets; each variant's output is
checked), launched --launches times in one compiled function (as a decode pass is: the
primitives are built once, then only submitted), each variant's submit (`mx.async_eval`) and
wait timed, interleaved round after round. Prints each variant's median submit a launch and the
slope in microseconds per KB against the unpadded cubin. With --by-name each padded cubin is
also launched as lockstep's launches are (kernels/custom/module_files.py: a short token whose
module file holds the cubin) beside its bytes. Needs a CUDA device; asserts nothing.

    python bench/launch_bytes.py [--launches 200] [--rounds 30] [--pad-kb 0,16,32,64] [--by-name]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

SOURCE = """
extern "C" __global__ void lockstep_launch_bytes(const float* x, float* y) {
  y[threadIdx.x] = x[threadIdx.x] + 1.0f;
}
"""
NAME = "lockstep_launch_bytes"


def compile_source(source: str) -> bytes:
    from lockstep.kernels.custom import nvrtc

    compiler = nvrtc.load_nvrtc()
    return bytes(compiler.compile(source, nvrtc.detect_toolchain(compiler).options))


def chain(blob: bytes, launches: int):
    def run(x):
        for _ in range(launches):
            x = mx.fast.precompiled_cuda_kernel(
                name=NAME, compiled_source=blob, inputs=[x], output_shapes=[x.shape],
                output_dtypes=[mx.float32], scalars=[], grid=(256, 1, 1), threadgroup=(256, 1, 1))[0]
        return x
    return mx.compile(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--pad-kb", default="0,16,32,64")
    ap.add_argument("--by-name", action="store_true", help="each cubin also launched by its token")
    args = ap.parse_args()
    base = compile_source(SOURCE)
    sizes = [int(p) for p in args.pad_kb.split(",")]
    variants = {(pad, "bytes"): chain(base + b"\0" * (pad << 10), args.launches) for pad in sizes}
    if args.by_name:
        from lockstep.kernels.custom import module_files

        if not module_files.probe(compile_source):
            sys.exit("launching by name does not work here (the warning above says why)")
        for pad in sizes:
            short = module_files.write_module(NAME, base + b"\0" * (pad << 10))
            variants[(pad, "by name")] = chain(short, args.launches)
    x = mx.zeros((256,), mx.float32)
    for pad, fn in list(variants.items()):  # trace, load, check
        try:
            y = fn(x)
            mx.eval(y)
            right = bool(mx.all(y == float(args.launches)).item())
        except Exception as exc:  # the loader refused the padded cubin
            right, why = False, str(exc)[:200]
        else:
            why = "wrong output"
        if not right:
            print(f"padded by {pad[0]} KB, {pad[1]}: {why}; left out")
            del variants[pad]
    pads = list(variants)
    if not pads:
        sys.exit("no variant ran")
    submit: dict = {pad: [] for pad in pads}
    wait: dict = {pad: [] for pad in pads}
    for r in range(args.rounds):
        for pad in pads[r % len(pads):] + pads[:r % len(pads)]:
            started = time.perf_counter()
            y = variants[pad](x)
            mx.async_eval(y)
            submitted = time.perf_counter()
            mx.eval(y)
            submit[pad].append(submitted - started)
            wait[pad].append(time.perf_counter() - submitted)
    kb = len(base) / 1024
    print(f"# {mx.device_info(mx.gpu).get('device_name', 'gpu')}: {args.launches} launches a call, "
          f"cubin {kb:.1f} KB + padding, medians of {args.rounds} rounds")
    print("| cubin KB | launched from | submit us a launch | wait us a launch |")
    print("|---|---|---|---|")
    per = {pad: statistics.median(submit[pad]) / args.launches * 1e6 for pad in pads}
    for pad in pads:
        print(f"| {kb + pad[0]:.1f} | {pad[1]} | {per[pad]:.2f} | "
              f"{statistics.median(wait[pad]) / args.launches * 1e6:.2f} |")
    for how in dict.fromkeys(h for _, h in pads):
        mine = sorted(p for p in pads if p[1] == how)
        if len(mine) > 1:
            slope = (per[mine[-1]] - per[mine[0]]) / (mine[-1][0] - mine[0][0])
            rate = f"{1024 / slope / 1e3:.1f} GB/s" if slope > 0 else "no growth"
            print(f"{how}: slope {slope:.4f} us a launch per KB of cubin ({rate})")


if __name__ == "__main__":
    main()
