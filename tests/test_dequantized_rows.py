"""dequantized_rows (kernels/custom/dequantized_rows.py): which calls take the path (wide plain
calls of large 4-bit layers, on CUDA only), its smoke test against the audit's NumPy decoding
(passing the path, refusing a faulty decode), and a layer's wide plain call running it while
narrower and canonical calls do not. Its speed: docs/BENCHMARKS.md, "Prompt chunks"."""
import mlx.core as mx
import pytest

from lockstep.kernels.custom import dequantized_rows, qmv_split, split_rows
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.layers import batch_invariant, native_forms
from lockstep.kernels.invariance.selftest import bits_equal
from tests.test_qmv_rows import rand
from tests.test_qmv_split import rows_alone, split  # noqa: F401 (a fixture)
from tiny_models import tiny_llama

@pytest.fixture
def on_cuda(monkeypatch):
    """The path counts as on CUDA and smoke-tested; every call it runs is recorded (rows)."""
    calls = []
    matmul = dequantized_rows.matmul

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0] if x.ndim == 2 else x.shape[0] * x.shape[1])
        return matmul(x, *args, **kwargs)

    monkeypatch.setattr(dequantized_rows, "runs_here", lambda: True)
    monkeypatch.setattr(dequantized_rows, "unavailable_reason", lambda *a: None)
    monkeypatch.setattr(dequantized_rows, "matmul", counted)
    return calls


def test_wide_plain_calls_of_a_large_layer_take_it_on_cuda_alone(on_cuda, monkeypatch):
    def kernel(n, k, rows, canonical=False):
        return split_rows.kernel_for(n, k, "nvfp4", mx.bfloat16, rows, canonical)

    for (n, k), wide in (((14336, 4096), 256), ((4096, 14336), 256), ((4096, 4096), 384), ((1024, 4096), 512)):
        assert dequantized_rows.min_rows(n, k) == wide  # larger layers gain from fewer rows
        assert kernel(n, k, wide) is dequantized_rows and kernel(n, k, 4 * wide) is dequantized_rows
        assert kernel(n, k, wide - 1) is None  # MLX's quantized matmul
        assert kernel(n, k, wide, canonical=True) is not dequantized_rows
    assert kernel(128256, 4096, 4096) is None  # a head: no dense copy of a vocabulary
    monkeypatch.setattr(dequantized_rows, "runs_here", lambda: False)
    assert kernel(14336, 4096, 256) is None


@pytest.mark.parametrize("mode", ["nvfp4", "affine"])
def test_the_smoke_test_passes_the_path_and_refuses_a_faulty_decode(mode, monkeypatch):
    assert dequantized_rows._smoke_test(mode, mx.bfloat16) is None
    matmul = dequantized_rows.matmul

    def faulty(x, wq, scales, biases, **kw):  # one output column's weights decoded wrong
        y = matmul(x, wq, scales, biases, **kw)
        return mx.concatenate([y[:, :1] * 1.25, y[:, 1:]], axis=1)

    monkeypatch.setattr(dequantized_rows, "matmul", faulty)
    problem = dequantized_rows._smoke_test(mode, mx.bfloat16)
    assert problem is not None and "off the audit's reference" in problem


def test_on_the_cpu_the_path_is_not_taken():
    assert dequantized_rows.unavailable_reason("nvfp4", mx.bfloat16) is not None
    assert split_rows.kernel_for(14336, 4096, "nvfp4", mx.bfloat16, 4096, False) is None


def test_a_layer_runs_its_wide_plain_calls_through_it(on_cuda, split):
    split(rows_alone)  # the tiny model's 4-bit layers count as large; canonical rows take qmv_split's stand-in
    model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    assert set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,)).guaranteed
    layer = model.model.layers[0].mlp.down_proj
    k = layer.weight.shape[1] * 8
    wide = dequantized_rows.min_rows(layer.weight.shape[0], k)
    kw = dict(group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
    for rows, canonical, through in ((wide, False, True), (wide - 1, False, False), (wide, True, False)):
        on_cuda.clear()
        x = rand(1, rows, k, seed=rows, dtype=mx.bfloat16)
        with batch_invariant(model._lockstep_setting) if canonical else native_forms():
            got = layer(x)
        assert on_cuda == ([rows] if through else []), (rows, canonical)
        if through:
            assert bits_equal(got, dequantized_rows.matmul(x, layer.weight, layer.scales, None, **kw))
        elif not canonical:
            assert bits_equal(got, mx.quantized_matmul(x, layer.weight, layer.scales, None, transpose=True, **kw))
    set_batch_invariant_limit(model, 0)


def test_prompt_chunks_run_native_forms_where_a_layer_would_take_it(on_cuda, monkeypatch):
    """A deployment's plain prompt chunks leave the setting's forms (Deployment.plain_prompt_native)
    only where some layer's plain call of a chunk's rows takes the path."""
    monkeypatch.setattr(qmv_split, "MIN_ELEMENTS", 0)  # the tiny model's 4-bit layers count as large
    quantized = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    assert split_rows.prompt_chunks_native(quantized, 512)
    assert not split_rows.prompt_chunks_native(quantized, 511)  # layers this small take it from 512 rows
    assert not split_rows.prompt_chunks_native(tiny_llama(dtype=mx.bfloat16), 512)  # no 4-bit layer
    monkeypatch.setattr(dequantized_rows, "runs_here", lambda: False)
    assert not split_rows.prompt_chunks_native(quantized, 512)
