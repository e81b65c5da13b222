"""How a decode step's time grows with its rows (issue 50): one compiled pass of R requests of
one row each over the KV pool, as the engine runs it, for R in --rows, plain (native forms, L = 0)
and deterministic (canonical forms at L = --limit, proven as `serve` proves them). Each step is
timed in three phases, interleaved in one process (round after round, every variant one step,
the order rotating): build (the Python call that makes the graph), submit (`mx.async_eval`:
MLX encodes and launches) and wait (until the device is done). Reports each variant's median
step, its ratio to the one-row step of its kind (paired rounds) and the phases.

--ncu R:KIND (KIND plain or det) instead profiles three steps of that variant inside a profiler
range, for Nsight Compute's kernel table (`bench/step_kernels.py --summarize` reads the CSV):

    ncu --profile-from-start off --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --csv python bench/step_rows.py --ncu 16:plain > ncu.csv

    python bench/step_rows.py [--weights nvfp4] [--rows 1,16,32] [--limit 8] [--rounds 20]
                              [--strategy auto | --strategy mma_rows,gemv_rows] [--shape smollm2]

--nodes instead counts the nodes of one step's graph by primitive (MLX's DOT export), each
variant and width, and what the deterministic step adds to the plain one at each width: what
the submit phase encodes.

--served SPEC [--quantize MODE] [--weights W] measures the model `serve` would load (its dtype on
this backend, models/activation_dtype.py) in place of a random one built in bfloat16: `--served
default --quantize nvfp4` is SmolLM2 as served; `--weights float32` beside it keeps the GGUF's
float32, as `serve --weights float32` does.

--shape moe measures Qwen3-30B-A3B's expert layout (bench/moe_8b.py's model, --layers of its
layers) as the engine serves it: R requests of one row each in a pass over the KV pool, where
moe_8b.py times R rows of one sequence (attention per query). The last column, a deterministic
step ÷ the plain one at its rows, is issue 50's MoE figure.

--qmv-mma-groups CG runs every qmv_mma call with CG column groups a block (0: the tile that reads
x from global memory, the staged tile's baseline in a step).

--strategy with several names measures a deterministic variant of each (`det-NAME`), all
interleaved in one process.

Small shapes for a check on the CPU: --layers 2 --hidden 512 --intermediate 1024 --vocab 4096
--kv-pool reference. Measures and prints; asserts nothing.
"""
import argparse
import collections
import ctypes
import re
import tempfile
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from invariant_8b import HBM_BYTES_PER_S, build, context, trim, weight_bytes  # noqa: E402
from lockstep.kernels.batching.compiled_pass import CompiledPasses, unavailable_reason  # noqa: E402
from lockstep.kernels.batching.ragged import ragged_logits  # noqa: E402
from lockstep.kernels.invariance.layers import calls_in_blocks, native_forms  # noqa: E402
from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402
from lockstep.server.engine.runner.model_runner import ModelRunner  # noqa: E402


def timed(run, caches, rounds_out: dict, name: str) -> None:
    t0 = time.perf_counter()
    out = run()
    t1 = time.perf_counter()
    mx.async_eval(out)
    t2 = time.perf_counter()
    mx.eval(out)
    t3 = time.perf_counter()
    for cache in caches:
        trim(cache, 1)
    rounds_out.setdefault(name, []).append((1e3 * (t3 - t0), 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2)))


def op_by_op(model, caches, canonical: bool):
    """A pass as the engine runs it where it cannot compile one (the pool's reference attention)."""
    def run():
        with (calls_in_blocks() if canonical else native_forms()):
            return ragged_logits(model, [(c, [11]) for c in caches])
    return run


def served(spec: str, weights: str, quantize: str | None):
    """The model `serve` loads from `spec` with `--weights weights` (quantized, in its served
    dtype; not audited)."""
    from lockstep.server.model_loading import load_audited

    loaded, _, transform = load_audited(spec, weights, quantize, None, None, audit="off")
    print(f"{spec}: {transform}", flush=True)
    return loaded.model


