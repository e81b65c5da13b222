"""gemv_rows (kernels/custom/gemv_rows.cu) on a CPU, where it cannot run: the order it follows
(MLX's single-row CUDA GEMV, through the NumPy model gemv_order.py), how warps are shaped, the
strategy that uses it, its selection by proof and the fallback when it is unavailable or
wrong. The GPU proof (every row equal to MLX's plain single-row call, M = 2..64, three dtypes,
SmolLM2 and 8B shapes; self-test at L = 32 on the 8B shape) is in bench/results/cuda/."""
import re

import mlx.core as mx
import numpy as np
import pytest

from lockstep.kernels.custom import compiled, gemv_order, gemv_rows, loop_order
from tests.doubles import gemv_rows_alone
from tests.doubles.shape_variant import shape_variant_backend
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.limit import AUTO_CANDIDATES, CUDA_16BIT_AUTO_CANDIDATES
from lockstep.kernels.invariance.ops import GEMV_ROWS, STRATEGIES, dense_rows
from lockstep.kernels.invariance.selftest import bits_equal, self_test
from tiny_models import tiny_llama


def rand(*shape, seed=0, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


# -- the order ------------------------------------------------------------------------------

@pytest.mark.parametrize("k,npt", [(128, 4), (4096, 4), (14336, 4), (576, 2), (192, 2), (64, 2),
                                   (100, 1), (4100, 1), (32, 1), (1, 1)])
def test_each_lane_takes_mlxs_elements_in_mlxs_order(k, npt):
    assert gemv_order.lanes_per_step(k) == npt
    steps = gemv_order.lane_steps(k)  # transcribed from MLX's loop
    assert steps == loop_order.lane_schedule(k, npt)  # what the model (and kernel) follow
    assert sorted(i for lane in steps for i in lane) == list(range(k))


def test_the_source_follows_the_model():
    text = gemv_rows.SOURCE.read_text()
    assert "for (int k = NPT * lane; k < K; k += 32 * NPT)" in text
    assert "__fmaf_rn(wv[r][j], xv[m][j], acc[m][r])" in text  # one fma per element, j innermost
    assert "for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync" in text
    assert re.search(r"gemv_rows<T, NPT, R, MR>", gemv_rows._BODY)


@pytest.mark.parametrize("m", [2, 3, 4, 5, 8, 16, 33, 64])
@pytest.mark.parametrize("n", [9, 576, 1024, 4096, 14336, 128256])
def test_warp_shapes_fit_registers_and_cover_every_output(m, n):
    columns, rows = gemv_order.warp_shape(m, n)
    assert columns * rows <= 32 and rows in (2, 4, 8) and columns in (1, 2, 4)
    plan = gemv_rows._launch_plan(m, n, 4096, mx.bfloat16, None)
    warps = plan["grid"][0] // 32
    assert warps * columns >= n and plan["grid"][1] * rows >= m
    assert plan["threadgroup"] == (32 * gemv_rows.WARPS_PER_BLOCK, 1, 1)


@pytest.mark.parametrize("k", [100, 576, 4096])
def test_the_model_gives_each_row_its_own_bits_and_the_product(k):
    x, w = np.array(rand(9, k, seed=1)), np.array(rand(7, k, seed=2))
    block = gemv_order.gemv_rows(x, w)
    for i in range(9):
        assert np.array_equal(block[i], gemv_order.gemv_rows(x[i : i + 1], w)[0])
    np.testing.assert_allclose(block, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-3)


def test_the_order_is_not_a_plain_sum():
    # 1 + 2^-24 per lane-step is lost in a running sum but kept by the lanes' separate sums
    k = 256
    x = np.full((1, k), 1.0, np.float32)
    w = np.full((1, k), 2.0**-24, np.float32)
    w[0, 0] = 1.0
    plain = np.float32(0)
    for v in (x[0] * w[0]):
        plain = np.float32(plain + v)
    assert gemv_order.gemv_rows(x, w)[0, 0] != plain


# -- the strategy ---------------------------------------------------------------------------

def test_the_cpu_has_no_gemv_rows_and_says_why():
    assert "follows MLX's CUDA GEMV" in gemv_rows.unavailable_reason()
    assert "follows MLX's CUDA GEMV" in GEMV_ROWS.unavailable_reason(8)
    assert "at most 64 rows" in GEMV_ROWS.unavailable_reason(65)
    assert gemv_rows.try_matmul(rand(3, 64), rand(5, 64)) is None


def test_auto_tries_gemv_rows_right_after_the_cpu_kernel():
    assert AUTO_CANDIDATES.index("gemv_rows") == AUTO_CANDIDATES.index("cpu_kernel") + 1
    # CUDA with 16-bit activations: mma_rows (gemv_rows but large layers on tensor cores) first
    assert CUDA_16BIT_AUTO_CANDIDATES.index("gemv_rows") == CUDA_16BIT_AUTO_CANDIDATES.index("mma_rows") + 1
    with shape_variant_backend():  # native fails, gemv_rows cannot run: strided_gemv is next
        invariance = set_batch_invariant_limit(tiny_llama(), 4, prefixes=(7,))
    assert invariance.strategy == "strided_gemv" and "gemv_rows (gemv_rows follows MLX's CUDA GEMV" in invariance.reason


def test_every_strategy_can_be_asked_for_on_the_command_line():
    import argparse

    from lockstep.server.commands.runtime_args import add_determinism_arguments

    parser = argparse.ArgumentParser()
    add_determinism_arguments(parser)
    action = next(a for a in parser._actions if a.dest == "invariant_strategy")
    assert set(action.choices) == {"auto", *STRATEGIES}


@pytest.fixture
def emulated(monkeypatch):
    """gemv_rows as if proven here; the test gives the kernel's stand-in and sees its calls."""
    calls = []

    def use(kernel):
        def run(x, w):
            calls.append(x.shape[0])
            return kernel(x, w)

        gemv_rows_alone.emulate(monkeypatch, run)  # a call's launch, as the canonical linear takes it
        return calls
    return use


_rows_alone = gemv_rows_alone.rows_alone


def test_decode_keeps_the_plain_call_and_blocks_run_the_kernel(emulated):
    calls = emulated(_rows_alone)
    x, w = rand(5, 64, seed=3), rand(16, 64, seed=4)
    assert bits_equal(dense_rows(x[:1], w, "gemv_rows"), x[:1] @ w.T) and calls == []
    assert bits_equal(dense_rows(x, w, "gemv_rows"), _rows_alone(x, w)) and calls == [5]


def test_a_kernel_in_mlxs_order_is_proven_and_one_that_is_not_is_refused(emulated):
    with shape_variant_backend():  # blocks of the native call vary with M here
        emulated(_rows_alone)
        invariance = set_batch_invariant_limit(tiny_llama(), 4, "gemv_rows", prefixes=(7,))
        assert invariance.guaranteed and invariance.strategy == "gemv_rows"
        emulated(lambda x, w: x @ w.T)  # a block call: not the single-row order
        model = tiny_llama()
        invariance = set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,))
        assert not invariance.guaranteed and "self-test failed" in invariance.reason
        assert not self_test(model, 4, prefixes=(7,)).passed


