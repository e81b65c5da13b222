"""kernels/invariance/layers.py: the widths of the calls a setting lets through.

The guarantee rests on kernels proven for calls of at most L rows. On the CPU backends a row
keeps its bits at any width, so a bitwise test cannot see a call of L + 1 rows there: these
tests count the widths the canonical forms are called with instead.
"""
import mlx.core as mx
import mlx.nn as nn
import pytest

from lockstep.kernels.invariance import layers
from lockstep.kernels.invariance.layers import LAYER_SWAPS, Setting, batch_invariant, calls_in_blocks
from lockstep.kernels.invariance.ops import ROWWISE
from lockstep.kernels.invariance.selftest import bits_equal

L = 4


@pytest.fixture
def widths(monkeypatch):
    """The row count of every canonical dense call; one-launch kernels declined (the blocks'
    path, as on a backend without lockstep's row kernels)."""
    seen = []
    real = layers.dense_rows

    def spy(x, weight, form):
        seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, weight, form)

    monkeypatch.setattr(layers, "dense_rows", spy)
    monkeypatch.setattr(layers, "dense_rows_in_one_launch", lambda *args: None)
    return seen


def linear():
    layer = nn.Linear(64, 32)
    layer.__class__ = LAYER_SWAPS[nn.Linear]
    return layer


@pytest.mark.parametrize("rows", [L + 1, 2 * L + 1, 3 * L])
def test_a_wide_deterministic_call_runs_in_blocks_of_at_most_l_rows(widths, rows):
    layer = linear()
    x = mx.random.normal((rows, 64), key=mx.random.key(0))
    with batch_invariant(Setting(L, ROWWISE)), calls_in_blocks():
        wide = layer(x)
        blocks = list(widths)
        alone = [layer(x[i:i + 1]) for i in range(rows)]
    assert blocks == [min(L, rows - i) for i in range(0, rows, L)]
    assert max(blocks) <= L and sum(blocks) == rows
    assert all(bits_equal(wide[i:i + 1], alone[i]) for i in range(rows))


def test_outside_the_engines_wide_passes_a_wide_call_is_native(widths):
    layer = linear()
    x = mx.random.normal((L + 1, 64), key=mx.random.key(1))
    with batch_invariant(Setting(L, ROWWISE)):
        layer(x)
    assert widths == []  # a prompt chunk wider than L: the model's own call, no canonical form

