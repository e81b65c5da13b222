"""mma_rows (kernels/custom/mma_rows.py, the strategy of kernels/invariance/ops.py) on a CPU,
where its kernels cannot run: which dense layers' rows take skinny's tensor-core kernel (at
every width, one row included) and which keep gemv_rows' forms, its proof and refusal with
stand-ins for the kernels, auto's order on CUDA and what startup compiles. The kernel's order
(mma_order.py) is tested in tests/test_custom_kernels.py; on the GPU, tests/gpu/ checks it
against that model, every row of 1..64-row calls against the row alone, and the strategy
end to end (tests/gpu/test_mma_rows_cuda.py)."""
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from lockstep.kernels import custom
from lockstep.kernels.custom import mma_rows, skinny
from lockstep.kernels.custom.precompile import linear_shapes
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.layers import Setting, calls_in_blocks
from lockstep.kernels.invariance.limit import AUTO_CANDIDATES, CUDA_16BIT_AUTO_CANDIDATES
from lockstep.kernels.invariance.ops import GEMV_ROWS, MMA_ROWS, dense_rows, dense_rows_in_one_launch
from lockstep.kernels.invariance.selftest import bits_equal
from tests.doubles import gemv_rows_alone, skinny_launch
from tests.doubles.shape_variant import shape_variant_backend
from tiny_models import tiny_llama

HIDDEN, INTERMEDIATE, KV, VOCAB = 4096, 14336, 1024, 128256  # a Llama-3-8B's widths
SMOL = {"q_o": (576, 576), "k_v": (192, 576), "gate_up": (1536, 576), "down": (576, 1536)}  # SmolLM2-135M
TINY_LARGE = 256 * 128  # tiny_llama's gate, up, down and head; its q, k, v and o are smaller


def rand(*shape, seed=0, dtype=mx.bfloat16):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def test_an_8bs_layers_and_a_small_models_head_take_the_tensor_core_kernel():
    for n, k in ((HIDDEN, HIDDEN), (KV, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE), (VOCAB, HIDDEN),
                 (49152, 576)):
        for t in (mx.bfloat16, mx.float16):
            assert mma_rows.takes(n, k, t, t), (n, k, t)
    for n, k in SMOL.values():  # one row stays MLX's GEMV: the tensor-core kernel's row costs more there
        assert not mma_rows.takes(n, k, mx.bfloat16, mx.bfloat16)
    assert not mma_rows.takes(HIDDEN, HIDDEN, mx.float32, mx.float32)  # no tensor-core kernel for float32 x
    assert not mma_rows.takes(HIDDEN, HIDDEN, mx.bfloat16, mx.float16)  # x and the weight of one type


def test_the_cpu_runs_every_layer_in_gemv_rows_form_and_cannot_run_the_strategy():
    mma_rows.form_for.cache_clear()
    assert mma_rows.form_for(HIDDEN, HIDDEN, mx.bfloat16, mx.bfloat16) == "gemv_rows"
    assert "follows MLX's CUDA GEMV" in MMA_ROWS.unavailable_reason(8)
    assert MMA_ROWS.quantized_form == GEMV_ROWS.quantized_form == "qmv_rows"  # quantized layers: gemv_rows' bits
    assert not Setting(8, MMA_ROWS).dense_row_plain  # one row of a large layer is the kernel's


@pytest.fixture
def emulated(monkeypatch):
    """Both kernels as if proven on a CUDA GPU, and layers of tiny_llama's gate/up/down/head
    size large enough for the tensor-core kernel; the test gives that kernel's stand-in and
    sees the (rows, N) of each call of either kernel."""
    calls = {"skinny": [], "gemv_rows": []}
    mma_rows.form_for.cache_clear()
    monkeypatch.setattr(mma_rows, "MIN_ELEMENTS", TINY_LARGE)
    monkeypatch.setattr(skinny, "available", lambda: True)
    monkeypatch.setattr(skinny, "uses_mma", lambda dtype: dtype in skinny.MMA_DTYPES)
    monkeypatch.setattr(custom, "uses_mma", skinny.uses_mma)
    monkeypatch.setattr(custom, "unavailable_reason", lambda: None)

    def gemv(x, w):
        calls["gemv_rows"].append((x.shape[0], w.shape[0]))
        return _rows_alone(x, w)

    gemv_rows_alone.emulate(monkeypatch, gemv)

    def use(kernel):
        def run(x, w):
            calls["skinny"].append((x.shape[0], w.shape[0]))
            return kernel(x, w)

        skinny_launch.emulate(monkeypatch, run)
        for v in calls.values():
            v.clear()
        return calls
    yield use
    mma_rows.form_for.cache_clear()  # decided under the stand-ins


