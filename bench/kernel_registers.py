"""Registers and spills a thread of lockstep's CUDA kernel instances, compiled here by NVRTC
(ptxas's report), no GPU needed. A block may hold 65,536 registers: a 512-thread block's
threads 128 each, a 256-thread block's 255 (the most a thread may have); above that a launch
fails ("too many resources requested for launch"), and a thread that needs more spills to
local memory. Two tables:

- the instances whose block is above 256 threads (kernels/custom/compiled.py
  `Family.threads`), with --unbounded each also compiled without its `__launch_bounds__`;
- `qmv_rows` (256-thread blocks) at each columns-a-warp R and rows-a-warp MR its launch plans
  may take, per format, with the blocks an SM can hold by registers;
- `qmv_mma` at the 8B's linears and 8 / 16 / 32 rows, with and without the staged tile (CG),
  with the blocks an SM can hold by registers and by shared memory.

    pip download --no-deps -d /tmp/nvrtc "nvidia-cuda-nvrtc>=13" "nvidia-cuda-runtime>=13"
    (unzip both wheels into /tmp/nvrtc/x)
    .venv/bin/python bench/kernel_registers.py --nvrtc /tmp/nvrtc/x/nvidia/cu13/lib/libnvrtc.so.13 \\
        --include /tmp/nvrtc/x/nvidia/cu13/include --unbounded

- with --cubin-bytes, each instance a decode step of the 8B nvfp4 shape launches (a plain
  row, a deterministic row, 32 plain rows; and SmolLM2's 16 deterministic rows' linears) and
  its cubin's bytes, summed over a step: MLX's
  CUDA backend hashes a precompiled kernel's whole source at every launch
  (`CustomKernel::eval_gpu` names the module by `std::hash` of it), host time a step that grew
  with the step's cubin bytes while launches passed the cubin (`LOCKSTEP_SHORT_KERNEL_SOURCES=0`;
  by default they pass a short token: kernels/custom/module_files.py).

Prints markdown tables; asserts nothing.
"""
from __future__ import annotations

import argparse
import ctypes
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from lockstep.kernels.custom import attention, nvrtc, qmv_mma, qmv_mma_parts, qmv_rows, qmv_split  # noqa: E402
from lockstep.kernels.custom import split_attention  # noqa: E402

REGISTERS_A_BLOCK = 65536
QMV_FORMATS = (("nvfp4", 4, 16), ("mxfp4", 4, 32), ("affine", 4, 64), ("affine", 8, 64), ("mxfp8", 8, 32))


def report(compiler, source: str, options) -> tuple[int, int, int]:
    """(registers, spill stores, spill loads) in bytes a thread, from ptxas's report."""
    log: list[str] = []
    compiler.compile(source, [*options, "--ptxas-options=-v"], log=log)
    used = re.search(r"Used (\d+) registers", log[0])
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log[0])
    return int(used.group(1)), int(spills.group(1)), int(spills.group(2))


def unbounded(source: str) -> str:
    start = source.index("__launch_bounds__(")
    return source[:start] + source[source.index(")", start) + 2:]


def wide_blocks(compiler, options, with_unbounded: bool) -> None:
    print("| instance | threads a block | registers a thread | spills (bytes) | fits |"
          + (" unbounded: registers | fits |" if with_unbounded else ""))
    print("|---|---|---|---|---|" + ("---|---|" if with_unbounded else ""))
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        for dim in (64, 128, 256):
            if not split_attention.kernel_takes(dtype, dim):
                continue
            for family, template in split_attention.instances(dtype, dim):
                threads, source = family.threads, family.source(template)
                regs, stores, _ = report(compiler, source, options)
                row = [family.symbol(template), threads, regs, stores, regs * threads <= REGISTERS_A_BLOCK]
                if with_unbounded:
                    free, _, _ = report(compiler, unbounded(source), options)
                    row += [free, free * threads <= REGISTERS_A_BLOCK]
                print("| " + " | ".join("yes" if v is True else "**no**" if v is False else str(v) for v in row) + " |")


