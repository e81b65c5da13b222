"""`lockstep bench`: ratios of deterministic vs native and speculative vs plain, in one run."""
from __future__ import annotations

import argparse

from lockstep.server.commands.runtime_args import (add_model_arguments, apply_cpu_blas, options_from_args)


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="measure deterministic-mode and speculative speed ratios")
    add_model_arguments(parser)
    parser.add_argument("--limit", type=int, default=8, help="batch-invariant limit L (default 8)")
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="k (default L-1)")
    parser.add_argument("--invariant-strategy", default="auto")
    parser.add_argument("--no-draft", action="store_true")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--early-exit", default=None, metavar="LAYER,LAYER,...",
                        help="only self-speculation: the target's first LAYER layers and its head "
                             "draft (k = --num-draft-tokens, default 3); acceptance and ÷ plain per layer")
    parser.add_argument("--kv-pool", choices=("auto", "on", "off"), default="auto",
                        help="--tasks: decode as the engine does, over its KV pool (auto: where the "
                             "GPU kernel is available)")
    parser.add_argument("--tasks", action="store_true",
                        help="only speculation by task kind: prompt lookup with fixed and adaptive k "
                             "÷ plain, deterministic, on copy-heavy tasks and an open-ended story")
    load = parser.add_argument_group("load over HTTP (with --concurrency)")
    load.add_argument("--concurrency", default=None, metavar="N,N,...",
                      help="streaming clients per round, e.g. 1,4,16,32: starts `lockstep serve` and "
                           "prints aggregate tok/s and p50/p99 time to first token and inter-token latency")
    load.add_argument("--against-mlx-lm", action="store_true",
                      help="also start mlx_lm.server on the same model directory and print the ratios")
    load.add_argument("--deterministic", action="store_true", help="clients send deterministic: true")
    load.add_argument("--mixed", action="store_true",
                      help="even clients send deterministic: true, odd ones not; 'changed' counts the "
                           "deterministic ones")
    load.add_argument("--max-tokens", type=int, default=128)
    load.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                      help="extra argument for `lockstep serve` (repeatable)")
    parser.set_defaults(func=run, batch_invariant_limit=None, speculative="none", draft_model=None,
                        max_draft_tokens=64,  # no server here: k is bounded only by L
                        prefill_chunk=512)


def run(args: argparse.Namespace) -> int:
    if args.concurrency:
        from lockstep.server.commands.load import run_load

        return run_load(args)
    apply_cpu_blas(args)
    import mlx.core as mx

    from lockstep.kernels import cpu_blas
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.server.bench import run_bench
    from lockstep.server.runtime import build_runtime

    args.batch_invariant_limit = args.limit
    args.draft_model = None if args.no_draft or args.tasks or args.early_exit else "default-quantized"
    runtime = build_runtime(options_from_args(args))
    model, plan = runtime.loaded.model, runtime.plan

    def set_limit(limit):
        set_batch_invariant_limit(model, limit, plan.strategy, verify=False)

    header = (f"backend {mx.default_device()}, MLX {mx.__version__}, BLAS {cpu_blas.describe()}, "
              f"model {runtime.loaded.name} ({runtime.transform}), L={args.limit}, deterministic, "
              f"{args.tokens} tokens, best of {args.rounds} rounds")
    if args.early_exit:
        from lockstep.server.bench import run_exit_layer_bench

        k = args.num_draft_tokens or 3
        set_limit(args.limit)
        layers = [int(x) for x in args.early_exit.split(",")]
        lines = [f"lockstep bench --early-exit: {header}, k={k}"]
        lines += run_exit_layer_bench(model, runtime.loaded.tokenizer, layers, k, args.tokens, args.rounds)
        print("\n".join(lines))
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
        return 0
    if args.tasks:
        from lockstep.server.bench import run_task_bench, task_table
        from lockstep.server.engine.speculative import measure_pass_costs

        from lockstep.server.engine.engine_path import EnginePath

        k = args.num_draft_tokens or max(1, args.limit - 1)
        set_limit(args.limit)
        path = EnginePath(model, runtime.deployment.kv_pool)  # ragged passes, as the engine decodes
        costs = measure_pass_costs(model, k + 1, path=path)
        results = run_task_bench(model, runtime.loaded.tokenizer, k, args.tokens, args.rounds, costs, path)
        lines = [f"lockstep bench --tasks: {header}, k={k} (adaptive: up to {k}), engine passes, "
                 f"KV pool {runtime.deployment.kv_pool}"] + task_table(results, costs)
        print("\n".join(lines))
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
        return 0
    results = run_bench(model, runtime.loaded.tokenizer, set_limit, args.limit,
                        runtime.deployment.draft_model, args.tokens, args.rounds,
                        args.prompt_tokens, args.num_draft_tokens)
    lines = [f"lockstep bench: backend {mx.default_device()}, MLX {mx.__version__}, BLAS "
             f"{cpu_blas.describe()}, model {runtime.loaded.name} ({runtime.transform}), L={args.limit}, "
             f"strategy {plan.strategy} (guaranteed {plan.guaranteed}), {args.tokens} tokens, "
             f"best of {args.rounds} rounds"]
    lines += [r.line() for r in results]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0
