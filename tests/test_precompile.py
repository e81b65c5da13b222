"""What a startup compiles before the first forward (kernels/custom/precompile.py): every
instance a model's layers launch at the widths it serves, with test_compiled.py's stand-in
compiler and cache (no GPU nor NVRTC here)."""
import mlx.core as mx
import pytest

from lockstep.kernels.custom import attention, gemv_rows, skinny
from lockstep.kernels.custom.precompile import instances_for, linear_shapes, precompile_for
from tests.test_compiled import FakeCompiler, fresh  # noqa: F401 (a fixture)
from tiny_models import tiny_llama


def test_precompile_for_builds_every_launch_so_serving_compiles_nothing(fresh, monkeypatch):
    compiler = FakeCompiler()
    cache = fresh(compiler)
    monkeypatch.setattr(skinny, "backend", lambda: "cuda")
    shapes = [(576, 576, mx.bfloat16, "gemv_rows"), (1536, 576, mx.bfloat16, "skinny"),
              (4096, 4096, mx.float16, "affine", 64), (96, 128, mx.float32, "skinny")]
    ready = precompile_for(shapes, range(1, 9), attention=[(mx.bfloat16, 64)], workers=4)
    assert ready == cache.compiled == len(set(compiler.sources)) > 0
    for m in range(1, 9):
        if m > 1:
            gemv_rows._launcher(m, 576, 576, mx.bfloat16, None)
        skinny._launcher("cuda", "dense", m, 1536, 576, 0, mx.bfloat16)
        skinny._launcher("cuda", "affine", m, 4096, 4096, 64, mx.float16)
        skinny._launcher("cuda", "dense", m, 96, 128, 0, mx.float32)
    attention._launcher("cuda", mx.bfloat16, 64, 6, 3, 2, 300)
    assert cache.compiled == ready  # nothing left to compile
    assert precompile_for(shapes, range(1, 9), attention=[(mx.bfloat16, 64)]) == ready and cache.compiled == ready


def test_instances_follow_each_kernels_widths():
    def count(shape, widths):
        return len(instances_for([shape], widths))
    assert count((576, 576, mx.float16, "gemv_rows"), [1]) == 0  # one row: MLX's own GEMV
    assert count((576, 576, mx.float16, "gemv_rows"), range(1, 65)) == 63
    assert count((576, 576, mx.float16, "skinny"), range(1, 66)) == 64  # at most 64 rows
    with pytest.raises(ValueError):
        instances_for([(8, 8, mx.float16, "native")], [2])


def test_precompile_for_does_nothing_off_cuda(fresh):
    cache = fresh()
    assert skinny.backend() is None
    assert precompile_for([(576, 576, mx.bfloat16, "skinny")], range(1, 5)) == 0 and cache.compiled == 0


def test_linear_shapes_lists_the_layers_the_forms_send_to_kernels():
    model = tiny_llama(dtype=mx.bfloat16)
    dense = set(linear_shapes(model, dense="skinny"))
    assert (384, 128, mx.bfloat16, "skinny", 0) not in dense  # no fused qkv in llama
    assert {(128, 128, mx.bfloat16, "skinny", 0), (64, 128, mx.bfloat16, "skinny", 0),
            (256, 128, mx.bfloat16, "skinny", 0), (128, 256, mx.bfloat16, "skinny", 0)} <= dense
    assert all(kind == "gemv_rows" for *_, kind, _ in linear_shapes(model, dense="gemv_rows"))
    assert linear_shapes(model, dense="strided_gemv") == []
    quantized = tiny_llama(dtype=mx.bfloat16, quant="affine")
    shapes = linear_shapes(quantized, dense="gemv_rows", quantized="skinny")
    group = quantized.model.layers[0].mlp.up_proj.group_size
    assert (256, 128, mx.bfloat16, "affine", group) in shapes
    assert linear_shapes(quantized, dense="gemv_rows") == [s for s in shapes if s[3] == "gemv_rows"]
