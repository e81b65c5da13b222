"""Flags that choose what a deployment runs (shared by serve, verify and bench)."""
from __future__ import annotations

import argparse

from lockstep.kernels import cuda_graphs
from lockstep.server.early_blas import auto_cpu_blas
from lockstep.server.engine.guarantee.deployment import CPU_PLAIN_PREFILL_CHUNK, CPU_PREFILL_CHUNK, PREFILL_CHUNK
from lockstep.server.options import (AUDIT_MODES, CPU_BLAS_CHOICES, DEFAULT_AUDIT, DEFAULT_CPU_BLAS,
                                     DEFAULT_KV_POOL, DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_MODEL,
                                     DEFAULT_NUM_DRAFT_TOKENS, DEFAULT_PREFILL_CHUNK, DEFAULT_SPECULATIVE,
                                     DEFAULT_STRATEGY, DEFAULT_WEIGHTS, INVARIANT_STRATEGIES, KV_POOL_MODES,
                                     QUANT_MODES, SPECULATIVE_METHODS, WEIGHT_CHOICES)
from lockstep.server.runtime import Options, limit_from_env


class _RepeatedModel(argparse.Action):
    """`--model` once: the spec, a string as every command has it; again: the list of them all."""

    def __call__(self, parser, namespace, value, option_string=None):
        given = getattr(namespace, "_models_given", [])
        namespace._models_given = given + [value]
        setattr(namespace, self.dest, value if not given else given + [value])


def add_model_argument(parser: argparse.ArgumentParser, repeatable: bool = False) -> None:
    if repeatable:  # serve: several models, each --model NAME=SPEC or SPEC (server/commands/models_config.py)
        parser.add_argument("--model", action=_RepeatedModel, default=DEFAULT_MODEL, metavar="[NAME=]SPEC",
                            help='"default" (the embedded SmolLM2-135M-Instruct; the default), an mlx-lm dir '
                                 'or a .gguf; given more than once (NAME= names each), one server serves them all')
        return
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help='"default" (the embedded SmolLM2-135M-Instruct), an mlx-lm dir or a .gguf')


def add_cpu_blas_argument(parser: argparse.ArgumentParser, default: str = DEFAULT_CPU_BLAS) -> None:
    parser.add_argument("--cpu-blas", choices=CPU_BLAS_CHOICES, default=default,
                        help="BLAS for MLX's CPU float32 matmuls on Linux: OpenBLAS through a "
                             "preloaded shim (much faster; results vary by shape, which batch "
                             "invariance routes around) or the bundled reference BLAS. auto: "
                             "OpenBLAS when MLX runs on the CPU, where `--weights auto` then picks "
                             f"float32 (README: the CPU default). Default {default}")


def add_limit_argument(parser: argparse.ArgumentParser, default: int | None, help: str,
                       also: tuple[str, ...] = ()) -> None:
    """L under one name in every command (`also`: older names that keep working)."""
    parser.add_argument("--batch-invariant-limit", *also, dest="batch_invariant_limit", type=int,
                        default=default, metavar="L", help=help)


def add_strategy_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--invariant-strategy", default=DEFAULT_STRATEGY, choices=INVARIANT_STRATEGIES,
                        help="canonical kernel form (default auto: fastest proven by the self-test)")


