"""`lockstep audit MODEL [--quantize MODE] [--fresh]`: print the quantized-kernel audit table.

Verdicts this machine already has are re-used (kernels/verdict_cache.py), as `serve` does;
`--fresh` probes every configuration again and stores the new verdicts.
"""
from __future__ import annotations

import argparse
import logging

from lockstep.server.options import DEFAULT_WEIGHTS, QUANT_MODES, WEIGHT_CHOICES

log = logging.getLogger("lockstep.audit")


def register(subparsers) -> None:
    parser = subparsers.add_parser("audit", help="audit a model's quantized kernels on this backend")
    parser.add_argument("model", help='"default", an mlx-lm directory or a .gguf file')
    parser.add_argument("--weights", default=DEFAULT_WEIGHTS, choices=WEIGHT_CHOICES,
                        help="GGUF import format (default auto; float32 when --quantize)")
    parser.add_argument("--quantize", choices=QUANT_MODES, default=None,
                        help="quantize in memory first, as `serve --quantize` would")
    parser.add_argument("--q-bits", type=int, default=None,
                        help="bits per weight with --quantize (default: the mode's; affine 4)")
    parser.add_argument("--q-group-size", type=int, default=None,
                        help="group size with --quantize (default: the mode's; affine 64, mxfp 32, nvfp4 16)")
    parser.add_argument("--prompt-rows", type=int, default=None,
                        help="rows of the prompt-sized matmul probe")
    parser.add_argument("--fresh", action="store_true",
                        help="probe again instead of re-using this machine's cached verdicts")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lockstep.kernels.audit import apply_workarounds, audit_model, audit_verdict_cache, format_table
    from lockstep.models.errors import ModelError
    from lockstep.server.model_loading import load_served

    try:
        loaded, _ = load_served(args.model, args.weights, args.quantize, args.q_bits, args.q_group_size)
        kwargs = {"prompt_rows": args.prompt_rows} if args.prompt_rows else {}
        report = audit_model(loaded.model, cache=audit_verdict_cache(), fresh=args.fresh,
                             **kwargs)
    except (ModelError, ValueError) as exc:
        log.error("%s", exc)
        return 1
    print(format_table(report))
    try:
        apply_workarounds(loaded.model, report)
    except ModelError as exc:
        print(f"REFUSED: {exc}")
        return 2
    return 0
