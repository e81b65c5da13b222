"""quant_rows (kernels/custom/quant_rows.py), what qmv_split and qmv_mma share, on a CPU: the
smoke test's common part run on stand-ins for a kernel (it passes rows that never depend on
the call, and names the fault of one whose rows do, one off the product, and one its own check
refuses), which calls a kernel takes, and the verdict off CUDA."""
import mlx.core as mx
import numpy as np

from lockstep.kernels.custom import quant_rows

SHAPES = ((3, 20, 256), (5, 9, 512))


def rows_alone(x, w, scales, biases, **kw):
    return mx.concatenate([mx.quantized_matmul(x[i : i + 1], w, scales, biases, transpose=True, **kw)
                           for i in range(x.shape[0])], axis=0)


def width_dependent(x, w, scales, biases, **kw):
    y = rows_alone(x, w, scales, biases, **kw)
    return y if x.shape[0] == 1 else y * (1 + 2.0 ** -6)


def off_the_product(x, w, scales, biases, **kw):
    return rows_alone(x, w, scales, biases, **kw) * 1.5


def test_rows_that_never_depend_on_the_call_pass_every_format():
    for mode in quant_rows.GROUPS:
        assert quant_rows.smoke_rows(rows_alone, mode, mx.float16, SHAPES, 3) is None


def test_the_smoke_test_names_each_fault():
    assert "rows differ from the one-row call" in quant_rows.smoke_rows(width_dependent, "nvfp4", mx.float16, SHAPES, 3)
    assert "off the dequantized product" in quant_rows.smoke_rows(off_the_product, "affine", mx.float16, SHAPES, 3)
    seen = []

    def check(shape, x, wq, scales, biases, block, group):
        seen.append((shape, group))
        return "not the model's" if shape == SHAPES[1] else None

    problem = quant_rows.smoke_rows(rows_alone, "affine", mx.bfloat16, SHAPES, 3, check)
    assert problem == f"affine g32 {mx.bfloat16} 5x9x512: not the model's" and seen == [(SHAPES[0], 32), (SHAPES[1], 32)]


def test_which_calls_fit():
    kw = dict(max_rows=8, k_multiple=128)
    args = ("nvfp4", 4, 16, mx.bfloat16, mx.uint32, 512 // 8, mx.uint8, None)
    assert quant_rows.fits(8, 512, *args, **kw)
    assert not quant_rows.fits(9, 512, *args, **kw)  # more rows than the kernel takes
    assert not quant_rows.fits(8, 512 + 32, "nvfp4", 4, 16, mx.bfloat16, mx.uint32, 544 // 8, mx.uint8, None, **kw)
    assert not quant_rows.fits(8, 512, "nvfp4", 4, 16, mx.float32, mx.uint32, 512 // 8, mx.uint8, None, **kw)
    assert not quant_rows.takes("affine", 8, 64) and quant_rows.takes("mxfp4", 4, 32)


def test_off_cuda_no_kernel_is_proven():
    asked = []
    reason = quant_rows.verdict("qmv_mma", "nvfp4", mx.bfloat16, lambda: asked.append(1), quant_rows.VALUES, __file__)
    assert "CUDA" in reason and asked == []


def test_every_finite_e4m3_scale_is_exact_in_float16_and_in_either_x_type():
    # quant_values.cuh converts nvfp4's two scales of a chunk by the hardware's e4m3 -> float16
    # pair conversion, then to T: the same values as the one-by-one path only where each step
    # is exact.
    from lockstep.kernels.custom.loop_order import e4m3

    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    values = np.asarray(e4m3(codes), np.float32)
    assert np.isfinite(values).all() and values.max() == 448 and values.min() == -448
    assert np.array_equal(values.astype(np.float16).astype(np.float32), values)
    for dtype in (mx.float16, mx.bfloat16):
        assert np.array_equal(np.array(mx.array(values).astype(dtype).astype(mx.float32)), values)


def test_mlx_quantize_never_writes_an_e4m3_nan_scale():
    # The two codes the hardware conversion reads otherwise (NaN) never occur in nvfp4 weights,
    # not even for huge or infinite weights: MLX saturates the scale at 448 (0x7E).
    for scale in (1.0, 1e4, 1e30, float("inf")):
        w = mx.random.normal((8, 256), key=mx.random.key(1)).astype(mx.bfloat16) * scale
        _, scales = mx.quantize(w, 16, 4, mode="nvfp4")
        codes = np.array(scales).astype(np.uint8)
        assert not ((codes & 0x7F) == 0x7F).any()
    assert ((codes & 0x7F) == 0x7E).any()  # the infinite weights' scales saturate


def test_both_tensor_and_split_kernels_take_scales_by_pairs():
    from lockstep.kernels.custom import qmv_mma, qmv_split

    values = quant_rows.VALUES.read_text()
    assert "if constexpr (FMT == 1 && SCALES == 2 && kE4M3Pairs)" in values
    assert 'asm("cvt.rn.f16x2.e4m3x2 %0, %1;"' in values and "__CUDA_ARCH__ >= 890" in values
    for kernel in (qmv_split, qmv_mma):
        source = kernel.SOURCE.read_text()
        assert "scale_values<T, FMT, SCALES>(" in source and "scale_value<T, FMT>(" not in source