def add_kv_pool_argument(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--kv-pool", choices=KV_POOL_MODES, default=DEFAULT_KV_POOL, help=help)


def add_model_arguments(parser: argparse.ArgumentParser, repeatable: bool = False) -> None:
    add_model_argument(parser, repeatable)
    parser.add_argument("--weights", default=DEFAULT_WEIGHTS, choices=WEIGHT_CHOICES,
                        help="weight format for GGUF imports (default auto: fastest on this backend)")
    parser.add_argument("--quantize", choices=QUANT_MODES, default=None,
                        help="quantize at load time with mlx-lm's quantizer")
    parser.add_argument("--q-bits", type=int, default=None,
                        help="bits per weight with --quantize (default: the mode's; affine 4)")
    parser.add_argument("--q-group-size", type=int, default=None,
                        help="group size with --quantize (default: the mode's; affine 64, mxfp 32, nvfp4 16)")
    add_cpu_blas_argument(parser)
    parser.add_argument("--cuda-graphs", choices=cuda_graphs.CHOICES, default=cuda_graphs.DEFAULT,
                        help="MLX CUDA backend: record kernels into CUDA graphs (on) or launch each "
                             f"directly (off). auto: {cuda_graphs.ENV} where it is set, else MLX's "
                             f"default (on). Default {cuda_graphs.DEFAULT}")
    parser.add_argument("--fuse-projections", action="store_true",
                        help="run q/k/v and gate/up each as one matmul (fewer launches per decode "
                             "step; the weights are concatenated, not copied)")
    parser.add_argument("--audit", choices=AUDIT_MODES, default=DEFAULT_AUDIT,
                        help="quantized-kernel audit and self-test proofs: re-use this machine's "
                             "verdicts (cached, default), redo them (fresh), or skip the audit (off: "
                             "warned, shown in /v1/models and the fingerprint)")


def add_determinism_arguments(parser: argparse.ArgumentParser) -> None:
    add_limit_argument(parser, None, help="rows per forward pass that must match single-row bits (0 = off; env "
                                          "LOCKSTEP_BATCH_INVARIANT_LIMIT or MLX_METAL_BATCH_INVARIANT_LIMIT)")
    add_strategy_argument(parser)
    parser.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=DEFAULT_SPECULATIVE,
                        help="default speculative method for requests that do not choose one")
    parser.add_argument("--num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT_TOKENS,
                        help="default drafts per speculative step (k) for requests that set none")
    parser.add_argument("--adaptive-speculation", action="store_true",
                        help="choose each step's number of drafts (0..k) from the request's own "
                             "acceptance and the measured cost of wider passes (startup measures it)")
    parser.add_argument("--draft-backoff", choices=("on", "off"), default="on",
                        help="without --adaptive-speculation, prompt lookup and predictions stop "
                             "verifying drafts after a miss until a draft agrees again (default on; "
                             "off: every step verifies k drafts, for comparison)")
    parser.add_argument("--max-draft-tokens", type=int, default=DEFAULT_MAX_DRAFT_TOKENS,
                        help=f"largest k a request may ask for; larger gets 400. A draft model runs k "
                             f"passes in one engine step, so this bounds how long one request holds "
                             f"the engine (default {DEFAULT_MAX_DRAFT_TOKENS})")
    parser.add_argument("--draft-model", default=None,
                        help='draft model for speculative decoding: a model spec or "default-quantized"')
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                        help=f"prompt tokens per prefill pass (default {PREFILL_CHUNK}; {CPU_PREFILL_CHUNK} on the CPU, "
                             f"where a wider deterministic chunk holds other requests for seconds); part of "
                             f"the fingerprint. On the CPU a plain (non-deterministic) prompt goes in chunks "
                             f"of at most {CPU_PLAIN_PREFILL_CHUNK}, so a long one holds other requests less")
    add_kv_pool_argument(parser, "keep all requests' KV in one pool so a batched pass runs one attention "
                                 "launch per layer (auto: where the GPU kernel is available; on: also "
                                 "elsewhere, one attention call per row; default auto)")


def options_from_args(args: argparse.Namespace) -> Options:
    limit = args.batch_invariant_limit
    if limit is None:
        limit = limit_from_env()
    if limit < 0:
        raise SystemExit("--batch-invariant-limit must be >= 0")
    return Options(
        model=args.model, weights=args.weights, quantize=args.quantize, q_bits=args.q_bits,
        q_group_size=args.q_group_size, batch_invariant_limit=limit,
        invariant_strategy=args.invariant_strategy, speculative=args.speculative,
        num_draft_tokens=args.num_draft_tokens, max_draft_tokens=args.max_draft_tokens,
        adaptive_speculation=getattr(args, "adaptive_speculation", False),
        draft_backoff=getattr(args, "draft_backoff", "on") == "on",
        draft_model=args.draft_model, fuse_projections=getattr(args, "fuse_projections", False),
        prefill_chunk=args.prefill_chunk, audit=getattr(args, "audit", DEFAULT_AUDIT),
        kv_pool=getattr(args, "kv_pool", "off"),
        **({"max_batch_rows": args.max_batch_rows} if getattr(args, "max_batch_rows", None) else {}),
        async_eval_layers=getattr(args, "async_eval_layers", 0),
        compiled_passes=getattr(args, "compiled_passes", "on") == "on",
        decode_ahead=getattr(args, "decode_ahead", "on") == "on",
    )


def apply_cuda_graphs(args: argparse.Namespace) -> None:
    """How MLX's CUDA backend launches kernels in this process (before MLX runs anything)."""
    cuda_graphs.apply(getattr(args, "cuda_graphs", cuda_graphs.DEFAULT))


def apply_cpu_blas(args: argparse.Namespace) -> None:
    """Re-exec with the OpenBLAS shim preloaded when asked (before MLX runs anything)."""
    import sys

    if args.cpu_blas == "auto":
        args.cpu_blas = auto_cpu_blas()
    if args.cpu_blas == "openblas" and sys.platform.startswith("linux"):
        from lockstep.kernels.cpu_blas import ensure_preloaded

        ensure_preloaded(choice="openblas")
