"""quant_rows (kernels/custom/quant_rows.py), what qmv_split and qmv_mma share, on a CPU: the
smoke test's common part run on stand-ins for a kernel (it passes rows that never depend on
the call, and names the fault of one whose rows do, one off the product, and one its own check
refuses), which calls a kernel takes, and the verdict off CUDA."""
import mlx.core as mx

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
