"""models/quantize.py: mode validation, dense-layer reporting, float32 compute, convert."""
import json
import logging

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model as mlx_load_model
from mlx_lm.utils import quantize_model

from lockstep.models.errors import ModelError
from lockstep.models.quantize import (convert, dir_size, is_quantized_module, quantize_model_in_memory,
                             resolve_spec)
from lockstep.server.cli import main as cli_main
from tests.synthetic import llama_config, random_llama, write_model_dir

SMALL = dict(hidden=1040, intermediate=2064, layers=1, vocab=256)


@pytest.mark.parametrize("mode, bits, group", [
    ("affine", 4, 64), ("mxfp4", 4, 32), ("mxfp8", 8, 32), ("nvfp4", 4, 16)])
def test_mode_defaults(mode, bits, group):
    spec = resolve_spec(mode)
    assert (spec.bits, spec.group_size) == (bits, group)


@pytest.mark.parametrize("mode, bits, group, words", [
    ("nvfp4", 8, None, "nvfp4 cannot store 8-bit"),
    ("mxfp4", None, 64, "mxfp4 does not support group size 64"),
    ("mxfp8", 4, None, "mxfp8 cannot store 4-bit"),
    ("affine", None, 16, "affine does not support group size 16"),
    ("int4", None, None, "unknown quantization mode"),
])
def test_impossible_combinations_refused(mode, bits, group, words):
    with pytest.raises(ValueError, match=words):
        resolve_spec(mode, bits, group)


def test_layers_left_dense_are_reported(caplog):
    # 1040 and 2064 are not multiples of 32: mxfp4 cannot quantize any projection.
    config = llama_config(**SMALL)
    model = random_llama(config)
    with caplog.at_level(logging.WARNING, logger="lockstep.models.quantize"):
        result = quantize_model_in_memory(model, config, "mxfp4", progress=False)
    dense = {d.path for d in result.dense}
    assert "model.layers.0.mlp.down_proj" in dense and "model.embed_tokens" in dense
    assert len(dense) == 8  # q k v o gate up down + embedding
    assert result.quantized == []
    assert result.bits_per_weight > 31  # i.e. nothing was quantized
    assert "LEFT DENSE" in caplog.text and "model.layers.0.mlp.up_proj" in caplog.text


def test_nvfp4_odd_element_count_left_dense_not_crashing():
    # 385 x 1040 weights is 16 mod 32: MLX's CPU nvfp4 quantize cannot reshape it.
    config = llama_config(**{**SMALL, "vocab": 385})
    with pytest.raises(ValueError, match="reshape"):
        quantize_model(random_llama(config), config, None, None, mode="nvfp4")
    result = quantize_model_in_memory(random_llama(config), config, "nvfp4", progress=False)
    assert [d.path for d in result.dense] == ["model.embed_tokens"]
    assert "multiple of 32" in result.dense[0].reason
    assert "model.layers.0.mlp.down_proj" in result.quantized


def test_half_model_computes_in_float32_on_cpu():
    config = llama_config(hidden=512, intermediate=1024, heads=8, layers=1, vocab=256)
    model = random_llama(config)
    model.set_dtype(mx.float16)
    result = quantize_model_in_memory(model, config, "affine", 8, 64, progress=False)
    layer = result.model.model.layers[0].mlp.down_proj
    assert is_quantized_module(layer) and layer.scales.dtype == mx.float32
    assert result.model.model.norm.weight.dtype == mx.float32
    assert result.model(mx.array([[3, 4, 5]])).dtype == mx.float32


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    config = llama_config(**SMALL)
    return write_model_dir(random_llama(config), config, tmp_path_factory.mktemp("fp32"))


def test_convert_writes_loadable_dir(float_dir, tmp_path):
    dst = tmp_path / "nv"
    result = convert(float_dir, dst, "nvfp4", progress=False)
    assert result.size_bytes == dir_size(dst) > 0
    assert result.size_bytes < dir_size(float_dir) / 4  # 4.5 bits vs 32
    model, config = mlx_load_model(dst)
    assert config["quantization"]["mode"] == "nvfp4"
    assert model.model.layers[0].mlp.down_proj.mode == "nvfp4"
    note = json.loads((dst / "lockstep_quantization.json").read_text())
    assert note["left_dense"] == []


def test_convert_refuses_nonempty_destination(float_dir, tmp_path):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(ModelError, match="not empty"):
        convert(float_dir, tmp_path, "mxfp8", progress=False)


def test_cli_convert(float_dir, tmp_path, capsys):
    assert cli_main(["convert", str(float_dir), str(tmp_path / "a"), "--q-mode", "mxfp8"]) == 0
    out = capsys.readouterr().out
    assert "layers left dense" in out and "model.layers.0.self_attn.q_proj" in out
    assert cli_main(["convert", str(float_dir), str(tmp_path / "b"),
                     "--q-mode", "nvfp4", "--q-bits", "8"]) == 1
    assert not (tmp_path / "b").exists()