def test_one_launch_is_decided_once_per_call_shape(monkeypatch):
    """The wide call's launch: the kernel's traced call where try_matmul would run the kernel,
    None where it would not (unproven here, too many rows, a dtype it has no instance of)."""
    gemv_rows.one_launch.cache_clear()
    assert gemv_rows.one_launch((10,), 64, 64, mx.float16) is None  # the CPU: not proven
    monkeypatch.setattr(gemv_rows, "unavailable_reason", lambda: None)
    monkeypatch.setattr(gemv_rows, "_launcher", lambda *shape: ("call", shape))
    monkeypatch.setattr(compiled, "shaped_launch", lambda call, plan, x_shape, shapes: ("launch", x_shape, shapes))
    gemv_rows.one_launch.cache_clear()
    assert gemv_rows.one_launch((10,), 64, 64, mx.float16) == ("launch", (10, 64), [(10, 64)])
    # a layer's (1, T, K) call: x taken as it is, the output in the layer's shape (no reshape nodes)
    assert gemv_rows.one_launch((1, 10), 48, 64, mx.float16) == ("launch", (10, 64), [(1, 10, 48)])
    assert gemv_rows.one_launch((65,), 64, 64, mx.float16) is None
    assert gemv_rows.one_launch((10,), 64, 64, mx.int32) is None
    gemv_rows.one_launch((10,), 64, 64, mx.float16)
    assert gemv_rows.one_launch.cache_info().hits == 1
    gemv_rows.one_launch.cache_clear()


def test_a_pass_wider_than_l_runs_each_linear_as_one_launch_and_keeps_the_rows_bits(emulated, monkeypatch):
    """Under calls_in_blocks (the engine's wide deterministic passes) a row-independent kernel
    takes all of a call's rows at once; the rows' bits are those of L-row blocks. Where it
    cannot, the call runs in blocks of at most L rows."""
    calls = emulated(_rows_alone)
    with shape_variant_backend():
        one_launch_then_blocks(tiny_llama(), calls, monkeypatch, "dense_rows_in_one_launch")


def one_launch_then_blocks(model, calls: list, monkeypatch, one_launch: str, block_calls=(2, 4)) -> None:
    """`model` at L = 4 (gemv_rows) fed 10 tokens under calls_in_blocks: every emulated kernel
    call takes all 10 rows; with layers.`one_launch` switched off the calls are blocks of
    4 + 4 + 2 rows (the kernel's calls among them: `block_calls`); the logits are the same bits
    either way."""
    from mlx_lm.models.cache import make_prompt_cache

    import lockstep.kernels.invariance.layers as layers
    from lockstep.kernels.invariance.layers import calls_in_blocks

    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    assert set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,)).guaranteed
    calls.clear()
    with calls_in_blocks():
        wide = model(tokens, cache=make_prompt_cache(model))
        mx.eval(wide)
    assert calls and set(calls) == {10}  # every linear: one launch of all 10 rows

    calls.clear()
    monkeypatch.setattr(layers, one_launch, lambda *a, **kw: None)
    with calls_in_blocks():
        blocked = model(tokens, cache=make_prompt_cache(model))
        mx.eval(blocked)
    assert sorted(set(calls)) == list(block_calls)  # 10 rows as 4 + 4 + 2
    assert bits_equal(wide, blocked)
    set_batch_invariant_limit(model, 0)
