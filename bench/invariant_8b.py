"""Batch-invariant cost at a real model size: a Llama-3-8B-shaped model with random weights
built in memory (no download; speed does not depend on the weights' values).

For bf16, nvfp4 and affine-4 (g64) weights and B = 1, 8, 16, 32 rows after a 512-token
context, it times one forward step for native MLX and each strategy installed with L = B,
gives % of the HBM floor (every weight byte read once at 4.8 TB/s) and checks every row of
the B-row step bitwise against that row fed alone (same strategy, same cache). It also runs
the startup self-test for the custom-kernel strategies at L = 32, and (--check) compares the kernels
with the NumPy model of their loop order. Measures and prints; asserts nothing.

    python bench/invariant_8b.py [--weights bf16,nvfp4,affine4] [--rows 1,8,16,32]
                                 [--layers 32] [--check] [--kv-pool] [--fuse] [--out table.md]

--fuse: the model with q/k/v and gate/up fused (`serve --fuse-projections`) for every row of
the table, native included; compare with a run without it. --fuse-lockstep: every strategy
but native fused (native stays mlx-lm's own step, on an unfused copy of the same weights).

--kv-pool: every strategy but native runs as lockstep's engine runs it (a ragged pass of one
request over the KV pool: one KV write and one attention launch per layer, decode included);
native stays the plain mlx-lm call, the stock baseline; lockstep_native is lockstep's own
plain step (no canonical forms) over the pool, lockstep_compiled the same pass compiled
(kernels/batching/compiled_pass.py: one traced call a pass). gemv_rows runs quantized rows
through qmv_rows (one row: MLX's own quantized GEMV).
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from lockstep.kernels import custom  # noqa: E402
from lockstep.kernels.batching.compiled_pass import CompiledPasses  # noqa: E402
from lockstep.kernels.custom import loop_order, mma_order, skinny, split_attention  # noqa: E402
from lockstep.kernels.invariance import set_batch_invariant_limit  # noqa: E402
from lockstep.kernels.invariance.layers import native_forms, uninstall  # noqa: E402
from lockstep.kernels.invariance.selftest import bits_equal  # noqa: E402
from lockstep.server.engine.runner.model_runner import ModelRunner  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
WEIGHTS = {"bf16": None, "nvfp4": ("nvfp4", 16, 4), "affine4": ("affine", 64, 4)}
# "native": mlx-lm's own step (its model call, its caches, MLX's calls); "lockstep_native":
# lockstep's plain step (no canonical forms) over the engine's KV pool, as non-deterministic
# passes run with L = 0 (large 4-bit layers through qmv_split on CUDA); "lockstep_compiled": that
# pass as one compiled call (CompiledPasses); "plain_installed": lockstep_native with gemv_rows
# installed (L = B) and the pass under native_forms, as the engine runs non-deterministic passes
# of a deployment with L > 0; "gemv_rows_compiled": gemv_rows's
# installed pass compiled as the engine compiles deterministic passes where the ragged proof
# held for them; "..._separate": the same with each sibling layer (q/k/v, gate/up) in its own
# launch, as before sibling groups (kernels/invariance/sibling_rows.py); "..._grouped": sibling
# groups at every width, one plain row included (split_rows.parts_take); "..._pooled": plain
# passes with the pooled attention instead of the split kernel (kv_pool.pass_attention)
STRATEGIES = ("native", "lockstep_native", "lockstep_compiled", "lockstep_compiled_pooled", "lockstep_compiled_separate",
              "lockstep_compiled_grouped", "plain_installed", "strided_gemv", "gemv_rows", "gemv_rows_compiled",
              "gemv_rows_compiled_separate", "gemv_rows_compiled_grouped", "skinny")
_PARTS_TAKE = custom.split_rows.parts_take


def build(weights: str, layers: int, seed: int = 0, *, hidden: int = 4096, intermediate: int = 14336,
          vocab: int = 128256, heads: tuple = (32, 8, 128), tied: bool = False):
    """The 8B-shaped model (smaller matrices on request; heads: query heads, KV heads, head size)."""
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
        num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=heads[2], rms_norm_eps=1e-5,
        vocab_size=vocab, rope_theta=500000.0, tie_word_embeddings=tied,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    if WEIGHTS[weights]:
        mode, group, bits = WEIGHTS[weights]
        nn.quantize(model, group_size=group, bits=bits, mode=mode)
    mx.eval(model.parameters())
    return model


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def context(model, length: int, cache=None, seed: int = 1):
    """`length` tokens of context in `cache` (plain KVCaches by default)."""
    cache = make_prompt_cache(model) if cache is None else cache
    prompt = mx.random.randint(0, model.args.vocab_size, (1, length), key=mx.random.key(seed))
    for start in range(0, length, 256):  # M > L: native prefill, as the server does
        mx.eval(model(prompt[:, start : start + 256], cache=cache))
    return cache


def trim(cache, n):
    for c in cache:
        c.trim(n)


def forward(model, cache, path, compiled=None, canonical=False):
    """tokens (list) -> logits (B, vocab): the plain model call on mlx-lm's caches, or
    (path) a ragged pass over the engine's KV pool, as lockstep's engine runs it, or
    (compiled) that pass as one compiled call (canonical: a deterministic pass)."""
    if compiled is not None:
        return lambda tokens: compiled.logits([(cache, tokens)], canonical=canonical)
    if path is None:
        return lambda tokens: model(mx.array([tokens]), cache=cache)[0]
    return lambda tokens: path.forward_rows(cache, tokens)


def step_ms(run, cache, tokens, repeats: int, building: list | None = None) -> float:
    """Median wall time of one forward step of `tokens` (the cache is rewound after each);
    `building` gets the median of its Python graph building, the part before evaluation."""
    mx.eval(run(tokens))  # warm-up: kernel builds
    trim(cache, len(tokens))
    times, builds = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        out = run(tokens)
        builds.append(time.perf_counter() - t)
        mx.eval(out)
        times.append(time.perf_counter() - t)
        trim(cache, len(tokens))
    if building is not None:
        building.append(1e3 * float(np.median(builds)))
    return 1e3 * float(np.median(times))


def step_nodes(run, cache, tokens) -> int:
    """Nodes MLX evaluates for one step (its graph as built, compiled parts included)."""
    from op_count import ops

    out = run(tokens)
    count = sum(ops(out).values())
    mx.eval(out)
    trim(cache, len(tokens))
    return count


def rows_identical(run, cache, tokens, alone=None) -> int:
    """How many rows of the B-row step equal, bitwise, the same token fed alone in order
    (by `alone`, default `run`)."""
    b = len(tokens)
    block = run(tokens)
    mx.eval(block)
    trim(cache, b)
    same = 0
    for i in range(b):
        one = (alone or run)(tokens[i : i + 1])
        mx.eval(one)
        same += bits_equal(block[i], one[0])
    trim(cache, b)
    return same


def install(model, strategy: str, rows: int):
    base = strategy.removesuffix("_grouped").removesuffix("_separate").removesuffix("_pooled")
    _install(model, base, rows)
    custom.split_rows.parts_take = (lambda rows, canonical: True) if strategy.endswith("_grouped") else _PARTS_TAKE
    if strategy.endswith("_separate"):
        for _, m in model.named_modules():
            m.__dict__.pop("_siblings", None)  # each layer its own launch again


def _install(model, strategy: str, rows: int):
    if strategy in ("native", "lockstep_native", "lockstep_compiled"):
        set_batch_invariant_limit(model, 0)  # lockstep's plain layers at L = 0
        if strategy == "native":
            uninstall(model)  # mlx-lm's own classes: MLX's calls only
    elif strategy in ("plain_installed", "gemv_rows_compiled"):
        set_batch_invariant_limit(model, rows, "gemv_rows", verify=False)
    else:
        set_batch_invariant_limit(model, rows, strategy, verify=False)


def under_native_forms(run):
    def plain(tokens):
        with native_forms():
            return run(tokens)
    return plain


def check_kernels(log) -> None:
    """Kernels vs the NumPy loop-order model (bits), rows vs M = 1 (bits), vs MLX (close)."""
    log("## kernel check: rows vs M = 1 (bits); vs the NumPy model (bits for skinny_matmul,"
        " max relative error for the tensor-core kernel, whose in-MMA rounding is the hardware's)")
    # K tails (100, 4100), N = 16 mod 32 (48, 16), nvfp4 K = 16 mod 32 (48, 80), groups
    cases = [("dense", mx.bfloat16, 48, 100, None), ("dense", mx.bfloat16, 33, 4100, None),
             ("dense", mx.float16, 48, 100, None), ("dense", mx.float32, 33, 102, None)]
    cases += [("affine", mx.bfloat16, 48, 384, g) for g in (32, 64, 128)]
    cases += [("nvfp4", mx.bfloat16, 48, 48, 16), ("nvfp4", mx.bfloat16, 16, 80, 16)]
    cases += [("affine", mx.float16, 40, 4096, 64), ("nvfp4", mx.float16, 24, 4112, 16),
              ("dense", mx.float16, 4096, 4096, None), ("nvfp4", mx.bfloat16, 4096, 4096, 16)]
    key = mx.random.key(3)
    for kind, dtype, n, k, group in cases:
        kx, kw, key = mx.random.split(key, 3)
        x = mx.random.normal((64, k), key=kx).astype(dtype)
        w = mx.random.normal((n, k), key=kw).astype(dtype)
        if kind == "dense":
            run = lambda rows: custom.dense_matmul(rows, w)  # noqa: E731
            wf = np.array(w.astype(mx.float32))
            unit = loop_order.unit_elements(dtype.size)
        else:
            wq, scales, *biases = mx.quantize(w, group, 4, mode=kind)
            b = biases[0] if biases else None
            run = lambda rows: custom.quantized_matmul(rows, wq, scales, b, group_size=group,  # noqa: E731
                                                       bits=4, mode=kind)
            wf = loop_order.dequantize(np.array(wq), np.array(scales.astype(mx.float32)) if b is not None
                                       else np.array(scales), None if b is None else
                                       np.array(b.astype(mx.float32)), group_size=group, mode=kind)
            unit = loop_order.QUANT_UNIT
        alone = [run(x[i : i + 1]) for i in range(64)]
        mx.eval(alone)
        row_diffs = 0
        for m in (3, 16, 64):
            out = run(x[:m])
            mx.eval(out)
            row_diffs += sum(not bits_equal(out[i], alone[i][0]) for i in range(m))
        xs = np.array(x[:4].astype(mx.float32))
        got = np.array(run(x[:4]).astype(mx.float32))
        if skinny.uses_mma(dtype):  # the kernel feeds W to the MMA in x's type
            wt = np.array(mx.array(wf).astype(dtype).astype(mx.float32))
            model = np.array(mx.array(mma_order.skinny_mma(xs, wt, 16 if kind == "dense" else 4))
                             .astype(dtype).astype(mx.float32))
            rel = float(np.abs(got - model).max() / max(np.abs(model).max(), 1e-30))
            vs_model = f"max rel. diff vs NumPy model: {rel:.2e} (mma)"
        else:
            model = np.array(mx.array(loop_order.skinny_matmul(xs, wf, unit)).astype(dtype).astype(mx.float32))
            vs_model = f"elements != NumPy model: {int((got != model).sum())}/{4 * n}"
        log(f"{kind:>6} {str(dtype):>16} g{group or '-':<4} N={n:<5} K={k:<5} rows != M=1: {row_diffs:3d}   "
            + vs_model)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="bf16,nvfp4,affine4")
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--proof-limit", type=int, default=32)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--require-kernels", action="store_true", help="stop if the kernels cannot run")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help="of " + ",".join(STRATEGIES) + ", measured in the order given (a repeat measures again)")
    ap.add_argument("--kv-pool", action="store_true",
                    help="strategies over the engine's KV pool (one attention launch per layer); native stays on mlx-lm's caches")
    ap.add_argument("--fuse", action="store_true", help="fuse q/k/v and gate/up (models/fused_projections.py)")
    ap.add_argument("--fuse-lockstep", action="store_true",
                    help="fuse q/k/v and gate/up for every strategy but native (mlx-lm's own step, unfused)")
    ap.add_argument("--out")
    a = ap.parse_args()
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    log(f"backend {mx.default_device()}, MLX {mx.__version__}; custom kernels: "
        f"{custom.unavailable_reason() or 'available'}")
    if a.require_kernels and not custom.available():
        raise SystemExit(f"custom kernels unavailable: {custom.unavailable_reason()}")
    if a.check and custom.available():
        check_kernels(log)
    rows = [int(r) for r in a.rows.split(",")]
    strategies = [s for s in a.strategies.split(",") if s in STRATEGIES]  # in the order given, repeats too
    table = []
    for weights in a.weights.split(","):
        model = build(weights, a.layers)
        # native: mlx-lm's own step; with --fuse-lockstep on an unfused copy of the same weights
        base = build(weights, a.layers) if a.fuse_lockstep else model
        if a.fuse or a.fuse_lockstep:
            from lockstep.models.fused_projections import fuse_projections

            fuse_projections(model)
        nbytes = weight_bytes(model)
        floor_ms = 1e3 * nbytes / HBM_BYTES_PER_S
        cache = context(base, a.context)
        path = pooled = compiled = None
        if a.kv_pool:  # the strategies run as the engine runs them: ragged passes over the pool
            path = ModelRunner.as_engine_runs(model, "kernel")
            pooled = context(model, a.context, path.new_cache(a.context + max(rows)))
            compiled = CompiledPasses(model, path.kv_pool)
            split_kernel = path.kv_pool.split_kernel
            log(f"plain passes' attention: {'split kernel' if split_kernel else 'pooled'} "
                f"({split_attention.kernel_unavailable_reason(mx.bfloat16, 128) or 'available'})")
        log(f"\n## {weights}: {nbytes / 1e9:.2f} GB of weights, HBM floor {floor_ms:.2f} ms")
        for b in rows:
            tokens = mx.random.randint(0, model.args.vocab_size, (b,), key=mx.random.key(100 + b)).tolist()
            for strategy in strategies:
                install(base if strategy == "native" else model, strategy, b)
                if compiled is not None:
                    compiled.forget()  # traces follow the forms just installed
                    path.kv_pool.split_kernel = split_kernel and not strategy.endswith("_pooled")
                on_pool = path is not None and strategy != "native"
                kv = pooled if on_pool else cache
                run = forward(base if strategy == "native" else model, kv, path if on_pool else None,
                              compiled if on_pool and "_compiled" in strategy else None,
                              canonical=strategy.startswith("gemv_rows_compiled"))
                if strategy == "plain_installed":
                    run = under_native_forms(run)
                building = []
                ms = step_ms(run, kv, tokens, a.repeats, building)
                # a compiled deterministic pass's rows against the solo pass built op by op
                alone = forward(model, kv, path) if strategy.startswith("gemv_rows_compiled") else None
                same = rows_identical(run, kv, tokens, alone) if b > 1 else 1
                nodes = step_nodes(run, kv, tokens)
                table.append((weights, b, strategy, ms, floor_ms, same, ms - building[0]))
                log(f"{weights:>8} B={b:<3} {strategy:>13}: {ms:8.2f} ms  {100 * floor_ms / ms:5.1f}% of floor"
                    f"  (build {building[0]:.2f} ms)  rows == single-row pass: {same}/{b}  nodes: {nodes}")
        custom.split_rows.parts_take = _PARTS_TAKE
        proven = dict.fromkeys(s.split("_compiled")[0] for s in strategies)  # a compiled pass: its strategy's
        for strategy in (s for s in proven if s in ("gemv_rows", "skinny") and a.proof_limit):
            invariance = set_batch_invariant_limit(model, a.proof_limit, strategy)
            log(f"self-test L={a.proof_limit} ({strategy}): guaranteed={invariance.guaranteed}, widths "
                f"{invariance.self_test.widths if invariance.self_test else ()}, {invariance.reason}")
        set_batch_invariant_limit(model, 0)
        del model, base, cache, path, pooled, compiled
        mx.clear_cache()

    # The step is synchronous (build, then evaluate); its build moves with the lent machine's
    # host more than its evaluation does, so each ratio is given for both.
    strategies = list(dict.fromkeys(strategies))  # the table: each strategy's last measurement
    if "native" not in strategies:  # the table's ratios are to native: the lines above are the result
        if a.out:
            Path(a.out).write_text("\n".join(lines) + "\n")
        return
    others = [s for s in strategies if s != "native"]
    log("\n| weights | B | native ms (evaluation) | " + " | ".join(f"{s} ms (x native; evaluation x native)" for s in others)
        + " | % of floor | rows bit-identical " + " / ".join(strategies) + " |")
    log("|---|---|---|" + "---|" * len(others) + "---|---|")
    by = {(w, b, s): (ms, fl, same, ev) for w, b, s, ms, fl, same, ev in table}
    for weights in a.weights.split(","):
        for b in rows:
            n = by[weights, b, "native"]
            cells = [f"{by[weights, b, s][0]:.2f} ({by[weights, b, s][0] / n[0]:.2f}x; {by[weights, b, s][3] / n[3]:.2f}x)"
                     for s in others]
            last = by[weights, b, strategies[-1]]
            log(f"| {weights} | {b} | {n[0]:.2f} ({n[3]:.2f}) | " + " | ".join(cells)
                + f" | {100 * last[1] / last[0]:.1f} % | " + ", ".join(f"{by[weights, b, s][2]}/{b}" for s in strategies)
                + " |")
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
