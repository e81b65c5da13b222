"""MoE expert rows in one call on the GPU (kernels/invariance/expert_rows.py), at Qwen3-30B-A3B's
expert layout (hidden 2048, 128 experts of 768, top-8), bf16 and nvfp4 (with and without a
per-expert global scale): every row of a one-call pass of 1..16 rows (8..128 (row, expert)
elements: mlx-lm's own call sorts from 64) has the bits of the row's own decode call, and the
proof installs the form for a model of such blocks. Negative control: mlx-lm's own call of 16
rows (sorted, tiled kernels) does not keep every row's bits."""
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

from lockstep.kernels.invariance import expert_rows
from lockstep.kernels.invariance.selftest import bits_equal

pytestmark = pytest.mark.gpu

HIDDEN, EXPERT_HIDDEN, EXPERTS, TOP_K = 2048, 768, 128, 8
ROWS = 16


def experts(fmt: str) -> SwitchGLU:
    mx.random.seed(7)
    block = SwitchGLU(HIDDEN, EXPERT_HIDDEN, EXPERTS)
    block.set_dtype(mx.bfloat16)
    if fmt == "nvfp4":
        nn.quantize(block, group_size=16, bits=4, mode="nvfp4")
    elif fmt == "nvfp4_global_scale":
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(block, name, getattr(block, name).to_quantized(16, 4, mode="nvfp4", global_scale=True))
    mx.eval(block.parameters())
    return block


def inputs(rows: int, seed: int = 11):
    x = mx.random.normal((1, rows, HIDDEN), key=mx.random.key(seed)).astype(mx.bfloat16)
    scores = mx.random.uniform(shape=(rows, EXPERTS), key=mx.random.key(seed + 1))
    indices = mx.argsort(scores, axis=-1)[:, :TOP_K].astype(mx.uint32)[None]
    mx.eval(x, indices)
    return x, indices


def alone(block, x, indices):
    return [SwitchGLU.__call__(block, x[:, i:i + 1], indices[:, i:i + 1]) for i in range(x.shape[1])]


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "nvfp4_global_scale"])
def test_every_row_of_one_call_of_1_to_16_rows_is_its_decode_call(fmt):
    block = experts(fmt)
    x, indices = inputs(ROWS)
    decode = alone(block, x, indices)
    mx.eval(decode)
    differing = []
    for width in range(1, ROWS + 1):
        together = expert_rows.one_call(block, x[:, :width], indices[:, :width])
        mx.eval(together)
        differing += [(width, i) for i in range(width) if not bits_equal(together[:, i:i + 1], decode[i])]
    assert differing == []
    assert expert_rows.first_divergence(block, ROWS, mx.bfloat16, TOP_K) is None


def test_mlx_lms_own_sorted_call_does_not_keep_every_rows_bits():
    block = experts("bf16")
    x, indices = inputs(ROWS)
    native = block(x, indices)  # 128 (row, expert) pairs: sorted by expert
    assert not all(bits_equal(native[:, i:i + 1], d) for i, d in enumerate(alone(block, x, indices)))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_the_proof_installs_one_call_for_a_model_of_these_blocks(fmt):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.switch_mlp = experts(fmt)
            self.num_experts_per_tok = TOP_K

    proof = expert_rows.prove_one_call(Model(), ROWS, dtype=mx.bfloat16)
    assert proof.one_call_rows == ROWS, proof.reason
