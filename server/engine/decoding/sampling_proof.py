"""The proof that sampling several requests' rows as one batch (`sampling.RowSampling.batch`)
gives every row the bits it gets sampled alone, at the widths the engine batches deterministic
rows in (`sampling.block_widths`: the powers of two up to the widest pass the deployment proved
for deterministic rows, and that width), on the backend it runs on.

Whether a batch's reductions, sorts and scans take the same kernels as one row's is a fact
about the backend, not its name, so it is compared here, bit for bit, on logits of the served
model's vocabulary size and dtype: each sampling form the batch path takes (greedy with
logprobs, seeded temperature, top-k, top-p, min-p, each with or without logprobs and top
alternatives; rows with penalties, logit_bias or a grammar never join a batch) on random
logits, every row its own seed and position (two rows one seed, two rows one position), so a
row sampled with another row's key shows. The batch takes its rows in shuffled order from a
pass's logits, as the engine gathers them. Each row alone is computed once per form; each width
is then one batch per form, compared with those rows. Only those widths are compared, not every
width up to the widest: the engine splits a group into blocks of them (`sampling.split_blocks`),
so it never runs a batch of a width not compared here. A width is proven on its own: the first
width that differs ends the proof, and the widths below it stay proven (the blocks then take
those). Width w's rows, their order and their logits do not depend on the widest width, so the
verdict cache keeps one record per backend, device, MLX, vocabulary, dtype and code (this and
the sampler's, and the identity of the functions compared): the widths proven so far and the
first that differed (no width from it on is credited). Each width is written as soon as it is
proven, so a proof stopped midway, or a wider pass later, proves only the widths not kept. The
proof yields to serving between widths (kernels/proof_steps.py).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from lockstep.kernels.invariance.selftest import bits_equal
from lockstep.kernels.proof_steps import step_done
from lockstep.server.engine.decoding import sampling
from lockstep.server.engine.decoding.sampling import RowSampling, SamplingParams, block_widths

# The forms the batch path takes (token_steps.fast_argmax: greedy without logprobs takes a
# pass's argmax, no batch), with and without logprobs; top alternatives of several counts,
# since their sort's shape is n. A form's tokens are the same ops with logprobs or without.
FORMS = {
    "greedy, logprobs": SamplingParams(temperature=0.0, top_logprobs=5),
    "seeded, logprobs": SamplingParams(temperature=1.3, top_logprobs=1),
    "top_k": SamplingParams(temperature=0.8, top_k=40, top_logprobs=2),
    "top_p": SamplingParams(temperature=1.0, top_p=0.9, top_logprobs=20),
    "min_p": SamplingParams(temperature=1.1, min_p=0.05),
}
# Spread like a model's logits (std ~3), so masks keep different numbers of tokens per row
LOGIT_SCALE = 3.0
# The sampler's parts a proof is about, looked up when it is keyed: a verdict made with a
# stand-in for one of them (a test double) is never a real one's
_SAMPLER_PARTS = ("sample_pending", "choose_tokens", "filtered_logprobs", "gumbel_noise", "_top_n")
_OPS = ("logsumexp", "argmax", "argsort", "argpartition", "partition", "cumsum", "take_along_axis",
        "put_along_axis")


@dataclass(frozen=True)
class SamplingProof:
    """What `prove_batched_sampling` found: the widest batch (`proof_widths(rows)` all proven;
    0: none, deterministic rows sample alone) and why; `cached`: nothing was sampled (the
    verdict cache had every width); `resumed`: the widest width that came from it (0: none)."""

    rows: int
    reason: str
    cached: bool = False
    seconds: float = 0.0
    resumed: int = 0

    @property
    def widths(self) -> list[int]:
        """The batch widths proven, which the engine's blocks take (and 1: a row alone)."""
        return proof_widths(self.rows)

    def describe(self) -> str:
        if self.rows >= 2:
            return f"batched sampling: deterministic rows in blocks of {widths_text(self.rows)} ({self.reason})"
        return f"batched sampling: deterministic rows sample alone ({self.reason})"


