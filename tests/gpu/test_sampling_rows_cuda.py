"""Several requests' rows sampled as one batch on the GPU (sampling.RowSampling.batch): at
Llama-3's vocabulary (128,256) with bf16 logits, every row of a batch of 2..32 rows has the
token, logprob and top-alternative bits the row gets sampled alone, greedy and seeded, with
top-k / top-p / min-p: the device's reductions, sorts and scans keep a row's order whatever the
rows beside it. Negative control: a batch keyed on one seed differs from the rows alone.
The batched-sampling proof the server makes at startup (server/engine/decoding/sampling_proof.py)
compares the widths the engine batches deterministic rows in (powers of two up to 32) and
credits, on this device, exactly those of them this file's own comparison shows keep every
row's bits; a group of 29 rows then samples in blocks of those widths only."""
import struct
from dataclasses import replace

import mlx.core as mx
import pytest

from lockstep.server.engine.decoding.sampling import RowSampling, SamplingParams, sample_pending, split_blocks
from lockstep.server.engine.decoding.sampling_proof import proof_widths, prove_batched_sampling

pytestmark = pytest.mark.gpu

VOCAB = 128_256
PARAMS = {
    "greedy with logprobs": SamplingParams(temperature=0.0, top_logprobs=5),
    "seeded, logprobs": SamplingParams(temperature=0.8, top_logprobs=5),
    "top_k": SamplingParams(temperature=0.8, top_k=40),
    "top_p": SamplingParams(temperature=1.0, top_p=0.9, top_logprobs=2),
    "min_p": SamplingParams(temperature=1.1, min_p=0.05),
    "all masks": SamplingParams(temperature=0.7, top_k=50, top_p=0.95, min_p=0.02, top_logprobs=4),
}


def bits(sampled) -> tuple:
    pack = lambda x: None if x is None else struct.pack("<f", x)  # noqa: E731
    return (sampled.token, pack(sampled.logprob), tuple((t, pack(v)) for t, v in sampled.top_logprobs))


def logits_rows(rows: int) -> mx.array:
    out = (mx.random.normal((rows, VOCAB), key=mx.random.key(rows)) * 3).astype(mx.bfloat16)
    mx.eval(out)
    return out


WIDEST = 32


def batch_keeps_bits(rows: int, params: SamplingParams) -> bool:
    logits = logits_rows(rows)
    specs = [RowSampling(replace(params, seed=1000 + i), 500 + 7 * i) for i in range(rows)]
    batch = RowSampling.batch(logits, specs)
    mx.eval([x for pending in batch for x in pending.arrays])
    alone = [sample_pending(logits[i:i + 1], [spec.position], spec.params).result()[0] for i, spec in enumerate(specs)]
    return [bits(p.result()[0]) for p in batch] == [bits(a) for a in alone]


@pytest.mark.parametrize("rows", [2, 8, 16, 32])
@pytest.mark.parametrize("name", PARAMS)
def test_every_row_of_a_batch_has_its_bits_alone(rows, name):
    assert batch_keeps_bits(rows, PARAMS[name])


def test_the_startup_proof_credits_the_widths_this_comparison_shows():
    """The widths the engine runs (2, 4, .., WIDEST) compared here, every form; the proof (its
    own logits, seeds and forms) must credit the same widths: all of them where these all keep
    their bits, else fewer than the first width that differs here. A group of 29 rows then
    splits into proven widths only."""
    assert proof_widths(WIDEST) == [2, 4, 8, 16, 32]
    first_differs = next((rows for rows in proof_widths(WIDEST)
                          if not all(batch_keeps_bits(rows, params) for params in PARAMS.values())), None)
    proof = prove_batched_sampling(VOCAB, mx.bfloat16, WIDEST)
    if first_differs is None:
        assert proof.rows == WIDEST and proof.widths == proof_widths(WIDEST), proof.reason
    else:
        assert proof.rows < first_differs, proof.reason
    assert set(split_blocks(29, proof.rows)) <= {1, *proof.widths}


def test_negative_control_a_batch_keyed_on_one_seed_differs():
    logits = logits_rows(16)
    params = replace(PARAMS["seeded, logprobs"], seed=1000)
    positions = [500 + 7 * i for i in range(16)]
    shared = sample_pending(logits, positions, params).result()
    alone = [sample_pending(logits[i:i + 1], [t], replace(params, seed=1000 + i)).result()[0]
             for i, t in enumerate(positions)]
    assert [bits(s) for s in shared] != [bits(a) for a in alone]
