"""kernels/custom/one_row.py: which layers take the one-row kernel, and that the batch-invariance
forms keep such a layer's one-row call on it (and give the layer back as it was). The kernel's
bits (MLX's own quantized GEMV's) are its smoke test's, on a CUDA GPU."""
import mlx.core as mx
import mlx.nn as nn
import pytest

from lockstep.kernels.custom import one_row, qmv_rows
from lockstep.kernels.custom.one_row import OneRowQuantizedLinear, remove_one_row_kernels, use_one_row_kernels
from lockstep.kernels.invariance import layers, set_batch_invariant_limit
from lockstep.kernels.invariance.limit import uncovered_parts
from tests.tiny_models import tiny_llama


def test_one_row_columns_takes_large_4bit_layers_only():
    assert qmv_rows.one_row_columns("nvfp4", 4, 14336, 4096) == 1
    assert qmv_rows.one_row_columns("mxfp4", 4, 4096, 14336) == 1
    assert qmv_rows.one_row_columns("affine", 4, 128256, 4096) == 2
    assert qmv_rows.one_row_columns("nvfp4", 4, 4096, 4096) is None  # q/o: MLX's call is faster
    assert qmv_rows.one_row_columns("mxfp8", 8, 14336, 4096) is None
    assert qmv_rows.one_row_columns("affine", 8, 14336, 4096) is None


def test_nothing_swapped_off_cuda():
    model = tiny_llama(quant="affine", dtype=mx.bfloat16)
    assert use_one_row_kernels(model) == 0
    assert all(type(m) is not OneRowQuantizedLinear for _, m in model.named_modules())


@pytest.fixture
def one_row_model(monkeypatch):
    """A tiny bf16 affine-4 model whose first q_proj is a one-row layer; the kernel's call is
    recorded and stood in for by MLX's own (the kernel runs on CUDA only)."""
    calls = []

    def recorded(layer, x):
        calls.append(x.shape)
        return nn.QuantizedLinear.__call__(layer, x)

    monkeypatch.setattr(one_row, "one_row_call", recorded)
    monkeypatch.setattr(layers, "one_row_call", recorded)
    model = tiny_llama(quant="affine", dtype=mx.bfloat16)
    q = model.model.layers[0].self_attn.q_proj
    q._one_row_fused, q._one_row_columns = 0, 2
    q.__class__ = OneRowQuantizedLinear
    yield model, q, calls
    set_batch_invariant_limit(model, 0)


def test_one_row_layer_takes_its_kernel_only_for_one_row(one_row_model):
    model, q, calls = one_row_model
    x = mx.random.normal((1, 3, 128)).astype(mx.bfloat16)
    q(x[:, :1])
    assert calls == [(1, 1, 128)]
    q(x)
    q(x[:, :1].astype(mx.float32))  # a dtype the kernel does not take: MLX's call
    assert calls == [(1, 1, 128)]


def test_forms_keep_the_one_row_kernel_and_give_the_layer_back(one_row_model):
    model, q, calls = one_row_model
    set_batch_invariant_limit(model, 2, "rowwise", verify=False)
    assert type(q) is layers.InvariantOneRowQuantizedLinear
    assert not [p for p in uncovered_parts(model) if "q_proj" in p]
    x = mx.random.normal((1, 3, 128)).astype(mx.bfloat16)
    setting = model._lockstep_setting
    with layers.batch_invariant(setting):
        with layers.calls_in_blocks():
            q(x[:, :1])  # a deterministic pass's one row: the plain call, so the kernel
            q(x[:, :2])  # two rows: the canonical form
        with layers.native_forms():
            q(x[:, :1])
            q(x)
    assert calls == [(1, 1, 128), (1, 1, 128)]
    set_batch_invariant_limit(model, 0)
    assert type(q) is OneRowQuantizedLinear
    remove_one_row_kernels(model)
    assert type(q) is nn.QuantizedLinear