def proof_widths(widest: int) -> list[int]:
    """The batch widths a proof up to `widest` compares: `sampling.block_widths` but 1 (a row
    alone is the comparison itself)."""
    return [w for w in block_widths(widest) if w >= 2]


def widths_text(widest: int) -> str:
    return ", ".join(map(str, proof_widths(widest)))


def seed_and_position(row: int) -> tuple[int, int]:
    """Row `row`'s seed and position: every seed differs but rows 0 and 1's, whose positions
    differ; rows 2 and 3 share a position (their seeds differ)."""
    seed = 1000 + 7919 * (0 if row == 1 else row)
    return seed, 100 + 13 * (2 if row == 3 else row)


def batch_order(width: int) -> list[int]:
    """The pass rows a batch of `width` takes, in the (shuffled) order it takes them."""
    return np.random.default_rng(width).permutation(width).tolist()


def pass_logits(rows: int, vocab: int, dtype) -> mx.array:
    """Random logits of `rows` rows, row r the same whatever `rows` is."""
    each = [mx.random.normal((vocab,), key=mx.random.key(r)) for r in range(rows)]
    return (mx.stack(each) * LOGIT_SCALE).astype(dtype)


def _pending_alone(logits: mx.array, row: int, params: SamplingParams, seed: int, position: int):
    # module attribute: what the engine's sampler is now
    return sampling.sample_pending(logits[row:row + 1], [position], replace(params, seed=seed))


def _stacked(pendings: list) -> list[mx.array]:
    return [mx.concatenate(parts) for parts in zip(*(p.arrays for p in pendings))]


def _form_rows(form: int, rows: int) -> list[tuple[int, int]]:
    # each form its own seeds, so every row is sampled under several
    return [(seed + 104729 * form, position) for seed, position in map(seed_and_position, range(rows))]


@dataclass(frozen=True)
class Divergence:
    """Where a batch first failed to give its rows their bits alone: the width, the pass row
    and the form; `error`: the batch (or a row alone) raised instead."""

    width: int
    row: int
    form: str
    error: str = ""

    def describe(self, vocab: int, dtype) -> str:
        if self.error:
            return f"sampling {self.form} at width {self.width} failed: {self.error}"
        return f"a batch of {self.width} rows differs from row {self.row} alone ({self.form}, vocabulary {vocab}, {dtype})"


def first_divergence(vocab: int, dtype, widths: list[int], on_width=None) -> Divergence | None:
    """Every width of `widths` in order, every form: the batch's rows against each row alone,
    bit for bit. None: all equal. `on_width(w)`: called once width w is proven."""
    if not widths:
        return None
    widest = max(widths)
    logits = pass_logits(widest, vocab, dtype)
    forms = [(name, params, _form_rows(f, widest)) for f, (name, params) in enumerate(FORMS.items())]
    try:
        alone = {name: _stacked([_pending_alone(logits, r, params, *rows[r]) for r in range(widest)])
                 for name, params, rows in forms}
        mx.eval(logits, alone)
    except Exception as exc:  # a sampler that cannot run here proves nothing
        return Divergence(widths[0], 0, "alone", f"{type(exc).__name__}: {exc}")
    step_done()
    for width in widths:
        found = _compare(logits, batch_order(width), forms, alone)
        if found is not None:
            return found
        if on_width is not None:
            on_width(width)
        step_done()  # outside the comparison: the engine's work between steps is not a proof's error
    return None


def _compare(logits: mx.array, picked: list[int], forms: list, alone: dict) -> Divergence | None:
    width, name, index = len(picked), "", mx.array(picked)
    try:
        batches = {}
        for name, params, rows in forms:
            specs = [RowSampling(replace(params, seed=rows[r][0]), rows[r][1]) for r in picked]
            batches[name] = RowSampling.batch(logits[index], specs)[0].arrays
        mx.eval(batches)
        for name, params, rows in forms:
            expected = [part[index] for part in alone[name]]
            got = batches[name]
            if not all(bits_equal(a, b) for a, b in zip(got, expected)):
                row = next(j for j in range(width)
                           if not all(bits_equal(a[j], b[j]) for a, b in zip(got, expected)))
                return Divergence(width, picked[row], name)
    except Exception as exc:
        return Divergence(width, 0, name, f"{type(exc).__name__}: {exc}")
    return None


