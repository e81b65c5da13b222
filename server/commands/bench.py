"""`lockstep bench`: ratios of deterministic vs native and speculative vs plain, in one run.

Four modes: the speed ratios (default), `--tasks` (speculation by task kind, as the engine
decodes), `--early-exit` (self-speculation per exit layer), and `--concurrency` (N
streaming clients over HTTP against a `lockstep serve` it starts, and mlx_lm.server with
`--against-mlx-lm`). The measurements themselves are in server/tools/.
"""
from __future__ import annotations

import argparse
import dataclasses
import socket
import statistics
import subprocess
import sys

from lockstep.server.commands.runtime_args import (add_kv_pool_argument, add_limit_argument, add_model_arguments,
                                                   add_strategy_argument, apply_cpu_blas, apply_cuda_graphs,
                                                   options_from_args)
from lockstep.server.options import DEFAULT_MEASURE_LIMIT, DEFAULT_MEASURE_TOKENS, DEFAULT_PREFILL_CHUNK


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="measure deterministic-mode and speculative speed ratios")
    add_model_arguments(parser)
    add_limit_argument(parser, DEFAULT_MEASURE_LIMIT, f"batch-invariant limit L (default {DEFAULT_MEASURE_LIMIT})",
                       also=("--limit",))
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="k (default L-1)")
    add_strategy_argument(parser)
    parser.add_argument("--no-draft", action="store_true", help="skip the draft-model method")
    parser.add_argument("--tokens", type=int, default=DEFAULT_MEASURE_TOKENS,
                        help=f"tokens decoded per measurement (default {DEFAULT_MEASURE_TOKENS})")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="prompt length of the prefill measurement (default 512)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds per figure (best of; with --concurrency the median of at least 3, "
                             "each concurrency first warmed by an unmeasured round)")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument("--early-exit", default=None, metavar="LAYER,LAYER,...",
                        help="only self-speculation: the target's first LAYER layers and its head "
                             "draft (k = --num-draft-tokens, default 3); acceptance and ÷ plain per layer")
    add_kv_pool_argument(parser, "--tasks: decode as the engine does, over its KV pool (auto: where the "
                                 "GPU kernel is available)")
    parser.add_argument("--tasks", action="store_true",
                        help="only speculation by task kind: prompt lookup with fixed and adaptive k "
                             "÷ plain, deterministic, on copy-heavy tasks and an open-ended story; then "
                             "Predicted Outputs (the answer, or the text it edits, as the prediction) ÷ plain")
    load = parser.add_argument_group("load over HTTP (with --concurrency)")
    load.add_argument("--concurrency", default=None, metavar="N,N,...",
                      help="streaming clients per round, e.g. 1,4,16,32: starts `lockstep serve` (on --model as "
                           "given: a GGUF is imported as `serve` would) and prints aggregate tok/s and p50/p99 "
                           "time to first token and inter-token latency")
    load.add_argument("--against-mlx-lm", action="store_true",
                      help="also start mlx_lm.server on the same model directory and print the ratios "
                           "(every server is up at once and the rounds alternate between them)")
    load.add_argument("--against-deterministic", default=None, metavar="L,L,...",
                      help="also start one deterministic lockstep server per L (its clients send "
                           "deterministic: true) and print deterministic / plain; L:STRATEGY serves it "
                           "with --invariant-strategy STRATEGY, e.g. 8,8:skinny")
    load.add_argument("--against-config", action="append", default=[], metavar="NAME=ARGS",
                      help="also start a plain lockstep server with these extra serve arguments and print "
                           "NAME / lockstep, e.g. graphs=--cuda-graphs=on (repeatable)")
    load.add_argument("--one-server-at-a-time", action="store_true",
                      help="start each server alone, measure every concurrency on it, stop it, then the "
                           "next (a GPU that cannot hold every server at once: each sizes its memory from "
                           "the whole card unless --serve-arg=--memory-limit=BYTES gives lockstep's its "
                           "share); ratios then compare rounds taken minutes apart")
    load.add_argument("--deterministic", action="store_true", help="clients send deterministic: true")
    load.add_argument("--mixed", action="store_true",
                      help="even clients send deterministic: true, odd ones not; 'changed' counts the "
                           "deterministic ones")
    load.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each client's request (default 128)")
    load.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                      help="extra argument for `lockstep serve` (repeatable)")
    parser.set_defaults(func=run, speculative="none", draft_model=None,
                        max_draft_tokens=64,  # no server here: k is bounded only by L
                        prefill_chunk=DEFAULT_PREFILL_CHUNK)


