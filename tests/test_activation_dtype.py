"""models/activation_dtype.py: a GGUF import's float32 parameters run as float16 on a GPU
(bfloat16 with nvfp4 / mxfp4 / mxfp8 layers: the activations, and so lockstep's 16-bit kernels,
with them), and stay float32 on the CPU or where --weights float32 asks for them; the served
load applies it (the GPU check patched in here)."""
import mlx.core as mx
from mlx.utils import tree_flatten
import pytest

from lockstep.models import activation_dtype
from lockstep.models.activation_dtype import FP_MODES_DTYPE, GPU_DTYPE, cast_float32, served_dtype
from lockstep.server import model_loading
from tiny_models import tiny_llama


@pytest.mark.parametrize("weights, gguf, gpu, want", [
    ("auto", True, True, GPU_DTYPE),  # the default model on a GPU (with --quantize too)
    ("q4", True, True, GPU_DTYPE),
    ("float32", True, True, None),  # asked for
    ("auto", True, False, None),  # the CPU runs float32 fastest
    ("auto", False, True, None),  # a model directory keeps its own dtypes
])
def test_which_loads_run_16_bit(weights, gguf, gpu, want):
    assert served_dtype(weights, gguf, gpu) == want
    assert served_dtype(weights, gguf, gpu, fp_modes=True) == (want and FP_MODES_DTYPE)


def test_only_float32_parameters_are_cast():
    model = tiny_llama(quant="affine")
    before = dict(tree_flatten(model.parameters()))
    floats = [k for k, a in before.items() if a.dtype == mx.float32]
    assert floats and any(a.dtype == mx.uint32 for a in before.values())
    assert cast_float32(model, mx.float16) == len(floats)
    after = dict(tree_flatten(model.parameters()))
    assert all(after[k].dtype == (mx.float16 if k in floats else a.dtype) for k, a in before.items())
    assert cast_float32(model, mx.float16) == 0


def _served(monkeypatch, gpu: bool, weights="auto", quantize=None):
    monkeypatch.setattr(activation_dtype, "on_gpu", lambda: gpu)
    return model_loading.load_audited("default", weights, quantize, None, None, audit="off")


@pytest.mark.parametrize("quantize, want", [("nvfp4", mx.bfloat16), ("mxfp4", mx.bfloat16),
                                            ("mxfp8", mx.bfloat16), ("affine", mx.float16)])
def test_every_activation_of_a_quantized_import_keeps_the_served_dtype(monkeypatch, quantize, want):
    """--quantize on a GPU: one 16-bit dtype from the embedding's lookup to the logits. MLX
    dequantizes nvfp4 / mxfp4 / mxfp8 to bfloat16, so float16 norms beside them would promote
    every activation after the first norm to float32 (the logits' dtype shows it)."""
    loaded, _, transform = _served(monkeypatch, gpu=True, quantize=quantize)
    assert ";" + str(want).removeprefix("mlx.core.") + ";" in transform + ";"
    model = loaded.model
    tokens = mx.array([[1, 2, 3]])
    assert model.model.embed_tokens(tokens).dtype == want
    assert model(tokens).dtype == want


def test_the_embedded_model_computes_in_float16_where_a_gpu_serves_it(monkeypatch):
    loaded, _, transform = _served(monkeypatch, gpu=True)
    dtypes = {a.dtype for _, a in tree_flatten(loaded.model.parameters())}
    assert mx.float32 not in dtypes and mx.float16 in dtypes and ";float16" in transform
    assert loaded.model(mx.array([[1, 2, 3]])).dtype == mx.float16
    # the negative control: the CPU's load keeps float32
    loaded, _, transform = _served(monkeypatch, gpu=False)
    assert loaded.model(mx.array([[1, 2, 3]])).dtype == mx.float32 and "float16" not in transform


def test_the_audit_command_audits_the_model_as_a_gpu_serves_it(monkeypatch):
    """`lockstep audit` probes the layers `serve` runs: float16 where a GPU serves a GGUF import."""
    from lockstep.kernels import audit
    from lockstep.server.cli import main as cli_main

    audited = []

    def audit_model(model, **kwargs):
        audited.append({a.dtype for _, a in tree_flatten(model.parameters())})
        raise ValueError("recorded")  # the command reports it and stops: the probes are not the point

    monkeypatch.setattr(audit, "audit_model", audit_model)
    for gpu in (True, False):
        monkeypatch.setattr(activation_dtype, "on_gpu", lambda g=gpu: g)
        assert cli_main(["audit", "default"]) == 1
    assert mx.float32 not in audited[0] and mx.float16 in audited[0]
    assert mx.float32 in audited[1]  # the CPU's: the negative control


def test_a_quantized_model_kept_in_float32_on_a_gpu_is_named_at_load(monkeypatch, caplog):
    """--weights float32 on a GPU: the load says what float32 gives up; the float16 load does not."""
    with caplog.at_level("WARNING", logger="lockstep.runtime"):
        _served(monkeypatch, gpu=True, weights="q4")
        assert "computes in float32" not in caplog.text
        monkeypatch.setattr(activation_dtype, "served_dtype", lambda *args: None)  # as --weights float32 keeps it
        _served(monkeypatch, gpu=True, weights="q4")
        assert "computes in float32 on a GPU" in caplog.text


def test_a_directory_mixing_bfloat16_lookups_with_float16_norms_is_named_on_a_gpu(monkeypatch):
    """An nvfp4 model whose other parameters are float16 (mlx-lm's converter from a float16
    model) computes in float32: the load names it on a GPU; its bfloat16 twin is not named."""
    import mlx.nn as nn

    monkeypatch.setattr(activation_dtype, "on_gpu", lambda: True)
    notes, models = {}, {}
    for dtype in (mx.float16, mx.bfloat16):
        model = models[dtype] = tiny_llama()
        model.set_dtype(dtype)
        nn.quantize(model, group_size=16, bits=4, mode="nvfp4")
        notes[dtype] = (activation_dtype.float32_note(model), model(mx.array([[1, 2]])).dtype)
    assert notes[mx.float16][1] == mx.float32 and "after its first float16 layer" in notes[mx.float16][0]
    assert notes[mx.bfloat16] == (None, mx.bfloat16)
    monkeypatch.setattr(activation_dtype, "on_gpu", lambda: False)
    assert activation_dtype.float32_note(models[mx.float16]) is None  # the CPU computes float32 anyway