def _kept(value) -> tuple[set[int], int, str]:
    """(the widths proven, the width that differed or 0, its reason) of a stored record."""
    if not isinstance(value, dict):
        return set(), 0, ""
    proven, differs, reason = value.get("proven"), value.get("differs_at"), value.get("reason")
    if not (isinstance(proven, list) and all(isinstance(w, int) for w in proven)
            and isinstance(differs, int) and isinstance(reason, str)):
        return set(), 0, ""
    return set(proven), differs, reason


def _all_proven(widest: int, vocab: int, dtype) -> str:
    return (f"proven bit-identical to each row alone at widths {widths_text(widest)}, {len(FORMS)} forms, "
            f"vocabulary {vocab}, {dtype}")


def _result(proven: int, where: str, **kw) -> SamplingProof:
    proven = proven if proven >= 2 else 0
    return SamplingProof(proven, (f"proven at widths {widths_text(proven)}; " if proven else "") + where, **kw)


def prove_batched_sampling(vocab: int, dtype, widest: int, *, proof_cache=None) -> SamplingProof:
    """Prove batches of each of `proof_widths(widest)` rows keep every row's bits alone, for
    logits of `vocab` entries of `dtype`; where a width differs, the widths below it are
    proven (none: 0). `proof_cache` (kernels.invariance.selftest.ProofCache): the widths
    proven, kept per machine as each is proven (not a width that ended in an error, which a
    restart may not meet)."""
    if widest < 2:
        return SamplingProof(0, "no pass holds several deterministic rows")
    key = proof_key(vocab, dtype) if proof_cache is not None else None
    proven, differs, reason = _kept(proof_cache.store.get(key)) if key is not None and not proof_cache.fresh \
        else (set(), 0, "")
    targets = proof_widths(widest)
    kept = targets[:next((i for i, w in enumerate(targets) if w not in proven), len(targets))]
    resumed = kept[-1] if kept else 0
    if len(kept) == len(targets):
        return SamplingProof(widest, _all_proven(widest, vocab, dtype), cached=True, resumed=widest)
    if differs and targets[len(kept)] >= differs:
        return _result(resumed, reason, cached=True, resumed=resumed)

    failed = [differs, reason]  # kept with the widths proven since (a narrower pass's widest)

    def store() -> None:
        if key is not None:
            proof_cache.store.put(key, {"proven": sorted(proven), "differs_at": failed[0], "reason": failed[1]})

    def keep(width: int) -> None:
        proven.add(width)
        store()

    started = time.perf_counter()
    where = first_divergence(vocab, dtype, targets[len(kept):], on_width=keep)
    seconds = time.perf_counter() - started
    if where is None:
        return SamplingProof(widest, _all_proven(widest, vocab, dtype), seconds=seconds, resumed=resumed)
    below = max([w for w in targets if w < where.width], default=0)
    why = where.describe(vocab, dtype)
    if not where.error:
        failed[:] = [where.width, why]
        store()
    return _result(below, why, seconds=seconds, resumed=resumed)


def proof_key(vocab: int, dtype) -> dict:
    from lockstep.kernels.verdict_cache import code_version, environment, function_identity

    return {
        # "rows": which widths a record's "proven" lists (an older record, of every width 2..n, is
        # under another key and never read as this one)
        "what": "batched sampling rows", "rows": "powers of two and the widest",
        "vocab": vocab,
        "dtype": str(dtype),
        "environment": environment(),
        "code": code_version(sampling, sys.modules[__name__]),
        "ops": [function_identity(f) for f in (*(getattr(sampling, name) for name in _SAMPLER_PARTS),
                                               sampling.RowSampling.batch, *(getattr(mx, name) for name in _OPS),
                                               mx.random.gumbel)],
    }
