"""`lockstep verify`: the divergence matrix of deterministic mode on this backend."""
from __future__ import annotations

import argparse
import logging

from lockstep.server.commands.runtime_args import (add_cpu_blas_argument, add_limit_argument, add_model_argument,
                                                   add_strategy_argument, apply_cpu_blas, apply_cuda_graphs)
from lockstep.server.options import DEFAULT_MEASURE_LIMIT, DEFAULT_MEASURE_TOKENS, QUANT_MODES, WEIGHT_CHOICES

log = logging.getLogger("lockstep.verify")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify", help="print divergent-token/logit counts: speculative and concurrent vs plain decoding")
    add_model_argument(parser)
    parser.add_argument("--variants", default="q4",
                        help=f"comma-separated weight formats {WEIGHT_CHOICES[1:]} or quantization "
                             f"modes {QUANT_MODES} (default q4)")
    add_limit_argument(parser, DEFAULT_MEASURE_LIMIT, f"batch-invariant limit L (default {DEFAULT_MEASURE_LIMIT})",
                       also=("--limit",))
    parser.add_argument("--tokens", type=int, default=DEFAULT_MEASURE_TOKENS,
                        help=f"tokens decoded per prompt (default {DEFAULT_MEASURE_TOKENS})")
    parser.add_argument("--widths", default=None, help="verification widths to test (default 2..L)")
    parser.add_argument("--no-draft", action="store_true", help="skip the draft-model method")
    add_strategy_argument(parser)
    # The reference BLAS by default: the matrix is about the kernels' own invariance.
    add_cpu_blas_argument(parser, default="reference")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.set_defaults(func=run)


def _options(args, variant: str, draft: bool):
    from lockstep.server.runtime import Options

    weights, quantize = ("auto", variant) if variant in QUANT_MODES else (variant, None)
    if variant not in QUANT_MODES and variant not in WEIGHT_CHOICES:
        raise SystemExit(f"unknown variant {variant!r}")
    return Options(model=args.model, weights=weights, quantize=quantize,
                   batch_invariant_limit=args.batch_invariant_limit, invariant_strategy=args.invariant_strategy,
                   draft_model="default-quantized" if draft else None, draft_where_it_pays=False)


def run(args: argparse.Namespace) -> int:
    apply_cuda_graphs(args)
    apply_cpu_blas(args)
    import mlx.core as mx

    from lockstep.kernels import cpu_blas
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.server.runtime import build_runtime
    from lockstep.server.tools import divergence

    limit = args.batch_invariant_limit
    if limit < 2:
        raise SystemExit("--batch-invariant-limit must be >= 2 (speculative verification needs 2 rows)")
    widths = [int(w) for w in args.widths.split(",")] if args.widths else None
    lines = [f"lockstep verify: backend {mx.default_device()}, MLX {mx.__version__}, "
             f"BLAS {cpu_blas.describe()}, L={limit}, {args.tokens} tokens x "
             f"{len(divergence.PROMPTS)} prompts per cell", divergence.HEADER]
    print("\n".join(lines), flush=True)
    rows, draft_model = [], None
    for n, variant in enumerate(args.variants.split(",")):
        runtime = build_runtime(_options(args, variant, draft=not args.no_draft and n == 0))
        draft_model = draft_model or runtime.deployment.draft_model
        invariance = runtime.invariance
        lines.append(f"# {variant}: strategy {invariance.strategy}, guaranteed {invariance.guaranteed} "
                     f"({invariance.reason})")
        print(lines[-1], flush=True)
        tok = runtime.loaded.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                   for p in divergence.PROMPTS]
        model = runtime.loaded.model

        def set_limit(limit, model=model, strategy=invariance.strategy):
            # the strategy was proven at startup; re-installing it needs no second proof
            set_batch_invariant_limit(model, limit, strategy, verify=False)

        def emit(line):
            lines.append(line)
            print(line, flush=True)

        rows += divergence.verify_variant(variant, model, draft_model, prompts, limit, args.tokens,
                                          widths, set_limit, emit)
    for line in divergence.summary_lines(rows):
        emit(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    on_total = sum(r.tokens + r.logits for r in rows if not r.control)
    return 0 if on_total == 0 else 1
