"""qmv_rows (kernels/custom/qmv_rows.cu) on a CPU, where it cannot run: the order it follows
(MLX's single-row CUDA quantized GEMV, through the NumPy model qmv_order.py), the source
against that model, which arrays it takes, the quantized form that uses it (decode the plain
call, blocks the kernel), its proof and refusal, and the fallback where it is not proven.
The GPU agreement (kernel rows equal to MLX's single-row call at every layer shape of the 8B
and SmolLM2 models) is in bench/results/cuda/."""
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from lockstep.kernels.custom import compiled, qmv_order, qmv_rows
from lockstep.kernels.custom.precompile import instances_for, linear_shapes
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.ops import GEMV_ROWS, MLX_GEMV_ROWS, quantized_rows, quantized_rows_in_one_launch
from lockstep.kernels.invariance.selftest import bits_equal
from tests.doubles import gemv_rows_alone
from tests.test_gemv_rows import one_launch_then_blocks
from tests.doubles.shape_variant import shape_variant_backend
from tiny_models import QUANT_MODES, tiny_llama


def rand(*shape, seed=0, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def quantized(n, k, mode, dtype=mx.bfloat16, seed=1):
    group, bits = QUANT_MODES[mode]
    w, scales, *rest = mx.quantize(rand(n, k, seed=seed, dtype=dtype), group, bits, mode=mode)
    return w, scales, (rest[0] if rest else None), dict(group_size=group, bits=bits, mode=mode)


def values(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


# -- the order ------------------------------------------------------------------------------

@pytest.mark.parametrize("k,ept", [(4096, 16), (576, 16), (384, 16), (14336, 16), (4096, 8), (576, 8), (200, 8)])
def test_every_index_is_taken_once_by_mlxs_lanes_in_mlxs_order(k, ept):
    tiles = qmv_order.lane_tiles(k, ept)
    per_warp = 32 * ept
    # transcribed from MLX's loop: r over full warp tiles, then the tail tile where idx < K
    for lane in range(32):
        expected = [lane * ept + r * per_warp for r in range(k // per_warp)]
        if k % per_warp and lane * ept + k - k % per_warp < k:
            expected.append(lane * ept + k - k % per_warp)
        assert tiles[lane] == expected
    covered = sorted(i for lane in tiles for start in lane for i in range(start, start + ept))
    assert covered == list(range(k))


def test_elements_per_lane_follow_mlxs_rule():
    assert qmv_order.elems_per_thread(16, 4) == 16
    assert qmv_order.elems_per_thread(16, 8) == 8
    assert qmv_order.elems_per_thread(32, 4) == 8
    assert [qmv_order.weight_bits(m, b) for m, (_, b) in sorted(QUANT_MODES.items())] == [4, 4, 8, 4]


@pytest.mark.parametrize("dtype,np_type", [("float16", np.float16), ("float32", np.float32)])
def test_rounding_matches_numpys_casts(dtype, np_type):
    v = np.random.default_rng(0).normal(size=4000) * np.logspace(-9, 4, 4000)
    v = np.concatenate([v, [0.0, 2.0**-24, 3 * 2.0**-25, 65504.0]]) if dtype == "float16" else v
    assert np.array_equal(qmv_order.round_to(v, dtype), v.astype(np_type).astype(np.float64))


def test_bfloat16_rounding_matches_mlxs_cast():
    v = (np.random.default_rng(1).normal(size=4000) * np.logspace(-30, 30, 4000)).astype(np.float32)
    mlx_cast = np.array(mx.array(v).astype(mx.bfloat16).astype(mx.float32)).astype(np.float64)
    assert np.array_equal(qmv_order.round_to(v.astype(np.float64), "bfloat16"), mlx_cast)


@pytest.mark.parametrize("mode", sorted(QUANT_MODES))
def test_the_model_dequantizes_as_mlx_does(mode):
    w, scales, biases, kw = quantized(24, 256, mode)
    model = qmv_order.dequantize(np.array(w), np.array(scales.astype(mx.float32)) if mode == "affine"
                                 else np.array(scales), None if biases is None else values(biases),
                                 dtype="bfloat16", **kw)
    reference = values(mx.dequantize(w, scales, biases, **kw))
    if mode == "affine":  # one rounding or two: at most one bf16 step apart
        np.testing.assert_allclose(model, reference, rtol=2**-7, atol=1e-6)
    else:  # code * scale is exact in T
        assert np.array_equal(model, reference)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mode", sorted(QUANT_MODES))
@pytest.mark.parametrize("k", [576, 384, 1024])
def test_the_model_gives_each_row_its_own_bits_and_the_product(dtype, mode, k):
    mx_dtype = getattr(mx, dtype)
    w, scales, biases, kw = quantized(7, k, mode, mx_dtype)
    wd = values(mx.dequantize(w, scales, biases, **kw).astype(mx_dtype))
    x = values(rand(9, k, seed=2, dtype=mx_dtype))
    w_bits = qmv_order.weight_bits(mode, kw["bits"])
    block = qmv_order.qmv_rows(x, wd, w_bits=w_bits, dtype=dtype)
    for i in range(9):  # f(a[i:i+1]) == f(a)[i:i+1]
        assert np.array_equal(block[i], qmv_order.qmv_rows(x[i : i + 1], wd, w_bits=w_bits, dtype=dtype)[0])
    exact = x @ wd.T
    np.testing.assert_allclose(block, exact, rtol=0.05, atol=0.05 * np.abs(exact).max())


def test_4_bit_weights_accumulate_in_xs_type_not_float32():
    # two tiles of lane 0, element 0: 1 then 2^-9. A bf16 accumulator loses 2^-9 (8 bits),
    # a float32 one (the 8-bit path) keeps it
    k = 1024
    x = np.zeros((1, k))
    w = np.zeros((1, k))
    x[0, 0], w[0, 0] = 1.0, 1.0
    x[0, 512], w[0, 512] = 1.0, 2.0**-9
    in_t = qmv_order.qmv_rows(x, w, w_bits=4, dtype="bfloat16")[0, 0]
    in_f32 = qmv_order.qmv_rows(x, w, w_bits=8, dtype="float32")[0, 0]
    assert in_t == 1.0 and in_f32 == 1.0 + 2.0**-9


def test_the_order_is_not_a_plain_sum():
    k = 512
    x = np.ones((1, k))
    w = np.full((1, k), 2.0**-24)  # lost one by one in a running sum, kept by the lanes
    w[0, 0] = 1.0
    plain = np.float32(0)
    for v in (x[0] * w[0]).astype(np.float32):
        plain = np.float32(plain + v)
    assert qmv_order.qmv_rows(x, w, w_bits=8, dtype="float32")[0, 0] != plain


# -- the source -----------------------------------------------------------------------------

def kernel_tiles(k: int, ept: int, tiles_ahead: int) -> list:
    """The idx each lane computes, in order, as qmv_rows.cu's loop runs them: tiles of 32 * EPT,
    the partial last one where idx < K, TILES at a time."""
    per_warp = 32 * ept
    tiles = -(-k // per_warp)
    lanes = []
    for lane in range(32):
        seen = []
        for t0 in range(0, tiles, tiles_ahead):
            for u in range(tiles_ahead):
                idx = lane * ept + (t0 + u) * per_warp
                if t0 + u < tiles and idx < k:
                    seen.append(idx)
        lanes.append(seen)
    return lanes


@pytest.mark.parametrize("k", [64, 384, 576, 640, 1024, 1536, 4096, 4160, 14336])
@pytest.mark.parametrize("w_bits", [4, 8])
def test_the_tiles_a_warp_loads_ahead_keep_mlx_order(k, w_bits):
    ept = qmv_order.elems_per_thread(16, w_bits)
    ahead = qmv_rows.tiles_ahead(k, w_bits)
    assert ahead == min(qmv_rows.MAX_TILES_AHEAD, max(1, k // (32 * ept)))  # no unrolled tile K never fills
    assert kernel_tiles(k, ept, ahead) == qmv_order.lane_tiles(k, ept)
    assert kernel_tiles(k, ept, qmv_rows.MAX_TILES_AHEAD) == qmv_order.lane_tiles(k, ept)


def test_the_smoke_test_builds_each_of_its_shapes_instance(monkeypatch):
    # the smoke test runs on CUDA alone: its list of instances is checked here
    class Built(Exception):
        pass

    built = []

    def precompile(items, workers=None):
        built.extend(items)
        raise Built

    monkeypatch.setattr(compiled, "precompile", precompile)
    with pytest.raises(Built):
        qmv_rows._smoke_test("nvfp4", 4, mx.bfloat16, 0)
    assert {dict(template)["TILES"] for _, template in built} == {
        qmv_rows.tiles_ahead(k, 4) for _, _, k in qmv_rows.SMOKE_SHAPES}


def test_the_tiles_ahead_are_part_of_the_instance():
    def tiles(k):
        return dict(qmv_rows._launch_plan(16, 576, k, "nvfp4", 4, 16, 0, mx.bfloat16)["template"])["TILES"]
    assert (tiles(576), tiles(1536), tiles(4096), tiles(14336)) == (1, 3, 8, 8)


def test_the_source_follows_the_model():
    text = qmv_rows.SOURCE.read_text()
    assert "constexpr int EPT = BITS <= 4 ? 16 : 8;" in text
    assert "const int tiles = (K + PER_WARP - 1) / PER_WARP;" in text
    assert "for (int t0 = 0; t0 < tiles; t0 += TILES) {" in text
    assert "const int idx = lane * EPT + (t0 + u) * PER_WARP;" in text
    assert "if (t0 + u < tiles && idx < K) compute(idx, v[u]);" in text  # in order, the tail last
    assert "acc_t[m][r][j] = __hfma2(xv[j], wd[r][j], acc_t[m][r][j]);" in text  # T accumulators, 4-bit
    assert "__fmaf_rn(xf.x, wf.x, acc_f[m][r][2 * j])" in text  # float32, 8-bit
    assert "if constexpr (FUSED) return __hfma2(c, s2, b2);" in text
    assert "table[i] = make_pair(from_float<T>(code_value<FMT>(i & 15)), from_float<T>(code_value<FMT>(i >> 4)));" in text
    assert "else return __hadd2_rn(__hmul2_rn(c, s2), b2);" in text
    assert re.search(r"s \+= f\.x;\s*s \+= f\.y;", text)  # the accumulators in order, from 0
    assert "for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync" in text
    for body in qmv_rows._BODIES.values():
        assert body.startswith("lockstep_qmv::qmv_rows<T, ")


@pytest.mark.parametrize("m", [2, 3, 4, 5, 8, 16, 33, 64])
@pytest.mark.parametrize("n", [9, 576, 4096, 14336])
def test_launches_cover_every_output(m, n):
    plan = qmv_rows._launch_plan(m, n, 4096, "nvfp4", 4, 16, 0, mx.bfloat16)
    template = dict(plan["template"])
    rows, columns = template["MR"], template["R"]
    assert rows == qmv_rows.warp_rows(m) and rows in (2, 4)
    assert columns == qmv_rows.warp_columns(n) and columns in (1, 4)
    assert rows * columns * 8 <= 128  # bf16x2 accumulators: 8 registers a (row, column)
    assert (plan["grid"][0] // 32) * columns >= n and plan["grid"][1] * rows >= m
    assert plan["threadgroup"] == (32 * qmv_rows.WARPS_PER_BLOCK, 1, 1)


@pytest.mark.parametrize("mode,bits,group,n,columns", [
    ("affine", 8, 64, 4096, 1), ("affine", 8, 64, 128256, 1), ("mxfp8", 8, 32, 4096, 1),
    ("mxfp8", 8, 32, 14336, 4), ("affine", 4, 64, 4096, 4), ("nvfp4", 4, 16, 1024, 1)])
def test_8bit_weights_take_one_column_a_warp_but_mxfp8s_widest_layers(mode, bits, group, n, columns):
    # 4 columns x 4 rows of 8-bit weights spill; one column ran faster on the H200
    plan = qmv_rows._launch_plan(16, n, 4096, mode, bits, group, 0, mx.bfloat16)
    assert dict(plan["template"])["R"] == columns
    assert (plan["grid"][0] // 32) * columns >= n


def test_which_cases_the_kernel_takes():
    for mode, (group, bits) in QUANT_MODES.items():
        assert qmv_rows.takes(mode, bits, group)
    assert not qmv_rows.takes("affine", 3, 64) and not qmv_rows.takes("nvfp4", 4, 32)
    w, scales, biases, kw = quantized(8, 256, "affine")
    assert qmv_rows.serves(rand(3, 256, dtype=mx.bfloat16), w, scales, biases, **kw)
    assert not qmv_rows.serves(rand(3, 256), w, scales, biases, **kw)  # float32 x
    assert not qmv_rows.serves(rand(65, 256, dtype=mx.bfloat16), w, scales, biases, **kw)
    assert not qmv_rows.serves(rand(3, 256, dtype=mx.float16), w, scales, biases, **kw)  # bf16 scales


# -- the form -------------------------------------------------------------------------------

def test_the_cpu_has_no_qmv_rows_and_blocks_keep_mlxs_chunks():
    assert "follows MLX's CUDA quantized GEMV" in qmv_rows.unavailable_reason()
    assert GEMV_ROWS.quantized_form == "qmv_rows"
    w, scales, biases, kw = quantized(16, 256, "nvfp4")
    x = rand(10, 256, seed=3, dtype=mx.bfloat16)
    assert qmv_rows.try_matmul(x, w, scales, biases, **kw) is None
    got = quantized_rows(x, w, scales, biases, rows_per_call=7, form="qmv_rows", **kw)
    assert bits_equal(got, quantized_rows(x, w, scales, biases, rows_per_call=7, **kw))


@pytest.fixture
def emulated(monkeypatch):
    """qmv_rows (and gemv_rows for dense layers) as if proven here; the test gives the quantized
    kernel's stand-in and sees the rows of each call."""
    calls = []
    gemv_rows_alone.emulate(monkeypatch)

    def use(kernel):
        def run(x, *a, **kw):
            calls.append(x.shape[0])
            return kernel(x, *a, **kw)

        def one_launch(lead, n, k, mode, bits, group, *_):
            # a call's launch, as the canonical linear takes it: x in its shape, the output in its shape
            def launch(x, w, scales, biases=None):
                rows = run(x.reshape(-1, k), w, scales, biases, group_size=group, bits=bits, mode=mode)
                return [rows.reshape(*lead, n)]
            return launch

        monkeypatch.setattr(qmv_rows, "one_launch", one_launch)
        return calls
    return use


def _rows_alone(x, w, scales, biases, **kw):
    """What a correct kernel gives: every row as the plain single-row call."""
    return mx.concatenate([mx.quantized_matmul(x[i : i + 1], w, scales, biases, transpose=True, **kw)
                           for i in range(x.shape[0])], axis=0)


def _one_call(x, w, scales, biases, **kw):
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, **kw)


def test_calls_mlx_runs_per_row_keep_its_call_and_wider_ones_run_the_kernel(emulated):
    """Up to MLX_GEMV_ROWS rows MLX's CUDA call is its per-row GEMV (and costs the host less
    than a custom launch): the call as it is, one of them, whichever function asks; from 8
    rows the kernel, as one launch."""
    calls = emulated(_rows_alone)
    w, scales, biases, kw = quantized(16, 256, "affine")
    x = rand(9, 256, seed=4, dtype=mx.bfloat16)
    for m in (1, 5, MLX_GEMV_ROWS):
        got = quantized_rows(x[:m], w, scales, biases, rows_per_call=7, form="qmv_rows", **kw)
        assert bits_equal(got, _one_call(x[:m], w, scales, biases, **kw)) and calls == []
        wide = quantized_rows_in_one_launch(x[None, :m], w, scales, biases, form="qmv_rows", **kw)
        assert wide.shape == (1, m, 16) and bits_equal(wide[0], _one_call(x[:m], w, scales, biases, **kw))
        assert calls == []
    block = quantized_rows(x, w, scales, biases, rows_per_call=7, form="qmv_rows", **kw)
    assert bits_equal(block, _rows_alone(x, w, scales, biases, **kw)) and calls == [9]


@pytest.mark.parametrize("mode", ["nvfp4", "affine"])
def test_a_kernel_in_mlxs_order_is_proven_and_one_that_is_not_is_refused(emulated, mode):
    # as on CUDA: a quantized call varies from 8 rows (L = 8: its 8-row calls take the kernel)
    with shape_variant_backend(quantized_rows=MLX_GEMV_ROWS + 1):
        emulated(_rows_alone)
        model = tiny_llama(quant=mode, dtype=mx.bfloat16)
        invariance = set_batch_invariant_limit(model, 8, "gemv_rows", prefixes=(7,))
        assert invariance.guaranteed and invariance.strategy == "gemv_rows"
        emulated(_one_call)  # a block call: not the single-row order
        model = tiny_llama(quant=mode, dtype=mx.bfloat16)
        invariance = set_batch_invariant_limit(model, 8, "gemv_rows", prefixes=(7,))
        assert not invariance.guaranteed and "self-test failed" in invariance.reason


def test_mlxs_own_call_below_8_rows_is_proven_only_where_it_keeps_each_rows_bits(emulated):
    """The calls of 2..7 rows the form leaves to MLX are in the proof too: on a backend whose
    quantized calls of 2+ rows vary (negative control), the same form at L = 4 is refused."""
    with shape_variant_backend(quantized_rows=2):
        emulated(_rows_alone)
        invariance = set_batch_invariant_limit(tiny_llama(quant="nvfp4", dtype=mx.bfloat16), 4, "gemv_rows",
                                               prefixes=(7,))
    assert not invariance.guaranteed and "self-test failed" in invariance.reason


def test_one_launch_takes_what_try_matmul_takes(monkeypatch):
    """The launch decided once per call shape: the kernel's traced call where try_matmul would
    run the kernel, None where it would not."""
    monkeypatch.setattr(qmv_rows, "proven_variant", lambda mode, bits, dtype: 0)  # as if proven here
    monkeypatch.setattr(qmv_rows, "_launcher", lambda *shape: ("call", shape))
    monkeypatch.setattr(compiled, "shaped_launch", lambda call, plan, x_shape, shapes: ("launch", x_shape, shapes))
    qmv_rows.one_launch.cache_clear()
    w, scales, biases, kw = quantized(16, 256, "affine")
    x = rand(5, 256, dtype=mx.bfloat16)
    assert qmv_rows.serves(x, w, scales, biases, **kw)
    args = ((5,), 16, 256, "affine", 4, 64, mx.bfloat16, mx.uint32, w.shape[1])
    assert qmv_rows.one_launch(*args, scales.dtype, biases.dtype) == ("launch", (5, 256), [(5, 16)])
    assert qmv_rows.one_launch(*args, mx.float16, biases.dtype) is None  # scales of another dtype
    assert qmv_rows.one_launch(*args[:4], 3, *args[5:], scales.dtype, biases.dtype) is None  # 3-bit
    assert qmv_rows.one_launch((65,), *args[1:], scales.dtype, biases.dtype) is None  # past 64 rows
    assert qmv_rows.one_launch((1, 65), *args[1:], scales.dtype, biases.dtype) is None
    wq, s8, _, _ = quantized(16, 256, "nvfp4")
    # a layer's (1, T, K) call: x taken as it is, the output in the layer's shape (no reshape nodes)
    assert qmv_rows.one_launch((1, 5), 16, 256, "nvfp4", 4, 16, mx.bfloat16, mx.uint32, wq.shape[1], s8.dtype,
                               None) == ("launch", (5, 256), [(1, 5, 16)])
    qmv_rows.one_launch.cache_clear()


def test_a_pass_wider_than_l_runs_each_quantized_linear_as_one_launch(emulated, monkeypatch):
    """A 10-row pass at L = 4: one launch a linear; in blocks of 4 + 4 + 2 instead, each block is
    MLX's own call (fewer than 8 rows), the same bits."""
    calls = emulated(_rows_alone)
    with shape_variant_backend(quantized_rows=MLX_GEMV_ROWS + 1):
        one_launch_then_blocks(tiny_llama(quant="nvfp4", dtype=mx.bfloat16), calls, monkeypatch,
                               "quantized_rows_in_one_launch", block_calls=())


def test_startup_lists_each_quantized_shape_and_builds_only_a_proven_variant(monkeypatch):
    model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    shapes = linear_shapes(model, dense="gemv_rows", quantized="qmv_rows")
    assert (256, 128, mx.bfloat16, "qmv_rows", 16, "nvfp4", 4) in shapes  # the MLP's gate / up
    assert all(s[3] == "qmv_rows" for s in shapes)
    assert instances_for(shapes, range(1, 5)) == []  # nothing proven on the CPU
    monkeypatch.setattr(qmv_rows, "proven_variant", lambda mode, bits, dtype: 0)
    built = instances_for(shapes, range(1, 5))
    # calls of up to 7 rows are MLX's: built is what a pass wider than L launches (8+ rows)
    assert built and {dict(t)["MR"] for _, t in built} == {4}
    assert instances_for(shapes, [1]) == []  # width 1 alone: MLX's own call, nothing built


def test_no_float32_variant_is_compiled_or_smoke_tested(monkeypatch):
    """The kernel pairs values of x's type (half2 / bfloat162): a float32 x is not its case. A
    float32 smoke test would fail to compile on the GPU and switch every qmv_rows kernel off."""
    qmv_rows.proven_variant.cache_clear()
    monkeypatch.setattr(qmv_rows, "backend", lambda: "cuda")
    asked = []
    monkeypatch.setattr(qmv_rows, "smoke_verdict", lambda name, *args: asked.append(name) or None)
    try:
        assert qmv_rows.proven_variant("affine", 4, mx.float32) is None
        assert asked == []
        assert qmv_rows.proven_variant("affine", 4, mx.float16) == 0 and asked  # the double's verdict: a pass
    finally:
        qmv_rows.proven_variant.cache_clear()


def test_a_small_models_layers_take_none_of_lockstep_own_4bit_kernels_and_wide_calls_run_one_launch(
        emulated, monkeypatch):
    """A SmolLM2's nvfp4 layers (hidden 576, k/v 192, MLP 1536; tied head 49,152 x 576) are below
    qmv_mma's and qmv_split's sizes (the head's K is no multiple of qmv_mma's 128), even where
    those kernels run: their one canonical row stays MLX's GEMV, so a deterministic call of
    2..64 rows runs one qmv_rows launch in its order (a pass of 16 rows at L = 8: each of the
    seven linears and the head once, 16 rows each), and one row none."""
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    from lockstep.kernels.custom import qmv_mma, qmv_split, split_rows
    from lockstep.kernels.invariance.layers import calls_in_blocks

    split_launches = []
    monkeypatch.setattr(qmv_mma, "unavailable_reason", lambda *a: None)  # as if both ran here
    for module in (qmv_mma, qmv_split):
        monkeypatch.setattr(module, "launch_for", lambda *a, module=module: split_launches.append(module) or None)
    shapes = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
    for n, k in shapes:
        for rows in (1, 2, 8, 16, 32, 64):
            assert split_rows.kernel_for(n, k, "nvfp4", mx.bfloat16, rows, canonical=True) is None, (n, k, rows)
    calls = emulated(_rows_alone)
    mx.random.seed(0)  # the layer's widths; a small vocabulary (the CPU's time), its head routed as above
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=576, num_hidden_layers=1, intermediate_size=1536, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, vocab_size=512, tie_word_embeddings=True))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=16, bits=4, mode="nvfp4")
    assert set_batch_invariant_limit(model, 8, "gemv_rows", verify=False).strategy == "gemv_rows"
    calls.clear()
    mx.eval(model(mx.array([[7]]), cache=make_prompt_cache(model)))
    assert calls == []  # one row: MLX's own quantized GEMV
    with calls_in_blocks():
        mx.eval(model(mx.arange(16)[None], cache=make_prompt_cache(model)))
    assert calls == [16] * 8 and split_launches == []
    set_batch_invariant_limit(model, 0)
