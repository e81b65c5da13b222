"""Several requests' rows sampled as one batch (sampling.RowSampling.batch, built by the runner's
decode_ahead.presample_pass): every row's token, logprob and top alternatives are bit for bit
what the row gets sampled alone, greedy and seeded, with top-k / top-p / min-p; the noise is
the per-row noise sampling always drew (a seed sent before gives the same answer now)."""
import struct
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from lockstep.server.engine.decoding.sampling import (RowSampling, SamplingParams, block_widths, gumbel_noise,
                                                      key_for, sample_pending, split_blocks)
from lockstep.server.engine.decoding.token_steps import PlainSource, SpeculationStats
from lockstep.server.engine.runner.decode_ahead import presample_pass

VOCAB = 500
ROWS = 7
SEEDS = [3, 11, 11, 2**53 - 1, 0, 77, 5]  # a repeated seed: rows differ by position alone
POSITIONS = [9, 9, 40, 1, 300, 17, 17]

PARAMS = {
    "greedy with logprobs": SamplingParams(temperature=0.0, top_logprobs=3),
    "seeded": SamplingParams(temperature=0.9),
    "seeded, logprobs": SamplingParams(temperature=1.3, top_logprobs=5),
    "top_k": SamplingParams(temperature=0.8, top_k=20, top_logprobs=2),
    "top_p": SamplingParams(temperature=1.0, top_p=0.7),
    "min_p": SamplingParams(temperature=1.1, min_p=0.05, top_logprobs=1),
    "all masks": SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.02, top_logprobs=4),
}


def bits(sampled) -> tuple:
    """A Sampled as exact bits: token, logprob's float32 bits, the alternatives' ids and bits."""
    pack = lambda x: None if x is None else struct.pack("<f", x)  # noqa: E731
    return (sampled.token, pack(sampled.logprob), tuple((t, pack(v)) for t, v in sampled.top_logprobs))


@pytest.fixture(scope="module", params=[mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def logits(request):
    # spread out like a model's (std ~3) so the masks keep different numbers of tokens per row
    out = (mx.random.normal((ROWS, VOCAB), key=mx.random.key(1)) * 3).astype(request.param)
    mx.eval(out)
    return out


def alone(logits, i: int, params: SamplingParams):
    return sample_pending(logits[i:i + 1], [POSITIONS[i]], replace(params, seed=SEEDS[i])).result()[0]


@pytest.mark.parametrize("name", PARAMS)
def test_a_batch_gives_every_row_its_bits_alone(logits, name):
    params = PARAMS[name]
    rows = [RowSampling(replace(params, seed=seed), position) for seed, position in zip(SEEDS, POSITIONS)]
    assert len({row.group for row in rows}) == 1
    batch = RowSampling.batch(logits, rows)
    mx.eval([x for pending in batch for x in pending.arrays])
    got = [bits(pending.result()[0]) for pending in batch]
    assert got == [bits(alone(logits, i, params)) for i in range(ROWS)]
    assert [pending.tokens.item() for pending in batch] == [g[0] for g in got]  # the (1,) token decode ahead feeds


def test_negative_control_a_batch_keyed_on_one_seed_differs_from_the_rows_alone(logits):
    """What the test above would miss if it could not see noise keyed on the wrong seed."""
    params = PARAMS["seeded"]
    shared = sample_pending(logits, POSITIONS, replace(params, seed=SEEDS[0])).result()  # seeds left out
    assert [bits(s) for s in shared] != [bits(alone(logits, i, params)) for i in range(ROWS)]


def test_the_batched_noise_is_the_noise_each_row_always_drew():
    batched = gumbel_noise(SEEDS, POSITIONS, VOCAB)
    per_row = mx.stack([mx.random.gumbel((VOCAB,), key=key_for(s, t)) for s, t in zip(SEEDS, POSITIONS)])
    assert np.array(batched).tobytes() == np.array(per_row).tobytes()


def member(params: SamplingParams, context_length: int) -> PlainSource:
    """A one-row member of a pass: a PlainSource has the sampling hooks the runner reads."""
    return PlainSource([], list(range(context_length)), params, SpeculationStats())


@pytest.mark.parametrize("ahead", [0, 1])
def test_a_pass_batches_rows_by_their_sampling_fields_and_each_keeps_its_bits(logits, ahead):
    """Two groups (temperatures differ), a greedy row without logprobs (argmax: nothing built),
    a group of one; every built row as alone, at its position (`ahead` past its next)."""
    kinds = [PARAMS["seeded"], PARAMS["all masks"], PARAMS["seeded"], SamplingParams(temperature=0.0),
             PARAMS["all masks"], PARAMS["top_p"], PARAMS["seeded"]]
    states = [member(replace(params, seed=SEEDS[i]), POSITIONS[i] - ahead) for i, params in enumerate(kinds)]
    pending = presample_pass([(state, [0]) for state in states], logits, [(i, i + 1) for i in range(ROWS)], ahead)
    assert pending[3] is None
    mx.eval([x for p in pending if p is not None for x in p.arrays])
    for i, params in enumerate(kinds):
        if i != 3:
            assert bits(pending[i].result()[0]) == bits(alone(logits, i, params)), f"row {i}"


def test_rows_with_logits_processors_are_not_batched():
    """Penalties, logit_bias and grammars change a row first (the request's own processors)."""
    source = PlainSource([], [1, 2], PARAMS["seeded"], SpeculationStats(), processors=object())
    assert source.row_sampling() is None and not source.presamples


@pytest.mark.parametrize("widest, widths", [(1, [1]), (2, [1, 2]), (7, [1, 2, 4, 7]), (8, [1, 2, 4, 8]),
                                            (24, [1, 2, 4, 8, 16, 24]), (32, [1, 2, 4, 8, 16, 32])])
def test_deterministic_blocks_take_the_powers_of_two_and_the_widest(widest, widths):
    """The widths the batched-sampling proof compares (sampling_proof.proof_widths, and 1: a
    row alone), and a group split into them largest first."""
    assert block_widths(widest) == widths
    for rows in range(1, 70):
        sizes = split_blocks(rows, widest)
        assert sum(sizes) == rows and set(sizes) <= set(widths) and sizes == sorted(sizes, reverse=True)
        assert len([s for s in sizes if s < widest]) <= len(widths) - 1  # each narrower width at most once


def test_a_group_splits_largest_first():
    assert (split_blocks(13, 8), split_blocks(29, 32), split_blocks(29, 24), split_blocks(7, 4)) == \
        ([8, 4, 1], [16, 8, 4, 1], [24, 4, 1], [4, 2, 1])
