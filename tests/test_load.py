"""models/load.py: how a loaded model's weights are named (the load log, /v1/models)."""
import pytest

from lockstep.models.load import _weights_label


@pytest.mark.parametrize("quantization, label", [
    ({"mode": "nvfp4", "bits": 4, "group_size": 16}, "nvfp4 g16"),  # was "nvfp44"
    ({"mode": "mxfp8", "bits": 8, "group_size": 32}, "mxfp8 g32"),
    ({"bits": 4, "group_size": 64}, "affine 4-bit g64"),  # mlx-lm's affine entries name no mode
    ({"mode": "affine", "bits": 8, "group_size": 32}, "affine 8-bit g32"),
])
def test_a_quantized_models_weights_name_the_format_once(quantization, label):
    assert _weights_label({"quantization": quantization}) == label


def test_dense_and_imported_weights_keep_their_names():
    assert _weights_label({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert _weights_label({"lockstep": {"weights": "q4"}}) == "q4"
    assert _weights_label({}) == "as stored"