def run(args: argparse.Namespace) -> int:
    if args.concurrency:
        return run_load(args)
    apply_cuda_graphs(args)
    apply_cpu_blas(args)
    import mlx.core as mx

    from lockstep.kernels import cpu_blas
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.server.runtime import build_runtime
    from lockstep.server.tools.speed_ratios import run_bench

    limit = args.batch_invariant_limit
    args.draft_model = None if args.no_draft or args.tasks or args.early_exit else "default-quantized"
    # the bench measures drafting itself: its draft is loaded whatever it costs here
    runtime = build_runtime(dataclasses.replace(options_from_args(args), draft_where_it_pays=False))
    model, invariance = runtime.loaded.model, runtime.invariance

    def set_limit(limit):
        set_batch_invariant_limit(model, limit, invariance.strategy, verify=False)

    header = (f"backend {mx.default_device()}, MLX {mx.__version__}, BLAS {cpu_blas.describe()}, "
              f"model {runtime.loaded.name} ({runtime.transform}), L={limit}, deterministic, "
              f"{args.tokens} tokens, best of {args.rounds} rounds")
    if args.early_exit:
        from lockstep.server.tools.speed_ratios import run_exit_layer_bench

        k = args.num_draft_tokens or 3
        set_limit(limit)
        layers = [int(x) for x in args.early_exit.split(",")]
        lines = [f"lockstep bench --early-exit: {header}, k={k}"]
        lines += run_exit_layer_bench(model, runtime.loaded.tokenizer, layers, k, args.tokens, args.rounds)
        return _report(lines, args.out)
    if args.tasks:
        from lockstep.server.engine.runner.model_runner import ModelRunner
        from lockstep.server.engine.decoding.speculative import measure_pass_costs
        from lockstep.server.tools.speed_ratios import (prediction_table, run_prediction_bench, run_task_bench,
                                                        task_table)

        k = args.num_draft_tokens or max(1, limit - 1)
        set_limit(limit)
        runner = ModelRunner.as_engine_runs(model, runtime.deployment.kv_pool)  # ragged passes, as the engine decodes
        costs = measure_pass_costs(model, k + 1, runner=runner)
        results = run_task_bench(model, runtime.loaded.tokenizer, k, args.tokens, args.rounds, costs, runner)
        lines = [f"lockstep bench --tasks: {header}, k={k} (adaptive: up to {k}), engine passes, "
                 f"KV pool {runtime.deployment.kv_pool}"] + task_table(results, costs)
        predicted = run_prediction_bench(model, runtime.loaded.tokenizer, k, args.tokens, args.rounds, runner)
        lines += ["", f"Predicted Outputs (drafts from the request's prediction), k={k}:"] + prediction_table(predicted)
        return _report(lines, args.out)
    results = run_bench(model, runtime.loaded.tokenizer, set_limit, limit,
                        runtime.deployment.draft_model, args.tokens, args.rounds,
                        args.prompt_tokens, args.num_draft_tokens)
    lines = [f"lockstep bench: backend {mx.default_device()}, MLX {mx.__version__}, BLAS "
             f"{cpu_blas.describe()}, model {runtime.loaded.name} ({runtime.transform}), L={limit}, "
             f"strategy {invariance.strategy} (guaranteed {invariance.guaranteed}), {args.tokens} tokens, "
             f"best of {args.rounds} rounds"]
    lines += [r.line() for r in results]
    return _report(lines, args.out)


def _report(lines: list[str], out: str | None) -> int:
    print("\n".join(lines))
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


# --- `--concurrency`: lockstep (and mlx_lm.server) under N streaming clients, side by side in
# one run, on the same model directory ---

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], log_path: str | None) -> subprocess.Popen:
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


PEER = "mlx_lm.server"


def _is_lockstep(server: dict) -> bool:
    """Whether a measured server is a lockstep one (its /metrics has lockstep's counters)."""
    return server["name"] != PEER


