"""Test double: the sampler (`sampling.sample_pending`, which `RowSampling.batch` calls) as a
backend whose batch kernels change a row's bits from some width on would make it: batches of
`from_rows` rows or more sample their logits nudged by one part in 2**20 (float32), so each
row's logprobs, and some tokens, differ from the row sampled alone; narrower batches and
single rows are the real sampler's."""
from __future__ import annotations

import mlx.core as mx

from lockstep.server.engine.decoding import sampling

NUDGE = 1 + 2 ** -20


def width_variant_sampler(from_rows: int):
    """A stand-in for `sampling.sample_pending` (install it with monkeypatch.setattr)."""
    real = sampling.sample_pending

    def sample_pending(logits, positions, params, model_logits=None, seeds=None):
        if logits.shape[0] >= from_rows:
            logits = logits.astype(mx.float32) * NUDGE
        return real(logits, positions, params, model_logits, seeds)

    return sample_pending
