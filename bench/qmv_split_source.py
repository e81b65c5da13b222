"""Writes the whole translation unit of one instance of lockstep's 4-bit row kernels (one row
of x bfloat16, nvfp4 weights of N x K), as MLX's launch compiles it, for
bench/qmv_split_standalone.cu, and prints the instance's function name and launch.

    python bench/qmv_split_source.py [--kernel qmv_split|qmv_mma] [--n 14336] [--k 4096] --out k.cu
"""
import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from lockstep.kernels.custom import qmv_mma, qmv_split  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=("qmv_split", "qmv_mma"), default="qmv_split")
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.kernel == "qmv_split":
        plan = qmv_split._launch_plan(1, a.n, "nvfp4", 16, mx.bfloat16)
        family = qmv_split.family("fp")
    else:
        plan = qmv_mma._launch_plan(1, a.n, a.k, "nvfp4", 16, mx.bfloat16)
        family = qmv_mma.family("fp")
    source = family.source(tuple(plan["template"]))
    Path(a.out).write_text(source)
    name = re.search(r'extern "C" __global__ void (\w+)\(', source).group(1)
    print(f"KNAME={name} template={plan['template']} grid={plan['grid']} threads={plan['threadgroup']}")


if __name__ == "__main__":
    main()