def _server_rounds(servers: list[dict], levels: list[int], args) -> dict:
    """Each concurrency warmed with an unmeasured round on every server, then at least 3
    measured rounds taken in turn across the servers (tools/http_load.py `interleaved_rounds`),
    the median of each printed. A server: name, url, model and extra (request fields for every
    client, or a function of the client index). Each round's answers are then compared with the
    same requests sent alone (after the measured rounds: they warm nothing measured), and each
    lockstep server's decode passes of the measured rounds are printed (count and mean seconds
    by kind, from its /metrics). Returns name -> (the median round, every measured round in the
    order taken) per concurrency."""
    from lockstep.server.tools.http_load import (changed_answers, extra_for, interleaved_rounds, pass_seconds,
                                                 pass_seconds_line, solo_texts, summary_line)

    ours = [s for s in servers if _is_lockstep(s)]
    results = {s["name"]: [] for s in servers}
    for n in levels:
        before = {}
        both = interleaved_rounds([(s["url"], s["model"], s["extra"]) for s in servers], n, args.max_tokens, args.rounds,
                                  after_warm=lambda: before.update({s["name"]: pass_seconds(s["url"]) for s in ours}))
        after = {s["name"]: pass_seconds(s["url"]) for s in ours}
        for s, (median, rounds) in zip(servers, both):
            extra = s["extra"]
            # With mixed clients only the deterministic ones are promised their solo answer;
            # answers are checked in every measured round.
            watched = ({i for i in range(n) if extra_for(extra, i).get("deterministic")}
                       if callable(extra) else None)
            changed = (sum(changed_answers(r, solo_texts(s["url"], s["model"], n, args.max_tokens, extra, r.tag),
                                           watched) for r in rounds) if n > 1 else None)
            of = len(rounds) * (n if watched is None else len(watched))
            print(summary_line(s["name"], median, changed, of) + f"   (median of {len(rounds)}: "
                  + ", ".join(f"{r.tok_per_s:.1f}" for r in rounds) + ")", flush=True)
            results[s["name"]].append((median, rounds))
        for s in ours:  # each server's own decode step, beside what its clients saw
            print(f"{s['name']}: decode passes of the measured rounds at {n} clients: "
                  f"{pass_seconds_line(before.get(s['name']), after[s['name']])}", flush=True)
    return results


def _measured_servers(plans: list, model_dir, levels: list[int], args) -> tuple[list[dict], dict]:
    """Start the servers of `plans` together, measure them side by side (`_server_rounds`), stop them."""
    from lockstep.server.tools.http_load import decode_ahead_line, wait_healthy

    servers, procs = [], []
    try:
        for name, make, limit, server_extra, ready in plans:
            port = _free_port()
            log_path = f"{args.out}.{name.replace(' ', '_').replace('=', '')}.log" if args.out else None
            procs.append(_start(make(port, limit), log_path))
            servers.append({"name": name, "url": f"http://127.0.0.1:{port}", "ready": ready, "extra": server_extra,
                            "model": str(model_dir) if name == PEER else "default"})
        for server, proc in zip(servers, procs):
            wait_healthy(server["url"], server["ready"], 600, proc)
            server["url"] += "/v1"
        rounds = _server_rounds(servers, levels, args)
        for server in servers:
            if _is_lockstep(server):
                print(f"{server['name']}: decode passes built ahead {decode_ahead_line(server['url'])}", flush=True)
        return servers, rounds
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


def _ratio(a, b) -> float:
    return a.tok_per_s / b.tok_per_s if b.tok_per_s else float("nan")


def paired_ratios(pairs: list) -> str:
    """The ratio of each pair of rounds taken one after the other (the machine's drift between
    them is small), and their median: ', paired rounds 1.12 0.96 0.80, median 0.96'."""
    ratios = [_ratio(a, b) for a, b in pairs]
    if not ratios:
        return ""
    return (", paired rounds " + " ".join(f"{r:.2f}" for r in ratios)
            + f", median {statistics.median(ratios):.2f}")


def _deterministic_servers(spec: str | None) -> list[tuple[str, int, str | None]]:
    """--against-deterministic "8,16,8:skinny" -> [(server name, L, strategy or None), ...]."""
    servers = []
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        limit, _, strategy = item.strip().partition(":")
        try:
            value = int(limit)
        except ValueError:
            value = 0
        if value < 1:
            raise SystemExit("--against-deterministic takes limits L >= 1, each optionally L:STRATEGY, e.g. 8,16,8:skinny")
        servers.append((f"det L={value}" + (f" {strategy}" if strategy else ""), value, strategy or None))
    return servers