def graph_nodes(outputs) -> collections.Counter:
    """The nodes of the graph behind `outputs` (not yet evaluated), counted by primitive."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, outputs)
        return collections.Counter(re.findall(r'\[label ="([^"]+)", shape=rectangle\]', dot.read()))


def print_nodes(runs: dict) -> None:
    counts = {}
    for name, (run, caches) in runs.items():
        out = run()
        counts[name] = graph_nodes(out)
        mx.eval(out)  # a step as a timed one, then its rows trimmed
        for c in caches:
            trim(c, 1)
    print("\n| pass | rows | nodes | top primitives |")
    print("|---|---|---|---|")
    for (kind, r), c in counts.items():
        top = ", ".join(f"{p} {n}" for p, n in c.most_common(8))
        print(f"| {kind} | {r} | {sum(c.values())} | {top} |")
    for (kind, r), c in counts.items():
        plain = counts.get(("plain", r))
        if kind == "plain" or plain is None:
            continue
        more = {p: c[p] - plain[p] for p in set(c) | set(plain) if c[p] != plain[p]}
        diff = ", ".join(f"{p} {n:+d}" for p, n in sorted(more.items(), key=lambda kv: -abs(kv[1])))
        print(f"{kind} − plain at {r} rows: {sum(c.values()) - sum(plain.values()):+d} nodes ({diff or 'none'})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default=None,
                    help="the random model's weights, comma-separated (default nvfp4); with --served: "
                         "serve's --weights, e.g. float32 to keep a GGUF's dtype (default auto)")
    ap.add_argument("--rows", default="1,16,32")
    ap.add_argument("--limit", type=int, default=8, help="L of the deterministic variants (0: plain only)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--shape", choices=("8b", "smollm2", "moe", "moe-small"), default="8b",
                    help="smollm2: SmolLM2-135M's widths (30 layers, hidden 576, 9 / 3 heads of 64, "
                         "intermediate 1536, tied head of 49,152) in place of --layers/--hidden/--intermediate/--vocab; "
                         "moe: Qwen3-30B-A3B's expert layout (bench/moe_8b.py's, --layers of them; moe-small: "
                         "that layout shrunk, for the CPU)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--kv-pool", default="kernel")
    ap.add_argument("--ncu", default="", metavar="R:KIND", help="profile 3 steps of one variant (plain or det)")
    ap.add_argument("--served", default="", metavar="SPEC",
                    help="the model as `serve` loads SPEC (e.g. default), in place of --weights/--shape")
    ap.add_argument("--quantize", default=None, help="with --served: serve's --quantize")
    ap.add_argument("--nodes", action="store_true", help="count each step's graph nodes by primitive; no timing")
    ap.add_argument("--strategy", default="auto",
                    help="the deterministic variants' strategies, comma-separated (auto: the one the self-test keeps)")
    ap.add_argument("--qmv-mma-groups", type=int, default=None, metavar="CG",
                    help="qmv_mma's calls with CG column groups a block (0: the tile that reads x from "
                         "global memory; a launch shape: no bits change; default the kernel's own choice)")
    a = ap.parse_args()
    if a.qmv_mma_groups is not None:
        from lockstep.kernels.custom import qmv_mma

        qmv_mma.column_groups = lambda n, k, m, cg=a.qmv_mma_groups: cg
    widths = [int(r) for r in a.rows.split(",")]
    if a.ncu:
        r, kind = a.ncu.split(":")
        widths = [int(r)]
    print(f"backend {mx.default_device()}, MLX {mx.__version__}; context {a.context}, {a.rounds} rounds")
    for weights in ([a.served] if a.served else (a.weights or "nvfp4").split(",")):
        if a.served:
            model = served(a.served, a.weights or "auto", a.quantize)
        elif a.shape == "smollm2":
            model = build(weights, 30, hidden=576, intermediate=1536, vocab=49152, heads=(9, 3, 64), tied=True)
        elif a.shape.startswith("moe"):
            import moe_8b

            model = moe_8b.build(weights, a.layers, small=a.shape == "moe-small")
        else:
            model = build(weights, a.layers, hidden=a.hidden, intermediate=a.intermediate, vocab=a.vocab)
        floor_ms = 1e3 * weight_bytes(model) / HBM_BYTES_PER_S
        most = max(widths)
        path = ModelRunner.as_engine_runs(model, a.kv_pool, pool_tokens=most * (a.context + 8) + 64)
        pooled = [context(model, a.context, path.new_cache(a.context + 4), seed=1 + i) for i in range(most)]
        strategies = a.strategy.split(",")
        det = {"det" if len(strategies) == 1 else f"det-{name}": name for name in strategies}
        kinds = ["plain"] + (list(det) if a.limit > 0 else [])
        if a.ncu:
            kinds = [kind if kind == "plain" or len(det) == 1 else f"det-{strategies[0]}"]
        runs = {}
        for kind in kinds:
            if kind in det:
                t = time.perf_counter()
                installed = set_batch_invariant_limit(model, a.limit, det[kind])
                print(f"{weights}: L = {a.limit} installed and proven in {time.perf_counter() - t:.1f} s "
                      f"({getattr(installed, 'strategy', installed)})", flush=True)
            else:
                set_batch_invariant_limit(model, 0)
            not_compiled = unavailable_reason(path.kv_pool)
            passes = None if not_compiled else CompiledPasses(model, path.kv_pool)
            if not_compiled:
                print(f"{kind}: passes run op by op ({not_compiled})", flush=True)
            for r in widths:
                caches = pooled[:r]
                run = (lambda p, cs, canon: lambda: p.logits([(c, [11]) for c in cs], canonical=canon))(
                    passes, caches, kind in det) if passes else op_by_op(model, caches, kind in det)
                mx.eval(run())  # traced and compiled now
                for c in caches:
                    trim(c, 1)
                runs[(kind, r)] = (run, caches)
        if a.ncu:
            run, caches = runs[(kind, widths[0])]
            for _ in range(5):
                mx.eval(run())
                for c in caches:
                    trim(c, 1)
            cuda = ctypes.CDLL("libcuda.so.1")
            mx.synchronize()
            cuda.cuProfilerStart()
            for _ in range(3):
                mx.eval(run())
                for c in caches:
                    trim(c, 1)
            mx.synchronize()
            cuda.cuProfilerStop()
            return
        if a.nodes:
            print_nodes(runs)
            continue
        names = list(runs)
        samples: dict = {}
        for rnd in range(a.rounds + 1):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            got: dict = {}
            for name in order:
                run, caches = runs[name]
                timed(run, caches, got, name)
            if rnd:  # round 0 is a warm-up
                for name, v in got.items():
                    samples.setdefault(name, []).extend(v)
        model_name = f"{weights} as served" if a.served else f"{weights}, {a.shape} shape"
        print(f"\n## {model_name}: HBM floor {floor_ms:.2f} ms; L = {a.limit}")
        print("| pass | rows | median ms | build / submit / wait ms | ÷ its one-row step (paired) | ms a row "
              "| ÷ plain at these rows (paired) |")
        print("|---|---|---|---|---|---|---|")
        for kind, r in names:
            s = samples[(kind, r)]
            ms = statistics.median(x[0] for x in s)
            split = " / ".join(f"{statistics.median(x[i] for x in s):.2f}" for i in (1, 2, 3))
            one, plain = samples.get((kind, 1)), samples.get(("plain", r))
            ratio = statistics.median(x[0] / y[0] for x, y in zip(s, one)) if one else float("nan")
            to_plain = statistics.median(x[0] / y[0] for x, y in zip(s, plain)) if plain else float("nan")
            print(f"| {kind} | {r} | {ms:.2f} | {split} | {ratio:.2f} | {ms / r:.2f} | {to_plain:.2f} |")
        del model, runs, pooled, path
        mx.clear_cache()


if __name__ == "__main__":
    main()
