"""Where a fresh quantized-kernel audit's time goes (issue 51): the 8B-shaped model with random
weights (bench/invariant_8b.py), audited with no verdict cache, each probe timed as it runs:
the first call of a path on a configuration (MLX's JIT compile of that kernel shape, plus the
run) against a second call of the same inputs (the run alone), and the reference (NumPy
dequantization and product) apart. Prints a table by configuration and path, and the totals.

    python bench/audit_cost.py [--weights nvfp4] [--layers 32] [--repeat 3] [--slicing-as cuda]

`--slicing-as cuda` makes the audit choose its slices and whole-layer probes as it does on CUDA
(the decode probes of the 128,256-row head and embedding run on the whole layer) while the
kernels run here: on the CPU that measures the reference's NumPy part of a GPU audit.
`--repeat N` audits N times and prints each part's median. `--head-only` audits just an nvfp4
head and embedding of `--vocab` × `--hidden` made from random codes (no float weights: the
8B shapes within a small machine's memory); `--experts E` just an nvfp4 switch layer of E
experts × `--intermediate` × `--hidden` made the same way (with `--slicing-as metal` its gather
paths run on the whole layer). `--against-every-row` audits each round twice, compared on
`row_sample`'s rows and on every row (`compared_rows` → None), in rotating order after one
unmeasured round of both (bench/harness.py), and prints the medians side by side with the
median of the rounds' own ratios. Without it, the rounds are not warmed up: the first audit is
the fresh one whose first calls compile (the table of paths is the last audit's).

Measures and prints; asserts nothing.
"""
import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from harness import measure, median, paired_ratios, table  # noqa: E402
from invariant_8b import build  # noqa: E402
from lockstep.kernels.audit import patch, probes  # noqa: E402
from mlx_lm.models.switch_layers import QuantizedSwitchLinear  # noqa: E402

spent = collections.defaultdict(float)
rows_out = []


