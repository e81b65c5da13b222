"""Registers a thread of each precompiled kernel instance whose block is above 256 threads
(kernels/custom/compiled.py `Family.threads`), compiled by NVRTC here, no GPU needed: a block
may hold 65,536 registers, so 512 threads may use 128 each, and a launch above that fails
("too many resources requested for launch"). With --unbounded, beside each the instance
compiled without its `__launch_bounds__` (what the wrapper was before it said its block).

    pip download --no-deps -d /tmp/nvrtc "nvidia-cuda-nvrtc>=13" "nvidia-cuda-runtime>=13"
    (unzip both wheels into /tmp/nvrtc/x)
    .venv/bin/python bench/kernel_registers.py --nvrtc /tmp/nvrtc/x/nvidia/cu13/lib/libnvrtc.so.13 \\
        --include /tmp/nvrtc/x/nvidia/cu13/include --unbounded

The count is read from the cubin's `.nv.info` section (EIATTR_REGCOUNT). Prints a table;
asserts nothing.
"""
from __future__ import annotations

import argparse
import ctypes
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from lockstep.kernels.custom import nvrtc, split_attention  # noqa: E402

REGISTERS_A_BLOCK = 65536
EIATTR_REGCOUNT, EIFMT_SVAL = 0x2F, 0x04


def sections(blob: bytes) -> dict[str, bytes]:
    """An ELF64 file's sections by name."""
    shoff = struct.unpack_from("<Q", blob, 0x28)[0]
    entry, count, names = struct.unpack_from("<HHH", blob, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", blob, shoff + i * entry) for i in range(count)]
    strings = heads[names][4]
    out = {}
    for name, _, _, _, offset, size in heads:
        end = blob.index(b"\0", strings + name)
        out[blob[strings + name:end].decode()] = blob[offset:offset + size]
    return out


def register_counts(cubin: bytes) -> list[int]:
    """EIATTR_REGCOUNT of every kernel in the cubin."""
    counts = []
    for name, data in sections(cubin).items():
        if not name.startswith(".nv.info"):
            continue
        i = 0
        while i + 4 <= len(data):
            form, attribute, size = struct.unpack_from("<BBH", data, i)
            if form != EIFMT_SVAL:
                i += 4
                continue
            if attribute == EIATTR_REGCOUNT and size == 8:
                counts.append(struct.unpack_from("<II", data, i + 4)[1])
            i += 4 + size
    return counts


def unbounded(source: str) -> str:
    start = source.index("__launch_bounds__(")
    return source[:start] + source[source.index(")", start) + 2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvrtc", required=True, help="libnvrtc.so path")
    parser.add_argument("--include", required=True, help="the CUDA headers' directory (cuda_fp16.h)")
    parser.add_argument("--arch", default="sm_90a", help="NVRTC's architecture (default sm_90a: H100, H200)")
    parser.add_argument("--unbounded", action="store_true", help="also compile each without its bound")
    args = parser.parse_args()
    compiler = nvrtc.Nvrtc(ctypes.CDLL(args.nvrtc))
    options = ["--device-as-default-execution-space", f"--gpu-architecture={args.arch}", f"--include-path={args.include}"]
    print(f"NVRTC {'.'.join(map(str, compiler.version()))}, {args.arch}\n")
    print("| instance | threads a block | registers a thread | fits |" + (" unbounded | fits |" if args.unbounded else ""))
    print("|---|---|---|---|" + ("---|---|" if args.unbounded else ""))
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        for dim in (64, 128, 256):
            if not split_attention.kernel_takes(dtype, dim):
                continue
            for family, template in split_attention.instances(dtype, dim):
                threads, source = family.threads, family.source(template)
                row = [family.symbol(template), str(threads)]
                for text in [source] + ([unbounded(source)] if args.unbounded else []):
                    regs = max(register_counts(compiler.compile(text, options)))
                    row += [str(regs), "yes" if regs * threads <= REGISTERS_A_BLOCK else "**no**"]
                print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