def qmv_rows_plans(compiler, options) -> None:
    threads = 32 * qmv_rows.WARPS_PER_BLOCK
    print(f"\n`qmv_rows`, bfloat16 x, {threads} threads a block (the plan today: R = "
          f"{qmv_rows.warp_columns(4096)} from 4,096 columns, else {qmv_rows.warp_columns(1024)}; 8-bit "
          f"{qmv_rows.warp_columns(4096, 'affine', 8)}, mxfp8 {qmv_rows.warp_columns(14336, 'mxfp8', 8)} "
          f"above 8,192; "
          f"MR = {qmv_rows.warp_rows(3)} from 3 rows, else {qmv_rows.warp_rows(2)})\n")
    print("| format | R | MR | registers a thread | spill stores / loads (bytes) | blocks an SM by registers |")
    print("|---|---|---|---|---|---|")
    for mode, bits, group in QMV_FORMATS:
        family = qmv_rows.family(qmv_rows.kind(mode))
        for columns in (1, 2, 4):
            for rows in (2, 4):
                plan = qmv_rows._launch_plan(8, 4096, 4096, mode, bits, group, 0, mx.bfloat16, rows, columns)
                regs, stores, loads = report(compiler, family.source(tuple(plan["template"])), options)
                print(f"| {mode} {bits}-bit g{group} | {columns} | {rows} | {regs} | {stores} / {loads} | "
                      f"{REGISTERS_A_BLOCK // (regs * threads)} |")


# (name, N, K) of the Llama-3-8B linears qmv_mma runs
MMA_SHAPES = (("q,o", 4096, 4096), ("k,v", 1024, 4096), ("gate,up", 14336, 4096), ("down", 4096, 14336))


