"""dequantized_rows on the GPU (kernels/custom/dequantized_rows.py): its smoke test passes here
for the 4-bit formats, and an 8B-shaped nvfp4 model's prompt-wide plain calls take it (every
linear but the head) with L = 0 and L = 8, close to the audit's NumPy reference, while canonical
calls of the same width and plain calls narrower than its rows keep their own paths; such a
model's plain prompt chunks leave the setting's forms for it, a bf16 model's do not."""
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from lockstep.kernels.audit.probes import tolerance
from lockstep.kernels.audit.reference import reference_dequantize
from lockstep.kernels.custom import dequantized_rows, split_rows
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.layers import batch_invariant, native_forms, uninstall
from tests.gpu.cuda_cases import rand
from tests.gpu.test_guarantee_cuda import eight_b_layers

pytestmark = pytest.mark.gpu

@pytest.mark.parametrize("mode", ["nvfp4", "affine", "mxfp4"])
def test_its_smoke_test_passes_here(mode):
    assert dequantized_rows._smoke_test(mode, mx.bfloat16) is None
    assert dequantized_rows.unavailable_reason(mode, mx.bfloat16) is None


@pytest.fixture(scope="module")
def model():
    return eight_b_layers("nvfp4", layers=1)


@pytest.mark.parametrize("limit", [0, 8])
def test_wide_plain_calls_take_it_and_canonical_ones_do_not(model, limit, monkeypatch):
    calls = []
    matmul = dequantized_rows.matmul
    monkeypatch.setattr(dequantized_rows, "matmul", lambda x, *a, **k: calls.append(x.shape) or matmul(x, *a, **k))
    invariance = set_batch_invariant_limit(model, limit)  # L = 0: the plain calls' kernels alone
    assert invariance.guaranteed if limit else invariance.layers.get("split_rows"), invariance.reason
    try:
        linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
        assert len(linears) == 8
        for name, layer in linears:
            k = layer.weight.shape[1] * 32 // layer.bits
            wide = dequantized_rows.min_rows(layer.weight.shape[0], k)
            x = rand((1, wide, k), mx.bfloat16, 3)
            calls.clear()
            with native_forms():
                got = layer(x)
            mx.eval(got)
            assert calls == ([] if name == "lm_head" else [x.shape]), name
            ref = np.array(x[0].astype(mx.float32)) @ reference_dequantize(
                layer.weight, layer.scales, None, layer.mode, layer.bits, layer.group_size).T
            error = np.max(np.abs(np.array(got[0].astype(mx.float32)) - ref)) / np.max(np.abs(ref))
            assert error <= tolerance(layer.mode, "bfloat16"), (name, error)
            calls.clear()
            mx.eval(layer(x[:, : wide - 1]))
            assert calls == [], name
            if limit:
                with batch_invariant(model._lockstep_setting):
                    mx.eval(layer(x))
                assert calls == [], name
    finally:
        uninstall(model)


def test_a_deployments_plain_prompt_chunks_leave_the_setting_for_it(model):
    """serve's Deployment.plain_prompt_native: an 8B nvfp4 model's 512-row prompt chunks would
    take the path; a bf16 model's would not (nothing to gain: they keep the setting's forms)."""
    assert split_rows.prompt_chunks_native(model, 512)
    assert not split_rows.prompt_chunks_native(eight_b_layers("bf16", layers=1), 512)
