"""The divergence matrix (`lockstep verify`): do speculative and concurrent decoding reproduce
plain decoding bit for bit?

For each model variant, every cell (speculative method × verification width × alone or
beside another request × greedy or seeded) decodes the same prompts and is compared with
plain, alone decoding: token ids, and each token's full logits row as raw bits. The mode-on
rows run with the batch-invariant limit L installed; the negative control runs the same
cells with L = 0, where a backend whose reductions vary with the row count must diverge.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from lockstep.kernels.invariance.selftest import UINT_OF_SIZE

from lockstep.server.engine.runner.model_runner import ModelRunner
from lockstep.server.engine.decoding.sampling import SamplingParams
from lockstep.server.engine.decoding.token_steps import SpeculationStats, token_source

PROMPTS = (
    "Write the numbers from 1 to 40 separated by commas, then write them again.",
    "Explain in a few sentences why the sky is blue.",
)
SAMPLINGS = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=0.8, top_p=0.95, seed=1234),
}


def row_digest(row: mx.array) -> bytes:
    """The raw bits of a logits row (any float dtype), hashed."""
    bits = np.array(row.view(UINT_OF_SIZE[row.dtype.size]))
    return hashlib.sha256(bits.tobytes()).digest()


@dataclass(frozen=True)
class Cell:
    method: str  # "none" | "prompt_lookup" | "draft"
    width: int  # rows per verification pass (k + 1); 1 for plain
    load: str  # "alone" | "concurrent"
    sampling: str  # key of SAMPLINGS


@dataclass
class Trace:
    tokens: list
    digests: list
    drafted: int = 0
    accepted: int = 0


def start_decoding(model, prompt: list[int], params: SamplingParams, stats: SpeculationStats,
                   method: str = "none", k: int = 0, draft_model=None):
    """Prefill a fresh cache with `prompt` and return its token source (no HTTP, no engine):
    one request's passes through a runner of its own (plain model calls on plain caches)."""
    runner = ModelRunner(model, batched=False)
    cache = runner.new_cache(len(prompt))
    for _ in runner.prefill_cache(cache, prompt[:-1]):
        pass
    return token_source(runner, cache, list(prompt), params, stats, method, k, draft_model)


def decode_trace(model, draft_model, prompt: list[int], cell: Cell, n_tokens: int,
                 companion_prompt: list[int] | None = None) -> Trace:
    """Decode n_tokens (eos ignored) the way `cell` says; a companion request is stepped
    in between when the cell is concurrent."""
    stats = SpeculationStats()
    params = SamplingParams(**SAMPLINGS[cell.sampling])
    main = start_decoding(model, prompt, params, stats, cell.method, cell.width - 1, draft_model)
    other = None
    if cell.load == "concurrent":
        other = start_decoding(model, companion_prompt, SamplingParams(temperature=0.7, seed=7),
                               SpeculationStats(), "prompt_lookup", 3)
    tokens, digests = [], []
    while len(tokens) < n_tokens:
        for step in next(main):
            tokens.append(step.sampled.token)
            digests.append(row_digest(step.logits))
        if other is not None:
            next(other)
    return Trace(tokens[:n_tokens], digests[:n_tokens], stats.drafted, stats.accepted)


def count_divergence(reference: Trace, trace: Trace) -> tuple[int, int]:
    """(divergent tokens, divergent logits rows). Logits are compared up to and including
    the first differing token: past it the contexts differ, so rows are not comparable."""
    tokens = sum(a != b for a, b in zip(reference.tokens, trace.tokens))
    first = next((i for i, (a, b) in enumerate(zip(reference.tokens, trace.tokens)) if a != b),
                 len(trace.tokens) - 1)
    logits = sum(reference.digests[i] != trace.digests[i] for i in range(first + 1))
    return tokens, logits


def cells(limit: int, has_draft: bool, widths=None) -> list[Cell]:
    widths = [w for w in (widths or range(2, limit + 1)) if 2 <= w <= max(limit, 2)]
    methods = ["prompt_lookup"] + (["draft"] if has_draft else [])
    out = [Cell("none", 1, "concurrent", s) for s in SAMPLINGS]
    for method, width, load, sampling in itertools.product(methods, widths, ("alone", "concurrent"),
                                                           SAMPLINGS):
        out.append(Cell(method, width, load, sampling))
    return out


@dataclass
class Row:
    variant: str
    control: bool  # True: L = 0 negative control
    cell: Cell
    tokens: int
    logits: int
    drafted: int
    accepted: int


def verify_variant(variant: str, model, draft_model, prompts: list[list[int]], limit: int,
                   n_tokens: int, widths=None, set_limit=None, log=print) -> list[Row]:
    """Mode on (L = limit), then the L = 0 control, for every cell; `set_limit(L)` installs L."""
    rows = []
    for control in (False, True):
        set_limit(0 if control else limit)
        refs = {(i, s): decode_trace(model, draft_model, p, Cell("none", 1, "alone", s), n_tokens)
                for i, p in enumerate(prompts) for s in SAMPLINGS}
        for cell in cells(limit, draft_model is not None, widths):
            if control and cell.method == "none":
                continue  # plain decoding beside another request: nothing varies without batching
            total = [0, 0, 0, 0]
            for i, prompt in enumerate(prompts):
                companion = prompts[(i + 1) % len(prompts)]
                trace = decode_trace(model, draft_model, prompt, cell, n_tokens, companion)
                tok, lg = count_divergence(refs[(i, cell.sampling)], trace)
                for j, v in enumerate((tok, lg, trace.drafted, trace.accepted)):
                    total[j] += v
            rows.append(Row(variant, control, cell, *total))
            log(format_row(rows[-1]))
    set_limit(limit)
    return rows


HEADER = f"{'variant':<10} {'L':>7} {'method':<14} {'width':>5} {'load':<10} {'sampling':<8} " \
         f"{'div.tokens':>10} {'div.logits':>10} {'accepted':>12}"


def format_row(r: Row) -> str:
    mode = "0 (ctl)" if r.control else "on"
    return (f"{r.variant:<10} {mode:>7} {r.cell.method:<14} {r.cell.width:>5} {r.cell.load:<10} "
            f"{r.cell.sampling:<8} {r.tokens:>10} {r.logits:>10} {f'{r.accepted}/{r.drafted}':>12}")


def summary_lines(rows: list[Row]) -> list[str]:
    on = [r for r in rows if not r.control]
    ctl = [r for r in rows if r.control]
    lines = [f"negative control (L=0): {sum(r.tokens for r in ctl)} divergent tokens, "
             f"{sum(r.logits for r in ctl)} divergent logits rows in {len(ctl)} cells"]
    lines.append(f"mode on: total divergences {sum(r.tokens + r.logits for r in on)} "
                 f"({sum(r.tokens for r in on)} tokens, {sum(r.logits for r in on)} logits rows "
                 f"in {len(on)} cells)")
    return lines