def qmv_mma_plans(compiler, options, groups) -> None:
    """qmv_mma (nvfp4, bfloat16 x) at the 8B's linears, 8 / 16 / 32 rows, each CG of `groups`
    (0: x from global memory; else the staged tile): registers, spills, the block's threads and
    shared memory, and the blocks an SM can hold by registers and by shared memory (228 KB)."""
    print("\n| qmv_mma nvfp4 | rows | CG | threads | registers | spill bytes (st/ld) | shared KB | blocks by regs | "
          "by shared | warps an SM |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    family = qmv_mma.family("fp")
    for name, n, k in MMA_SHAPES:
        for m in (8, 16, 32):
            for cg in groups:
                try:
                    plan = qmv_mma._launch_plan(m, n, k, "nvfp4", 16, mx.bfloat16, groups=cg)
                except ValueError as exc:
                    print(f"| {name} | {m} | {cg} | - | - | - | {exc} | | | |")
                    continue
                threads = plan["threadgroup"][0]
                regs, stores, loads = report(compiler, family.source(tuple(plan["template"])), options)
                shared = plan.get("shared_memory", 0)
                by_regs = REGISTERS_A_BLOCK // (max(regs, 1) * threads)
                by_shared = (228 << 10) // shared if shared else 32
                blocks = min(by_regs, by_shared, 2048 // threads)
                print(f"| {name} | {m} | {cg} | {threads} | {regs} | {stores}/{loads} | {shared / 1024:.0f} | "
                      f"{by_regs} | {by_shared if shared else '-'} | {blocks * threads // 32} |")


def step_launches(layers: int = 32, vocab: int = 128256) -> dict:
    """(label, (family, template), launches) of one 8B nvfp4 decode step (bfloat16 x, head size
    128, 8 KV heads of 4 query heads each) of each kind, as kernels/custom/split_rows.py and
    kernels/batching/kv_pool.py route its calls."""
    bf, fmt = mx.bfloat16, ("nvfp4", 16, mx.bfloat16)
    linears = (("q,o", 4096, 4096, 2), ("k,v", 1024, 4096, 2), ("down", 4096, 14336, 1))

    def mma(m):
        out = [(f"qmv_mma {name}", qmv_mma.instances(m, n, k, *fmt)[0], count * layers) for name, n, k, count in linears]
        out.append(("qmv_mma_parts gate,up", qmv_mma_parts.instances(m, (14336, 14336), 4096, *fmt)[0], layers))
        return out + [("qmv_mma head", qmv_mma.instances(m, vocab, 4096, *fmt)[0], 1)]

    plain_row = [(f"qmv_split {name}", qmv_split.instances(1, n, *fmt)[0], count * layers)
                 for name, n, count in (("q,o", 4096, 2), ("k,v", 1024, 2), ("gate,up", 14336, 2), ("down", 4096, 1))]
    plain_row.append(("qmv_split head", qmv_split.instances(1, vocab, *fmt)[0], 1))
    heads = split_attention.instances(bf, 128, 4)
    return {
        "plain, 1 row": plain_row + [("split_attention", heads[0], layers)],
        "deterministic, 1 row": mma(1) + [("pooled_attention", attention.instances(bf, 128)[0], layers)],
        "plain, 32 rows": mma(32) + [("split_attention", heads[-1], layers)],
    }


def small_step_launches(layers: int = 30, vocab: int = 49152) -> dict:
    """(label, (family, template), launches) of the 4-bit linears of one SmolLM2-135M nvfp4
    decode step of 16 deterministic rows: each runs qmv_rows (its layers are below qmv_mma's
    and qmv_split's sizes; a plain step runs MLX's own calls there, no cubin)."""
    fmt = ("nvfp4", 4, 16, mx.bfloat16)
    linears = (("q,o", 576, 576, 2), ("k,v", 192, 576, 2), ("gate,up", 1536, 576, 2), ("down", 576, 1536, 1))
    rows = [(f"qmv_rows {name}", qmv_rows.instances(16, n, k, *fmt)[0], count * layers)
            for name, n, k, count in linears]
    return {"SmolLM2 deterministic, 16 rows (linears)":
            rows + [("qmv_rows head", qmv_rows.instances(16, vocab, 576, *fmt)[0], 1)]}


def cubin_bytes(compiler, options) -> None:
    """Each instance of an 8B nvfp4 step of each kind, its cubin's bytes and its launches, and
    the bytes MLX hashes a step (`step_launches`)."""
    sizes: dict = {}
    print("\n| step | instance | launches a step | cubin KB | KB hashed a step |")
    print("|---|---|---|---|---|")
    for kind, launches in {**step_launches(), **small_step_launches()}.items():
        total = 0
        for label, (family, template), count in launches:
            key = (family.name, tuple(template))
            if key not in sizes:
                sizes[key] = len(compiler.compile(family.source(template), options))
            total += sizes[key] * count
            print(f"| {kind} | {label} `{family.symbol(template)}` | {count} | {sizes[key] / 1024:.1f} | "
                  f"{sizes[key] * count / 1024:.0f} |")
        print(f"| {kind} | **a step** | {sum(c for *_, c in launches)} | | **{total / 1024:.0f}** |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvrtc", required=True, help="libnvrtc.so path")
    parser.add_argument("--include", required=True, help="the CUDA headers' directory (cuda_fp16.h)")
    parser.add_argument("--arch", default="sm_90a", help="NVRTC's architecture (default sm_90a: H100, H200)")
    parser.add_argument("--unbounded", action="store_true", help="also compile each bounded instance without its bound")
    parser.add_argument("--qmv-mma-groups", default="0,1,2", help="CG values of the qmv_mma table (default 0,1,2)")
    parser.add_argument("--cubin-bytes", action="store_true",
                        help="only the cubin bytes a decode step's launches hash, 8B and SmolLM2 (see above)")
    args = parser.parse_args()
    compiler = nvrtc.Nvrtc(ctypes.CDLL(args.nvrtc))
    options = ["--device-as-default-execution-space", f"--gpu-architecture={args.arch}",
               f"--include-path={args.include}"]
    print(f"NVRTC {'.'.join(map(str, compiler.version()))}, {args.arch}\n")
    if args.cubin_bytes:
        cubin_bytes(compiler, options)
        return
    wide_blocks(compiler, options, args.unbounded)
    qmv_rows_plans(compiler, options)
    qmv_mma_plans(compiler, options, [int(g) for g in args.qmv_mma_groups.split(",")])


if __name__ == "__main__":
    main()