class HeadOnly(nn.Module):
    """An nvfp4 embedding and head of random codes (scales: E4M3 codes of 2^-4..2^-1), bf16."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.norm.set_dtype(mx.bfloat16)
        self.embed_tokens = nn.QuantizedEmbedding(vocab, hidden, group_size=16, bits=4, mode="nvfp4")
        self.lm_head = nn.QuantizedLinear(hidden, vocab, bias=False, group_size=16, bits=4, mode="nvfp4")
        for layer in (self.embed_tokens, self.lm_head):  # replaced before the float init is evaluated
            layer.weight = mx.random.randint(0, 2**31, (vocab, hidden // 8)).astype(mx.uint32)
            layer.scales = mx.random.randint(0x18, 0x38, (vocab, hidden // 16)).astype(mx.uint8)
        mx.eval(self.parameters())


class SwitchOnly(nn.Module):
    """An nvfp4 switch layer of random codes (scales as `HeadOnly`), bf16 activations."""

    def __init__(self, experts: int, out_dims: int, in_dims: int):
        super().__init__()
        self.norm = nn.RMSNorm(in_dims)
        self.norm.set_dtype(mx.bfloat16)
        self.experts = QuantizedSwitchLinear(in_dims, out_dims, experts, group_size=16, bits=4,
                                             mode="nvfp4")
        layer = self.experts  # replaced before the float init is evaluated
        layer.weight = mx.random.randint(0, 2**31, (experts, out_dims, in_dims // 8)).astype(mx.uint32)
        layer.scales = mx.random.randint(0x18, 0x38, (experts, out_dims, in_dims // 16)).astype(mx.uint8)
        mx.eval(self.parameters())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="nvfp4")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--head-only", action="store_true")
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--against-every-row", action="store_true")
    ap.add_argument("--slicing-as", choices=("cpu", "cuda", "metal"), default=None,
                    help="the backend whose slicing the audit follows (default: this one's)")
    a = ap.parse_args()
    if a.slicing_as:
        patch.backend_kind = lambda: a.slicing_as
    t = time.perf_counter()
    model = (SwitchOnly(a.experts, a.intermediate, a.hidden) if a.experts else
             HeadOnly(a.vocab, a.hidden) if a.head_only else
             build(a.weights, a.layers, hidden=a.hidden, intermediate=a.intermediate, vocab=a.vocab))
    print(f"backend {mx.default_device()}, MLX {mx.__version__}; built in {time.perf_counter() - t:.1f} s",
          flush=True)

    probe_measure, reference_weight = probes._measure, probes.reference_weight

    def timed_measure(path, rows, tol, run, *rest):
        calls = []

        def split_run():
            t0 = time.perf_counter()
            out, ref = run()  # the reference is computed in here, before the kernel runs
            t1 = time.perf_counter()
            mx.eval(out)
            t2 = time.perf_counter()
            calls.append((t1 - t0, t2 - t1))
            return out, ref
        result = probe_measure(path, rows, tol, split_run, *rest)
        again = time.perf_counter()
        try:
            out, _ = run()
            t1 = time.perf_counter()
            mx.eval(out)
            second = time.perf_counter() - t1
        except Exception:  # noqa: BLE001 - a failing path is reported by the audit
            second = float("nan")
        del again
        ref_s, first = calls[0] if calls else (float("nan"), float("nan"))
        rows_out.append((current[0], path, rows, first, second, ref_s))
        spent["first call"] += first
        spent["second call"] += 0 if second != second else second
        return result

    def timed_reference(*args, **kwargs):
        t0 = time.perf_counter()
        w = reference_weight(*args, **kwargs)
        spent["dequantize (NumPy)"] += time.perf_counter() - t0
        return w

    current = ["?"]
    audit_config = patch._audit_config

    def timed_config(cfg, layers, seed, prompt_rows, *rest, **kwargs):
        current[0] = cfg.label()
        t0 = time.perf_counter()
        result = audit_config(cfg, layers, seed, prompt_rows, *rest, **kwargs)
        print(f"config {cfg.label()}: {time.perf_counter() - t0:.1f} s, verdict {result.verdict}", flush=True)
        return result

    probes._measure = timed_measure
    patch.reference_weight = timed_reference
    patch._audit_config = timed_config
    sampled_rows = patch.compared_rows

    def one_audit(every_row: bool = False) -> dict:
        patch.compared_rows = (lambda n: None) if every_row else sampled_rows
        spent.clear()
        rows_out.clear()
        t = time.perf_counter()
        report = patch.audit_model(model, cache=None)
        total = time.perf_counter() - t
        patch.compared_rows = sampled_rows
        refs = sum(r[5] for r in rows_out)
        deq = spent["dequantize (NumPy)"]
        run = {"audit": total, "first calls": spent["first call"], "references": refs,
               "dequantization": deq, "the rest": total - spent["first call"] - refs - deq}
        print(f"\naudit{' (every row compared)' if every_row else ''} {total:.1f} s for "
              f"{len(report.configs)} configurations, verdicts "
              f"{sorted({c.verdict for c in report.configs})}")
        print(f"first calls {spent['first call']:.1f} s, the same calls again {spent['second call']:.1f} s, "
              f"references {refs:.1f} s, dequantization {deq:.1f} s, "
              f"the rest {run['the rest']:.1f} s", flush=True)
        return run

    if a.against_every_row:
        both = measure({"sampled": lambda: one_audit(False), "every row": lambda: one_audit(True)},
                       rounds=a.repeat)
        print(f"\nmedians of {a.repeat} (after one unmeasured round):")
        rows = []
        for k in both["sampled"][0]:
            part = lambda run, k=k: run[k]  # noqa: E731
            ratio = median(paired_ratios(both, "every row", "sampled", part))
            rows.append([k, f"{median(both['sampled'], part):.2f}", f"{median(both['every row'], part):.2f}",
                         f"{ratio:.2f}x"])
        print(table(["part", "sampled rows s", "every row s", "every row / sampled (paired median)"], rows))
        return
    runs = measure({"audit": one_audit}, rounds=a.repeat, warmup=0)["audit"]
    print(table(["configuration", "path", "rows", "first call s", "second call s", "reference s"],
                [[label, path, rows, f"{first:.3f}", f"{second:.3f}", f"{ref:.3f}"]
                 for label, path, rows, first, second, ref in rows_out]))
    if a.repeat > 1:
        print(f"\nmedian of {a.repeat}: " + ", ".join(
            f"{k} {median(runs, lambda run, k=k: run[k]):.2f} s" for k in runs[0]))


if __name__ == "__main__":
    main()
