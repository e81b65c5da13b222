"""Test double: MLX's quantized matmul with the tiled-path fault of upstream MLX PR #3912.

On Metal, when a quantized dim was 16 mod 32 (only nvfp4's group 16 allows that), the
tiled kernels (used from M >= 33 rows) went wrong while decode (M = 1) stayed right:
fp_qmm_t ran its K loop past the end of the row, fp_qmm_n stored full 32-column tiles
into 16-column tails. `faulty_tiled_qmm()` reproduces that behaviour on any backend by
wrapping `mx.quantized_matmul` (mlx.nn's quantized layers look it up on each call):

- transpose=True (K quantized): the last 16 columns of x are counted again, as if the
  loop read one more half-tile of garbage;
- transpose=False (N quantized): the 16-column output tail holds garbage.

It proves the audit catches such a fault and that its workaround avoids it.
`faulty_tiled_qmm(any_width=True)` is a tiled fault that padding cannot avoid (every width
goes wrong from 33 rows): pad32 then fixes some paths of a layer and not others.
"""
from __future__ import annotations

import contextlib

import mlx.core as mx

TILED_MIN_ROWS = 33
_HALF_TILE = 16


def _rows(x: mx.array) -> int:
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    return rows


def make_faulty(real, any_width: bool = False):
    def quantized_matmul(x, w, scales=None, biases=None, transpose=True, group_size=None,
                         bits=None, mode="affine", **kwargs):
        y = real(x, w, scales=scales, biases=biases, transpose=transpose,
                 group_size=group_size, bits=bits, mode=mode, **kwargs)
        if _rows(x) < TILED_MIN_ROWS:
            return y  # decode / short-block kernels are fine
        if any_width:
            return y + 1.0
        if transpose and x.shape[-1] % 32 == _HALF_TILE:
            overrun = x[..., -_HALF_TILE:].sum(axis=-1, keepdims=True)
            return y + overrun.astype(y.dtype)
        if not transpose and y.shape[-1] % 32 == _HALF_TILE:
            garbage = mx.full((*y.shape[:-1], _HALF_TILE), 1e3, dtype=y.dtype)
            return mx.concatenate([y[..., :-_HALF_TILE], garbage], axis=-1)
        return y
    quantized_matmul.faulty = True
    return quantized_matmul


@contextlib.contextmanager
def faulty_tiled_qmm(any_width: bool = False):
    """Within the block, `mx.quantized_matmul` has the tiled 16-mod-32 fault (`any_width`:
    the tiled kernels are wrong at every width)."""
    real = mx.quantized_matmul
    mx.quantized_matmul = make_faulty(real, any_width)
    try:
        yield
    finally:
        mx.quantized_matmul = real
