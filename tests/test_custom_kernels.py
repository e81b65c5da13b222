"""The skinny matmul kernels (kernels/custom/) on a CPU, where they cannot run: their loop
order through the NumPy model the .cu/.metal sources follow (tails, group boundaries,
dims = 16 mod 32), the strategy that uses them, its selection by proof, and the fallback to
today's forms when the kernels are unavailable or wrong. The GPU proof is the self-test on
the H200 (bench/results/cuda/invariant_8b.md)."""
import re
import tomllib
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
import numpy as np
import pytest

from lockstep.kernels import custom
from lockstep.kernels.custom import loop_order, mma_order, skinny
from tests.doubles import skinny_launch
from tests.doubles.shape_variant import shape_variant_backend
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.ops import SKINNY, STRATEGIES, dense_rows, quantized_rows
from lockstep.kernels.invariance.selftest import bits_equal, self_test
from tiny_models import QUANT_MODES, tiny_llama

ROOT = Path(__file__).resolve().parents[1]


def rand(*shape, seed=0, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


# -- the loop order -------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 7, 8, 31, 48, 100, 256, 4100, 14336])
@pytest.mark.parametrize("unit", [4, 8, 32])
def test_every_k_is_reduced_once_by_one_lane_in_order(k, unit):
    lanes = loop_order.lane_schedule(k, unit)
    visited = sorted(kk for ks in lanes for kk in ks)
    assert visited == list(range(k))
    for lane, ks in enumerate(lanes):
        assert ks == sorted(ks)
        # unit u (the partial tail unit included) belongs to lane u % 32
        assert all((kk // unit) % loop_order.LANES == lane for kk in ks)


def test_the_tail_unit_goes_to_the_lane_after_the_last_full_unit():
    k, unit = 48, 32  # nvfp4 K = 16 mod 32: one full unit, then 16 codes
    lanes = loop_order.lane_schedule(k, unit)
    assert lanes[0] == list(range(32)) and lanes[1] == list(range(32, 48))
    assert all(not ks for ks in lanes[2:])


@pytest.mark.parametrize("m", range(1, loop_order.MAX_ROWS + 1))
def test_accumulators_fit_and_launch_covers_every_column(m):
    cols = loop_order.columns_per_warp(m)
    assert cols * m <= 64
    for n in (1, 16, 33, 48, 4096, 128256):
        threads = loop_order.launch_threads(n, cols, skinny.THREADS_PER_BLOCK)
        assert threads % skinny.THREADS_PER_BLOCK == 0
        assert (threads // loop_order.LANES) * cols >= n  # every column has a warp
        assert (threads - skinny.THREADS_PER_BLOCK) // loop_order.LANES * cols < n  # no spare block


@pytest.mark.parametrize("dtype,k", [(mx.float32, 100), (mx.bfloat16, 100), (mx.float16, 48), (mx.bfloat16, 4100)])
def test_model_matches_matmul_with_k_tails(dtype, k):
    m, n = 3, 48
    x, w = rand(m, k, dtype=dtype), rand(n, k, seed=1, dtype=dtype)
    got = loop_order.skinny_matmul(f32(x), f32(w), loop_order.unit_elements(dtype.size))
    want = f32(x).astype(np.float64) @ f32(w).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(k))


# -- the tensor-core kernel's index model (skinny_mma.cu) ------------------------------------

@pytest.mark.parametrize("bits", [16, 4])
@pytest.mark.parametrize("k", [16, 48, 80, 100, 128, 4100, 4112, 14336])
def test_mma_every_k_is_in_exactly_one_slot_and_padding_is_past_k(bits, k):
    if bits == 4 and k % 16:
        return  # 4-bit K is a multiple of the group (16 at least)
    seen = np.concatenate([ks for mmas in mma_order.schedule(k, bits) for ks in mmas])
    assert np.array_equal(np.sort(seen[seen < k]), np.arange(k))
    assert len(seen) - k < mma_order.chunk_elements(bits)  # only the last chunk is padded


@pytest.mark.parametrize("bits", [16, 4])
def test_mma_slots_follow_each_lanes_contiguous_load(bits):
    run = mma_order.run_elements(bits)
    for j in range(run // 4):
        ks = mma_order.mma_elements(chunk=2, j=j, weight_bits=bits)
        for q in range(mma_order.LANE_GROUPS):
            # lane group q: slots 2q, 2q+1, 2q+8, 2q+9 = 4 consecutive elements of its run
            held = ks[[2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9]]
            base = 2 * mma_order.chunk_elements(bits) + q * run + 4 * j
            assert list(held) == [base, base + 1, base + 2, base + 3]


@pytest.mark.parametrize("group", [16, 32, 64, 128])
def test_mma_a_lanes_4bit_run_lies_in_one_quantization_group(group):
    run = mma_order.run_elements(4)
    for chunk in range(20):
        for q in range(mma_order.LANE_GROUPS):
            start = chunk * mma_order.chunk_elements(4) + q * run  # the lane's one scale load
            assert len({k // group for k in range(start, start + run)}) == 1


@pytest.mark.parametrize("m", [1, 16, 17, 33, 64])
@pytest.mark.parametrize("n", [1, 576, 1024, 4096, 14336, 49152, 128256])
def test_mma_column_tiles_cover_every_column_and_fit_shared_memory(n, m):
    tiles = skinny.mma_column_tiles(n, m)
    assert tiles in (1, 2, 4)
    row_tiles = -(-m // skinny.MMA_ROW_TILE)
    partial_bytes = mma_order.WARPS * row_tiles * tiles * 32 * 4 * 4  # skinny_mma.cu `partial`
    assert partial_bytes <= 32 * 1024
    blocks = -(-n // (skinny.MMA_COLUMNS * tiles))
    assert blocks * skinny.MMA_COLUMNS * tiles >= n > (blocks - 1) * skinny.MMA_COLUMNS * tiles


@pytest.mark.parametrize("bits,k", [(16, 100), (16, 4100), (4, 48), (4, 4112)])
def test_mma_model_matches_matmul_and_rows_do_not_depend_on_neighbours(bits, k):
    x, w = rand(19, k, dtype=mx.bfloat16), rand(24, k, seed=1, dtype=mx.bfloat16)
    got = mma_order.skinny_mma(f32(x), f32(w), bits)
    want = f32(x).astype(np.float64) @ f32(w).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(k))
    for row in (0, 8, 17):
        alone = mma_order.skinny_mma(f32(x[row : row + 1]), f32(w), bits)
        assert np.array_equal(got[row].view(np.uint32), alone[0].view(np.uint32))


def test_mma_source_matches_the_models_constants():
    text = (ROOT / "kernels/custom/skinny_mma.cu").read_text()
    assert f"constexpr int WARPS = {mma_order.WARPS};" in text
    assert skinny.MMA_WARPS == mma_order.WARPS
    assert "m16n8k16" in text and skinny.MMA_ROW_TILE == 16 and skinny.MMA_COLUMNS == 8


def test_a_rows_bits_do_not_depend_on_its_neighbours():
    x, w = rand(9, 200, dtype=mx.bfloat16), rand(17, 200, seed=1, dtype=mx.bfloat16)
    block = loop_order.skinny_matmul(f32(x), f32(w), 8)
    for row in (0, 4, 8):
        alone = loop_order.skinny_matmul(f32(x[row : row + 1]), f32(w), 8)
        assert np.array_equal(block[row].view(np.uint32), alone[0].view(np.uint32))


def test_the_reduction_order_is_not_a_plain_sum():
    # A control for the test above: the model's order is observable, so a different
    # unit size (another split of K) changes some bits.
    x, w = rand(4, 1000), rand(33, 1000, seed=1)
    a = loop_order.skinny_matmul(f32(x), f32(w), 4)
    b = loop_order.skinny_matmul(f32(x), f32(w), 8)
    assert not np.array_equal(a, b)


def test_nvfp4_dequantization_is_exact_across_groups_and_16_mod_32_dims():
    for n, k in ((48, 48), (16, 80), (80, 112)):  # K and N = 16 mod 32, groups of 16
        w = rand(n, k, seed=k)
        wq, scales = mx.quantize(w, mode="nvfp4")
        mine = loop_order.dequantize(np.array(wq), np.array(scales), None, group_size=16, mode="nvfp4")
        ref = f32(mx.dequantize(wq, scales, mode="nvfp4"))
        assert np.array_equal(mine, ref)


@pytest.mark.parametrize("group", skinny.AFFINE_GROUPS)
def test_affine_dequantization_uses_each_groups_scale_and_bias(group):
    n, k = 48, group * 3
    # groups of very different magnitude: a group index off by one is far off
    w = rand(n, k) * mx.repeat(mx.array([1.0, 100.0, 10000.0]), group)[None]
    wq, scales, biases = mx.quantize(w, group, 4)
    mine = loop_order.dequantize(np.array(wq), np.array(scales), np.array(biases), group_size=group,
                                 mode="affine")
    ref = f32(mx.dequantize(wq, scales, biases, group, 4))
    # fused (kernel) vs separate multiply-add: a rounding of the group's magnitude apart; a
    # wrong group index would be off by the groups' 100x ratio
    magnitude = np.repeat(np.abs(ref).reshape(n, 3, group).max(axis=2), group, axis=1)
    assert np.all(np.abs(mine - ref) <= magnitude * 2.0**-21)


def test_e4m3_decoding_covers_subnormals_and_signs():
    codes = np.arange(256)
    values = loop_order.e4m3(codes)
    assert values[0x01] == 2.0**-9 and values[0x08] == 2.0**-6 and values[0x38] == 1.0
    assert values[0x7E] == 448.0 and values[0xB8] == -1.0
    finite = values[(codes & 0x7F) != 0x7F]
    assert len(np.unique(finite)) == 253  # +0 and -0 compare equal: 254 codes, 253 values


# -- the sources and the loader ---------------------------------------------------------------

def test_every_kernel_source_file_is_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = sorted(str(p.relative_to(ROOT / "kernels")) for ext in ("c", "cu", "cuh", "metal")
                     for p in (ROOT / "kernels").rglob(f"*.{ext}"))
    assert sources and sorted(data["lockstep.kernels"]) == sources


def test_kernel_sources_are_package_data_and_define_what_the_loader_calls():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for which, name in skinny.SOURCE_FILES.items():
        assert f"custom/{name}" in data["lockstep.kernels"]
        text = skinny.source_text(which)
        bodies = (skinny._MMA_BODIES.values() if which == "cuda_mma" else
                  [body for (backend, _), body in skinny._BODIES.items() if backend == which])
        for body in bodies:
            function = re.match(r"lockstep(?:_mma)?::(\w+)<", body).group(1)
            assert re.search(rf"\b{function}\(", text), f"{function} missing from {name}"


def test_the_cpu_has_no_custom_kernels_and_says_why():
    assert skinny.backend() is None and not custom.available()
    assert "no custom-kernel API" in custom.unavailable_reason()
    assert "no custom-kernel API" in SKINNY.unavailable_reason(8)
    assert "at most 64 rows" in SKINNY.unavailable_reason(65)
    assert STRATEGIES["strided_gemv"].unavailable_reason(65) is None


@pytest.mark.parametrize("mode,bits,group,kind", [
    ("affine", 4, 32, "affine"), ("affine", 4, 128, "affine"), ("nvfp4", 4, 16, "nvfp4"),
    ("affine", 8, 64, None), ("mxfp4", 4, 32, None), ("mxfp8", 8, 32, None), ("affine", 4, 16, None),
])
def test_which_quantizations_have_a_kernel(mode, bits, group, kind):
    assert skinny.quantized_kind(mode, bits, group) == kind


# -- selection and fallback -----------------------------------------------------------------

@pytest.mark.reference_blas
def test_auto_without_kernels_skips_them_for_todays_forms():
    with shape_variant_backend():  # native fails the proof, so auto reaches the kernels
        invariance = set_batch_invariant_limit(tiny_llama(), 4, prefixes=(7,))
    assert invariance.strategy == "strided_gemv" and invariance.guaranteed
    assert [name for name, _, _ in invariance.candidates] == ["native", "strided_gemv"]


@pytest.mark.reference_blas
def test_auto_past_a_failing_strided_gemv_skips_kernels_that_cannot_run(strided_fails):
    with shape_variant_backend():
        invariance = set_batch_invariant_limit(tiny_llama(), 4, prefixes=(7,))
    assert invariance.strategy == "rowwise" and invariance.guaranteed
    assert "skipped: " in invariance.reason and "skinny (no custom-kernel API" in invariance.reason
    assert [name for name, _, _ in invariance.candidates] == ["native", "strided_gemv", "rowwise"]



def test_asking_for_skinny_without_kernels_runs_todays_forms_unclaimed():
    model = tiny_llama(dtype=mx.bfloat16)
    invariance = set_batch_invariant_limit(model, 4, "skinny", prefixes=(7,))
    assert invariance.strategy == "skinny" and not invariance.guaranteed and "cannot run" in invariance.reason
    x, w = rand(3, 128, dtype=mx.bfloat16), model.model.layers[0].mlp.up_proj.weight
    assert bits_equal(dense_rows(x, w, "skinny"), dense_rows(x, w, "strided_gemv"))
    with shape_variant_backend():  # the fallback is still canonical
        assert self_test(model, 4, prefixes=(7,)).passed


def _emulated_kernel(unit_for_rows):
    """A stand-in for the GPU kernel on the CPU: the NumPy loop-order model, with the unit
    size chosen by `unit_for_rows(M)` (a correct kernel ignores M)."""
    def dense(x, w):
        out = loop_order.skinny_matmul(f32(x), f32(w), unit_for_rows(x.shape[0], x.dtype.size))
        return mx.array(out).astype(x.dtype)
    return dense


@pytest.fixture
def strided_fails(monkeypatch):
    """strided_gemv as a form that fails the proof (native rows), so auto goes past it."""
    from lockstep.kernels.invariance.ops import STRATEGIES, Strategy

    broken = Strategy("strided_gemv", dense="native", quantized_rows=0, attention="per_query_contiguous")
    monkeypatch.setitem(STRATEGIES, "strided_gemv", broken)


@pytest.fixture
def kernels_here(monkeypatch):
    """Pretend the kernels compiled here; the test sets which dense kernel runs."""
    monkeypatch.setattr(custom, "unavailable_reason", lambda: None)
    monkeypatch.setattr(custom, "available", lambda: True)

    def use(dense):
        monkeypatch.setattr(custom, "dense_matmul", dense)
        skinny_launch.emulate(monkeypatch, dense)
    return use


@pytest.mark.reference_blas
def test_auto_picks_the_kernels_once_proven_where_strided_gemv_is_not(kernels_here, strided_fails):
    calls = []
    correct = _emulated_kernel(lambda m, size: loop_order.unit_elements(size))
    kernels_here(lambda x, w: calls.append(x.shape[0]) or correct(x, w))
    model = tiny_llama()
    with shape_variant_backend():
        invariance = set_batch_invariant_limit(model, 4, prefixes=(7,))
    assert invariance.strategy == "skinny" and invariance.guaranteed
    assert [(n, ok) for n, ok, _ in invariance.candidates] == [("native", False), ("strided_gemv", False),
                                                         ("skinny", True)]
    assert 1 in calls and 4 in calls  # decode's single row runs the kernel too


@pytest.mark.reference_blas
def test_a_kernel_that_fails_the_proof_is_never_kept(kernels_here, strided_fails):
    # wrong on purpose: K split by a unit size that changes with M
    kernels_here(_emulated_kernel(lambda m, size: 4 if m == 1 else 8))
    model = tiny_llama()
    with shape_variant_backend():
        invariance = set_batch_invariant_limit(model, 4, prefixes=(7,))
    assert invariance.guaranteed and invariance.strategy == "rowwise"
    assert [(n, ok) for n, ok, _ in invariance.candidates] == [("native", False), ("strided_gemv", False),
                                                         ("skinny", False), ("rowwise", True)]


@pytest.mark.parametrize("mode", sorted(QUANT_MODES))
def test_quantized_layers_use_the_kernel_only_where_it_has_the_mode(kernels_here, monkeypatch, mode):
    group_size, bits = QUANT_MODES[mode]
    x = rand(5, 128)
    w, scales, *biases = mx.quantize(rand(48, 128, seed=1), group_size, bits, mode=mode)
    biases = biases[0] if biases else None
    kw = dict(group_size=group_size, bits=bits, mode=mode)
    marker = mx.full((5, 48), 7.0)
    monkeypatch.setattr(custom, "quantized_matmul", lambda *a, **k: marker)
    got = quantized_rows(x, w, scales, biases, rows_per_call=7, form="skinny", **kw)
    chunks = quantized_rows(x, w, scales, biases, rows_per_call=7, **kw)
    if skinny.quantized_kind(mode, bits, group_size):
        assert bits_equal(got, marker)
    else:
        assert bits_equal(got, chunks) and not bits_equal(chunks, marker)


def test_the_skinny_strategy_packs_every_attention_call_decode_included(monkeypatch):
    # MLX's CUDA SDPA gives a strided cache view other bits than a packed copy, so decode
    # and each row of a block must both see packed q/k/v.
    packed = []
    native = mx.contiguous
    monkeypatch.setattr(mx, "contiguous", lambda a, *r, **k: packed.append(a.shape) or native(a, *r, **k))
    model = tiny_llama()
    set_batch_invariant_limit(model, 4, "skinny", verify=False)
    cache = mlx_cache.make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3, 4, 5, 6, 7]]), cache=cache))  # M > L: native, unpacked
    assert packed == []
    mx.eval(model(mx.array([[8]]), cache=cache))  # decode
    assert (1, 2, 8, 32) in packed and len(packed) == 3 * 2  # q, k, v in each of 2 layers
    packed.clear()
    mx.eval(model(mx.array([[9, 10]]), cache=cache))  # a block: each query packed
    assert (1, 2, 9, 32) in packed and (1, 2, 10, 32) in packed and len(packed) == 3 * 2 * 2


@pytest.mark.parametrize("name", sorted(p.name for ext in ("cu", "cuh", "metal")
                                        for p in (ROOT / "kernels" / "custom").glob(f"*.{ext}")))
def test_compacted_kernel_source_keeps_every_code_token(name):
    text = (ROOT / "kernels" / "custom" / name).read_text()
    compact = skinny.compact_source(text)
    assert "//" not in compact and len(compact) < 0.8 * len(text)
    assert compact.split() == re.sub(r"//[^\n]*", "", text).split()


def test_launch_plans_are_built_once_per_shape(monkeypatch):
    monkeypatch.setattr(skinny, "_kernel", lambda which, kind: (which, kind))  # no CUDA here
    skinny._launch_plan.cache_clear()
    a = skinny._launch_plan("cuda", "dense", 8, 576, 576, 0, mx.float16)
    b = skinny._launch_plan("cuda", "dense", 8, 576, 576, 0, mx.float16)
    assert a is b and skinny._launch_plan.cache_info().hits == 1
    kernel, launch = a
    assert kernel == ("cuda_mma", "dense") and launch["output_shapes"] == [(8, 576)] and [t[0] for t in launch["template"]] == ["T", "R8", "NT"]
    _, affine = skinny._launch_plan("cuda", "affine", 3, 96, 128, 64, mx.bfloat16)
    assert affine["template"][-1] == ("GROUP", 64)
    _, scalar = skinny._launch_plan("cuda", "affine", 3, 96, 128, 64, mx.float32)
    assert [t[0] for t in scalar["template"]] == ["T", "M", "NC", "K", "GROUP"]
    skinny._launch_plan.cache_clear()  # plans made with the stand-in kernel go


def test_the_dense_launch_is_decided_once_per_call_shape(monkeypatch):
    """A layer's call of x (lead + (K,)): the kernel's launch where it runs here and takes the
    call (1..64 rows, a float dtype), taking x as it is and giving the layer's output shape (no
    reshape nodes on CUDA's precompiled path); None elsewhere."""
    from lockstep.kernels.custom import compiled

    skinny.dense_one_launch.cache_clear()
    assert skinny.dense_one_launch((1, 1), 64, 64, mx.float16) is None  # the CPU: no kernel API
    monkeypatch.setattr(skinny, "backend", lambda: "cuda")
    monkeypatch.setattr(skinny, "_availability", lambda which: None)
    monkeypatch.setattr(skinny, "_launcher", lambda *shape: ("call", shape))
    monkeypatch.setattr(compiled, "shaped_launch", lambda call, plan, x_shape, shapes: (plan, x_shape, shapes))
    skinny.dense_one_launch.cache_clear()
    # decode's (1, 1, K) call and a pass's (1, T, K): x taken as it is, the output in the layer's shape
    assert skinny.dense_one_launch((1, 1), 48, 64, mx.bfloat16) == (("cuda", "dense", 1, 48, 64, 0, mx.bfloat16),
                                                                     (1, 64), [(1, 1, 48)])
    assert skinny.dense_one_launch((1, 10), 48, 64, mx.float16)[1:] == ((10, 64), [(1, 10, 48)])
    assert skinny.dense_one_launch((65,), 48, 64, mx.float16) is None
    assert skinny.dense_one_launch((10,), 48, 64, mx.int32) is None
    skinny.dense_one_launch((10,), 48, 64, mx.float16)
    skinny.dense_one_launch((10,), 48, 64, mx.float16)
    assert skinny.dense_one_launch.cache_info().hits == 1
    monkeypatch.setattr(skinny, "_availability", lambda which: "failed its smoke test")
    skinny.dense_one_launch.cache_clear()
    assert skinny.dense_one_launch((10,), 48, 64, mx.float16) is None
    skinny.dense_one_launch.cache_clear()


@pytest.mark.reference_blas
def test_auto_tries_skinny_first_where_cuda_runs_16_bit_activations_on_tensor_cores(kernels_here, monkeypatch):
    correct = _emulated_kernel(lambda m, size: loop_order.unit_elements(size))
    kernels_here(correct)
    monkeypatch.setattr(custom, "uses_mma", lambda dtype: dtype in (mx.float16, mx.bfloat16))  # as on CUDA
    with shape_variant_backend():  # native fails the proof, so auto reaches the next candidate
        half = set_batch_invariant_limit(tiny_llama(dtype=mx.bfloat16), 4, prefixes=(7,))
        single = set_batch_invariant_limit(tiny_llama(), 4, prefixes=(7,))
    assert [(n, ok) for n, ok, _ in half.candidates] == [("native", False), ("skinny", True)]
    assert [(n, ok) for n, ok, _ in single.candidates] == [("native", False), ("strided_gemv", True)]
    assert half.strategy == "skinny" and half.guaranteed and single.strategy == "strided_gemv"