_rows_alone = gemv_rows_alone.rows_alone


def _one_call(x, w):
    """A kernel whose rows depend on the call's width (on the shape-variant backend)."""
    return x @ w.T


def test_a_large_layers_rows_run_the_tensor_core_kernel_at_every_width_and_a_small_ones_gemv_rows(emulated):
    calls = emulated(_rows_alone)
    x, large, small = rand(10, 128, seed=1), rand(256, 128, seed=2), rand(64, 128, seed=3)
    assert bits_equal(dense_rows(x[:1], large, "mma_rows"), x[:1] @ large.T)
    assert bits_equal(dense_rows(x[:5], large, "mma_rows"), _rows_alone(x[:5], large))
    assert calls == {"skinny": [(1, 256), (5, 256)], "gemv_rows": []}  # one row included
    emulated(_rows_alone)
    dense_rows(x[:1], small, "mma_rows")  # MLX's own single-row GEMV
    dense_rows(x[:5], small, "mma_rows")
    assert calls == {"skinny": [], "gemv_rows": [(5, 64)]}
    emulated(_rows_alone)
    dense_rows_in_one_launch(x, large, "mma_rows")  # a wide deterministic call: one launch each
    dense_rows_in_one_launch(x, small, "mma_rows")
    assert calls == {"skinny": [(10, 256)], "gemv_rows": [(10, 64)]}
    emulated(_rows_alone)
    dense_rows(x[:5].astype(mx.float32), large.astype(mx.float32), "mma_rows")  # float32: gemv_rows' form
    assert calls["skinny"] == []


def test_a_row_independent_kernel_is_proven_and_a_width_dependent_one_is_refused(emulated):
    with shape_variant_backend():  # a dense call of 2+ rows varies here
        calls = emulated(_rows_alone)
        invariance = set_batch_invariant_limit(tiny_llama(dtype=mx.bfloat16), 4, "mma_rows", prefixes=(7,))
        assert invariance.guaranteed and invariance.strategy == "mma_rows", invariance.reason
        assert {1, 4} <= {m for m, _ in calls["skinny"]} and {n for _, n in calls["skinny"]} == {256, 128}
        assert {n for _, n in calls["gemv_rows"]} <= {128, 64}  # q/o, k/v: gemv_rows' blocks
        emulated(_one_call)
        model = tiny_llama(dtype=mx.bfloat16)
        invariance = set_batch_invariant_limit(model, 4, "mma_rows", prefixes=(7,))
        assert not invariance.guaranteed and "self-test failed" in invariance.reason


def test_auto_tries_mma_rows_first_on_cuda_with_16_bit_activations(emulated):
    assert CUDA_16BIT_AUTO_CANDIDATES.index("mma_rows") == CUDA_16BIT_AUTO_CANDIDATES.index("cpu_kernel") + 1
    assert CUDA_16BIT_AUTO_CANDIDATES.index("mma_rows") < CUDA_16BIT_AUTO_CANDIDATES.index("gemv_rows")
    assert "mma_rows" not in AUTO_CANDIDATES  # float32, Metal: its tensor-core kernel is CUDA's, 16-bit
    with shape_variant_backend():
        emulated(_rows_alone)
        invariance = set_batch_invariant_limit(tiny_llama(dtype=mx.bfloat16), 4, prefixes=(7,))
    assert invariance.guaranteed and invariance.strategy == "mma_rows", invariance.reason


def test_a_pass_wider_than_l_runs_each_linear_as_one_launch_of_its_kernel(emulated):
    with shape_variant_backend():
        calls = emulated(_rows_alone)
        model = tiny_llama(dtype=mx.bfloat16)
        assert set_batch_invariant_limit(model, 4, "mma_rows", prefixes=(7,)).guaranteed
        tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
        calls = emulated(_rows_alone)
        with calls_in_blocks():
            mx.eval(model(tokens, cache=make_prompt_cache(model)))
    assert {m for m, _ in calls["skinny"]} == {10} and {n for _, n in calls["skinny"]} == {256, 128}
    assert {m for m, _ in calls["gemv_rows"]} == {10}
    assert len(calls["skinny"]) == 2 * 3 + 1  # gate, up, down of both layers, the head
    set_batch_invariant_limit(model, 0)


def test_startup_compiles_each_layers_own_kernel(emulated):
    emulated(_rows_alone)
    shapes = linear_shapes(tiny_llama(dtype=mx.bfloat16), dense="mma_rows")
    kinds = {(n, k): kind for n, k, _, kind, _ in shapes}
    assert kinds == {(128, 128): "gemv_rows", (64, 128): "gemv_rows", (256, 128): "skinny", (128, 256): "skinny"}
