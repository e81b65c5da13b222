"""The mma_rows strategy on the GPU (kernels/custom/mma_rows.py, kernels/invariance/ops.py): a
bf16 model's large dense layers run their canonical rows, one row included, through skinny's
tensor-core kernel; auto keeps it for a 16-bit model on CUDA; every row of calls of 1..L rows,
and of a wide deterministic call's one launch (up to 64 rows), has its one-row bits, at each
of an 8B's layer shapes and a small model's head (bfloat16; float16 at one shape). (The kernel's
closeness to its order model, mma_order.py, is test_kernels_cuda.py's skinny section.)"""
import mlx.core as mx
import mlx.nn as nn
import pytest

from lockstep.kernels.custom import mma_rows, skinny
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.layers import batch_invariant
from lockstep.kernels.invariance.ops import dense_rows, dense_rows_in_one_launch
from tests.gpu.cuda_cases import LINEARS, SMOL_LINEARS, L, rand, rows_alone, widths_keeping_row_bits
from tests.gpu.test_guarantee_cuda import eight_b_layers

pytestmark = pytest.mark.gpu

WIDE = (33, 48, 64)  # a wide deterministic call in one launch: up to the kernel's 64 rows
SHAPES = {**LINEARS, "small_head": SMOL_LINEARS["head"]}


def test_auto_keeps_mma_rows_for_a_bf16_model_and_its_layers_one_row_is_the_tensor_core_kernels():
    model = eight_b_layers("bf16", layers=1)
    invariance = set_batch_invariant_limit(model, 8)
    try:
        assert invariance.guaranteed and invariance.strategy == "mma_rows", invariance.reason
        linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        assert len(linears) == 8  # q, k, v, o, gate, up, down, head
        x = rand((8, 4096), mx.bfloat16, 40)
        moved = 0
        for name, layer in linears:
            w = layer["weight"]
            assert mma_rows.form_for(*w.shape, mx.bfloat16, w.dtype) == "skinny", name
            xs = x if w.shape[1] == 4096 else rand((8, w.shape[1]), mx.bfloat16, 41)
            with batch_invariant(model._lockstep_setting):
                one = layer(xs[:1])
            mx.eval(one)
            assert mx.array_equal(one, skinny.dense_matmul(xs[:1], w)).item(), name
            moved += not mx.array_equal(one, xs[:1] @ w.T).item()  # MLX's GEMV: other bits
        assert moved > 0
    finally:
        set_batch_invariant_limit(model, 0)


CASES = [f"{linear} bfloat16" for linear in SHAPES] + ["q_o float16"]


@pytest.mark.parametrize("case", CASES)
def test_rows_keep_their_one_row_bits_at_every_width_and_in_one_wide_launch(case):
    linear, name = case.split()
    dtype = getattr(mx, name)
    n, k = SHAPES[linear]
    x, w = rand((max(WIDE), k), dtype, 42), rand((n, k), dtype, 43)
    assert mma_rows.form_for(n, k, dtype, dtype) == "skinny"

    def call(r):
        return dense_rows(r, w, "mma_rows")

    alone = rows_alone(call, x)
    assert mx.array_equal(alone, rows_alone(lambda r: skinny.dense_matmul(r, w), x)).item()
    assert widths_keeping_row_bits(call, x, alone, range(1, L + 1)) == []
    assert widths_keeping_row_bits(lambda r: dense_rows_in_one_launch(r, w, "mma_rows"), x, alone, WIDE) == []
