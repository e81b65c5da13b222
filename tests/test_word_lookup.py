"""kernels/invariance/word_lookup.py: a quantized embedding's lookup, one-byte scales gathered
as 32-bit words, gives MLX's own lookup's bits."""
import mlx.core as mx
import mlx.nn as nn
import pytest

from lockstep.kernels.invariance import word_lookup
from lockstep.kernels.invariance.layers import LAYER_SWAPS
from lockstep.kernels.invariance.selftest import bits_equal


@pytest.mark.parametrize("mode, group, bits", [("nvfp4", 16, 4), ("mxfp4", 32, 4), ("mxfp8", 32, 8), ("affine", 64, 4)])
def test_the_lookup_gives_mlxs_bits(monkeypatch, mode, group, bits):
    """One-byte scales are gathered as 32-bit words (the same bytes); affine's float scales
    take MLX's own lookup."""
    table = nn.QuantizedEmbedding.from_embedding(nn.Embedding(300, 128), group, bits, mode=mode)
    ids = mx.array([[3, 299, 0, 3], [7, 8, 9, 10]])
    want = nn.QuantizedEmbedding.__call__(table, ids)
    own = []
    real = word_lookup._own_call
    monkeypatch.setattr(word_lookup, "_own_call", lambda *a: own.append(1) or real(*a))
    table.__class__ = LAYER_SWAPS[nn.QuantizedEmbedding]  # layers.py gives it the word lookup
    got = table(ids)
    assert bits_equal(got, want)
    assert word_lookup.looks_up_words(table) == (mode != "affine") and len(own) == (mode == "affine")
    assert not bits_equal(table(ids[:, ::-1]), want)  # control: other rows' bytes differ