def _config_servers(specs: list[str]) -> list[tuple[str, list[str]]]:
    """--against-config "graphs=--cuda-graphs=on" -> [(server name, extra serve arguments), ...]."""
    import shlex

    servers = []
    for spec in specs:
        name, sep, extra = spec.partition("=")
        name = name.strip()
        if not sep or not name or name[0] == "-" or name == "lockstep" or name.startswith("det") or " " in name:
            raise SystemExit("--against-config takes NAME=ARGS (NAME not lockstep and not starting with det), "
                             "e.g. graphs=--cuda-graphs=on")
        servers.append((name, shlex.split(extra)))
    return servers


def run_load(args: argparse.Namespace) -> int:
    from lockstep.models.resolve import gguf_source, resolve_model
    from lockstep.server.tools.http_load import HEADER, mixed_extra

    apply_cpu_blas(args)  # as serve would: both servers below inherit the BLAS choice

    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise SystemExit("--concurrency takes positive integers, e.g. 1,4,16,32")
    limits = _deterministic_servers(args.against_deterministic)
    configs = _config_servers(args.against_config)
    model_dir = resolve_model(args.model, args.weights)
    # lockstep serves the model as `serve --model` would have it: a GGUF (the default one too)
    # is imported by the server itself, so --quantize starts from its float32 import and its
    # float32 parameters take the GPU's 16-bit dtype; its import directory would be served as
    # it is. mlx_lm.server reads the import directory.
    served = ["--model", args.model, "--weights", args.weights] if gguf_source(args.model) else ["--model", str(model_dir)]
    print(f"lockstep bench --concurrency {args.concurrency}: model {model_dir}, {args.max_tokens} tokens "
          f"per request, greedy, streamed" + (", deterministic" if args.deterministic else "")
          + (", mixed (even clients deterministic; changed counts those)" if args.mixed else "")
          + (f"; beside deterministic servers {', '.join(name for name, _, _ in limits)}" if limits else "")
          + "".join(f"; beside {name} ({' '.join(extra)})" for name, extra in configs)
          + ("; beside mlx_lm.server" if args.against_mlx_lm else "") + "; rounds alternate between servers")
    print(HEADER, flush=True)

    def lockstep_cmd(port: int, limit: int | None, strategy: str | None = None, extra: tuple = ()) -> list[str]:
        cmd = [sys.executable, "-m", "lockstep.server.cli", "serve", *served, "--port", str(port),
               "--max-active", str(max(levels)), "--max-queue", str(max(levels)), "--cuda-graphs", args.cuda_graphs,
               *args.serve_arg, *extra]
        cmd += ["--invariant-strategy", strategy] if strategy else []
        return cmd + (["--batch-invariant-limit", str(limit)] if limit is not None else [])

    extra = mixed_extra if args.mixed else {"deterministic": True} if args.deterministic else {}
    own_limit = args.batch_invariant_limit if (args.deterministic or args.mixed) else None
    plans = [("lockstep", lockstep_cmd, own_limit, extra, "/health")]
    plans += [(name, lambda port, limit, strategy=strategy: lockstep_cmd(port, limit, strategy), limit,
               {"deterministic": True}, "/health") for name, limit, strategy in limits]
    plans += [(name, lambda port, _, extra=extra: lockstep_cmd(port, None, extra=tuple(extra)), None, {}, "/health")
              for name, extra in configs]
    if args.against_mlx_lm:
        plans.append((PEER, lambda port, _: [sys.executable, "-m", "mlx_lm.server", "--model",
                                                         str(model_dir), "--port", str(port)], None, {}, "/v1/models"))
    groups = [[plan] for plan in plans] if args.one_server_at_a_time else [plans]
    servers, rows = [], {}
    for group in groups:
        started = _measured_servers(group, model_dir, levels, args)
        servers += started[0]
        rows.update(started[1])
    for other in [s["name"] for s in servers[1:]]:
        over_ours = other != PEER  # deterministic and other configurations: theirs / lockstep
        print(f"ratios {other} / lockstep (aggregate tok/s):" if over_ours
              else f"ratios lockstep / {other} (aggregate tok/s):")
        for (ours, our_rounds), (theirs, their_rounds) in zip(rows["lockstep"], rows[other]):
            a, b = (theirs, ours) if over_ours else (ours, theirs)
            pairs = list(zip(their_rounds, our_rounds) if over_ours else zip(our_rounds, their_rounds))
            print(f"  concurrency {ours.concurrency:>3}: {_ratio(a, b):.2f}x" + paired_ratios(pairs), flush=True)
    return 0
