"""`lockstep convert SRC DST --quantize MODE`: write a quantized mlx-lm model directory."""
from __future__ import annotations

import argparse
import logging

from lockstep.server.options import QUANT_MODES

log = logging.getLogger("lockstep.convert")


def register(subparsers) -> None:
    parser = subparsers.add_parser("convert", help="quantize a model into an mlx-lm directory")
    parser.add_argument("src", help='"default", an mlx-lm/HF model directory or a .gguf file')
    parser.add_argument("dst", help="output directory (must not exist or be empty)")
    # --quantize as in serve and audit; --q-mode, its first name, still works
    parser.add_argument("--quantize", "--q-mode", dest="quantize", required=True, choices=QUANT_MODES,
                        help="quantization mode")
    parser.add_argument("--q-bits", type=int, default=None,
                        help="bits per weight (default: the mode's; affine 4)")
    parser.add_argument("--q-group-size", type=int, default=None,
                        help="group size (default: the mode's; affine 64, mxfp 32, nvfp4 16)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lockstep.models.errors import ModelError
    from lockstep.models.quantize import convert

    try:
        result = convert(args.src, args.dst, args.quantize, args.q_bits, args.q_group_size)
    except (ModelError, ValueError) as exc:
        log.error("%s", exc)
        return 1
    print(f"{result.dst}: {result.spec.label()}, {result.bits_per_weight:.2f} bits/weight, "
          f"{result.size_bytes / 1e6:.1f} MB on disk, {len(result.quantized)} layers quantized")
    if result.dense:
        print(f"WARNING: {len(result.dense)} layers left dense (float):")
        for d in result.dense:
            print(f"  {d.path} {list(d.shape)}: {d.reason}")
    return 0
