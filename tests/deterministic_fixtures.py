"""Helpers shared by the deterministic-mode tests (decode plans, prefix cache, speculation).

Everything compares bits: floats through their IEEE-754 encoding (so -0.0 != 0.0), MLX
arrays through `kernels.invariance.selftest.bits_equal`.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from lockstep.kernels.invariance.selftest import bits_equal
from lockstep.server.engine.guarantee.decode_plan import DecodePlan
from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.generate import GenerationRequest, generate
from lockstep.server.engine.runner.model_runner import ModelRunner
from lockstep.server.engine.decoding.request_report import rendered
from lockstep.server.engine.decoding.sampling import SamplingParams
from lockstep.server.engine.decoding.token_steps import PlainSource, SpeculationStats, SpeculativeSource, drive

GREEDY = SamplingParams(temperature=0.0, top_logprobs=3)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, top_logprobs=3)


def float_bits(x: float) -> bytes:
    return struct.pack(">d", x)


# ----------------------------------------------------------------- tiny "loaded" models

class CharTokenizer:
    """Token id i <-> one CJK character (U+4E00 + i): every id decodes to a distinct,
    single, printable character, so token ids can be read back from the text."""

    BASE = 0x4E00

    def decode(self, ids) -> str:
        return "".join(chr(self.BASE + int(i)) for i in ids)

    def ids(self, text: str) -> list[int]:
        return [ord(c) - self.BASE for c in text]

    def __len__(self) -> int:
        return 256


@dataclass
class TinyLoaded:
    """Enough of models.load.LoadedModel for server.engine.generate.generate()."""

    model: object
    tokenizer: CharTokenizer = field(default_factory=CharTokenizer)
    path: Path = Path("/nonexistent/tiny")
    name: str = "tiny"
    context_length: int = 4096
    eos_token_ids: set = field(default_factory=set)  # never stop early: compare full runs
    weights: str = "float32"


# ----------------------------------------------------------------- running generate()

@dataclass
class Run:
    """One generate() run, flattened: token ids, logprobs (and their bit patterns), text,
    the lockstep extension, and the target logits rows the decode steps produced."""

    tokens: list[int]
    logprobs: list[float]
    tops: list[list[tuple[str, float]]]
    text: str
    finish_reason: str | None
    extension: dict | None
    decode_logits: list = field(default_factory=list)  # (position, logits row) per decoded row

    def logprob_bits(self) -> list[bytes]:
        return [float_bits(x) for x in self.logprobs]

    def top_bits(self) -> list[list[tuple[str, bytes]]]:
        return [[(t, float_bits(v)) for t, v in top] for top in self.tops]


class RecordingRunner(ModelRunner):
    """A runner for one request (as generate() makes) that records every logits row of its
    passes computed at or after `first_position` (decode and verification rows)."""

    def __init__(self, model, deployment, first_position: int):
        super().__init__(model, deployment, batched=False)
        self.first_position = first_position
        self.rows: dict[int, list] = {}  # position -> logits rows computed there (in order)

    def forward_rows(self, cache, tokens):
        start = cache[0].offset if cache else 0
        logits = super().forward_rows(cache, tokens)
        mx.eval(logits)
        for i in range(len(tokens)):
            if start + i >= self.first_position:
                self.rows.setdefault(start + i, []).append(logits[i])
        return logits


def run_generate(loaded, prompt: list[int], max_tokens: int, sampling: SamplingParams, *,
                 plan: DecodePlan | None = None, deployment: Deployment | None = None,
                 prefix_cache=None, tokenizer_ids=None) -> Run:
    """Drive server.engine.generate.generate() to the end, the way the engine does."""
    step = RecordingRunner(loaded.model, deployment, len(prompt) - 1)
    request = GenerationRequest(prompt_tokens=list(prompt), max_tokens=max_tokens, sampling=sampling)
    deltas = [d for d in generate(loaded, request, plan=plan, deployment=deployment,
                                  prefix_cache=prefix_cache, runner=step) if d is not None]
    items = [lp for d in deltas for lp in d.logprobs]
    ids = tokenizer_ids or loaded.tokenizer.ids
    tokens = [t for lp in items for t in ids(lp.token)]
    return Run(tokens=tokens, logprobs=[lp.logprob for lp in items], tops=[lp.top for lp in items],
               text="".join(d.text for d in deltas), finish_reason=deltas[-1].finish_reason,
               extension=rendered(deltas[-1].report), decode_logits=step.rows)


def chosen_rows(run: Run) -> list:
    """The logits row each emitted token was chosen from: at position p the *last* row
    computed there (a rejected draft's row at p is recomputed by the next pass)."""
    return [run.decode_logits[p][-1] for p in sorted(run.decode_logits)][: len(run.tokens)]


def rows_bit_identical(a: list, b: list) -> bool:
    return len(a) == len(b) and all(bits_equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------- Step-level token sources

def steps_from(model, prompt: list[int], n: int, params: SamplingParams, *, drafter=None,
               k: int = 0) -> list:
    """The first `n` `token_steps.Step`s of plain (drafter None) or speculative decoding,
    after prefilling prompt[:-1] (chunks of a `--prefill-chunk` as wide as the prompt: the
    grid's points below it, kernels/invariance/prefill.py), as generate() sets them up."""
    runner = ModelRunner(model, batched=False)
    cache = make_prompt_cache(model)
    for _ in runner.prefill_cache(cache, prompt[:-1], chunk=max(1, len(prompt))):
        pass
    stats = SpeculationStats()
    context = list(prompt)
    if drafter is None:
        source = drive(PlainSource(cache, context, params, stats), runner, cache)
    else:
        source = drive(SpeculativeSource(cache, context, params, drafter, k, stats), runner, cache)
    steps = []
    for batch in source:
        steps.extend(batch)
        if len(steps) >= n:
            break
    source.close()
    return steps[:n], stats
