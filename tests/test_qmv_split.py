"""qmv_split (kernels/custom/qmv_split.cu) on a CPU, where it cannot run: the order it follows
(lockstep's own, through the NumPy model qmv_split_order.py), the source against that model,
which arrays and layers it takes, and where the layers send their rows through it (a stand-in
for the kernel): plain calls of a few rows and every canonical call of a large 4-bit layer,
proven by the self-test, and refused where the stand-in's rows depend on the call's width.
The GPU agreement (the kernel against the model bit for bit, rows alone and among others) is
its smoke test's, run at startup; its speed is in
bench/results/history/2026-12-02-h200-node-cost-qmv-split-issue28.md."""
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from lockstep.kernels.custom import qmv_split, split_rows
from lockstep.kernels.custom.precompile import linear_shapes
from lockstep.kernels.custom.qmv_order import dequantize, round_to
from lockstep.kernels.custom.qmv_split_order import CHUNK, THREADS, thread_chunks
from lockstep.kernels.custom.qmv_split_order import qmv_split as order_model
from lockstep.kernels.invariance import layers, set_batch_invariant_limit
from lockstep.kernels.invariance.layers import batch_invariant, native_forms
from lockstep.kernels.invariance.selftest import bits_equal
from tests.doubles import gemv_rows_alone
from tests.doubles.shape_variant import shape_variant_backend
from tests.test_qmv_rows import rand
from tiny_models import QUANT_MODES, tiny_llama


def values(a) -> np.ndarray | None:
    return None if a is None else np.array(a.astype(mx.float32)).astype(np.float64)


def model_case(m, n, k, mode, dtype="bfloat16", seed=0):
    """x (m, k) and the dequantized weight (n, k) as float64 values of T."""
    group, bits = QUANT_MODES[mode]
    t = getattr(mx, dtype)
    wq, scales, *rest = mx.quantize(rand(n, k, seed=seed + 1, dtype=t), group, bits, mode=mode)
    w = dequantize(np.array(wq), values(scales) if mode == "affine" else np.array(scales),
                   values(rest[0]) if rest else None, mode=mode, bits=bits, group_size=group, dtype=dtype)
    return values(rand(m, k, seed=seed, dtype=t)), w


# -- the order ------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [32, 1152, 4096, 4224, 14336])
def test_every_chunk_is_taken_once_by_its_thread_in_order(k):
    chunks = thread_chunks(k)
    assert len(chunks) == THREADS
    assert sorted(i for starts in chunks for i in starts) == list(range(0, k, CHUNK))
    for t, starts in enumerate(chunks):
        assert starts == sorted(starts) and all(s // CHUNK % THREADS == t for s in starts)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["nvfp4", "affine"])
def test_the_model_gives_each_row_its_own_bits_and_the_product(dtype, mode):
    x, w = model_case(5, 7, 1152, mode, dtype)
    block = order_model(x, w, dtype=dtype)
    for i in range(5):
        assert np.array_equal(block[i : i + 1], order_model(x[i : i + 1], w, dtype=dtype))
    exact = x @ w.T
    assert np.max(np.abs(block - exact)) <= 0.02 * np.max(np.abs(exact))


def test_the_order_is_not_a_plain_sum():
    """Products summed in pairs of T, then float32, then across threads: on these values not
    the exact sum rounded once (the model would pass a kernel that only rounds at the end)."""
    x, w = model_case(4, 16, 4096, "nvfp4", "bfloat16", seed=3)
    assert not np.array_equal(order_model(x, w, dtype="bfloat16"), round_to(x @ w.T, "bfloat16"))


def test_a_chunks_pairs_accumulate_in_xs_type():
    """Eight products into one T lane: 1 + eight times 2^-9 stays 1 in bfloat16 (each fma
    rounds to T), where a float32 accumulator would keep it."""
    k = 32
    x = np.zeros((1, k))
    w = np.zeros((1, k))
    x[0, 0], w[0, 0] = 1.0, 1.0
    x[0, 2 : 16 : 2], w[0, 2 : 16 : 2] = 2.0 ** -9, 1.0  # elements 2, 4, .., 14: lane A.x
    got = order_model(x, w, dtype="bfloat16")[0, 0]
    assert got == 1.0 and float(np.float32(1 + 7 * 2.0 ** -9)) != 1.0


# -- the source -----------------------------------------------------------------------------

def test_the_source_follows_the_model():
    text = qmv_split.SOURCE.read_text()
    assert "constexpr int THREADS = 128;" in text and THREADS == 128
    assert "const int idx = r * THREADS + tid;" in text  # thread t: chunks t, t + 128, ..
    assert "for (int j = 0; j < 8; ++j) a = __hfma2(xv[m][j], wd[j], a);" in text
    assert "for (int j = 8; j < 16; ++j) b = __hfma2(xv[m][j], wd[j], b);" in text
    assert re.search(r"s = __fadd_rn\(s, fa\.x\);\s*s = __fadd_rn\(s, fa\.y\);\s*"
                     r"s = __fadd_rn\(s, fb\.x\);\s*s = __fadd_rn\(s, fb\.y\);", text)
    assert "for (int offset = 16; offset > 0; offset >>= 1) s = __fadd_rn(s, __shfl_xor_sync" in text
    assert "for (int v = 1; v < WARPS; ++v) s = __fadd_rn(s, partial[v][m][c]);" in text
    assert "wd[j] = __hadd2_rn(__hmul2_rn(code, make_pair(s, s)), make_pair(now.bias[c], now.bias[c]));" in text
    assert "else wd[j] = __hmul2_rn(code, make_pair(s, s));" in text
    for body in qmv_split._BODIES.values():
        assert body.startswith("lockstep_qsplit::qmv_split<T, ")


def test_affine_codes_are_placed_by_their_bits_and_e2m1_codes_read_the_table():
    """Which formats skip the shared-memory table: affine (qmv_mma_order.code_pair models the
    placement, and test_qmv_mma checks it exact for every byte); e2m1 keeps the table, whose
    fill and shared memory the affine instances drop."""
    text = qmv_split.SOURCE.read_text()
    assert "constexpr bool by_bits(int fmt) { return fmt == 0; }" in text
    assert "if constexpr (BY_BITS) code = codes_as_pair<T, FMT>(words[j >> 2] >> (8 * (j & 3)));" in text
    assert "else code = table_pair<T2>(lane_base, words[j >> 2], j & 3);" in text
    assert "__shared__ __align__(16) T2 table[BY_BITS ? 1 : 256 * 32];" in text
    assert "if constexpr (!BY_BITS) fill_table<T, FMT>(table);" in text


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 33])
@pytest.mark.parametrize("n", [9, 1024, 14336, 128256])
def test_launches_cover_every_output(m, n):
    plan = qmv_split._launch_plan(m, n, "nvfp4", 16, mx.bfloat16)
    template = dict(plan["template"])
    rows, columns = template["MR"], template["C"]
    assert rows == qmv_split.block_rows(m) and columns == qmv_split.block_columns(n)
    blocks = plan["grid"][0] // qmv_split.THREADS
    assert 1 <= blocks <= qmv_split.MAX_BLOCKS and blocks * columns <= max(n, columns) + columns
    assert plan["grid"][1] * rows >= m and plan["threadgroup"] == (qmv_split.THREADS, 1, 1)


def test_which_cases_and_layers_the_kernel_takes():
    assert qmv_split.takes("nvfp4", 4, 16) and qmv_split.takes("mxfp4", 4, 32)
    assert all(qmv_split.takes("affine", 4, g) for g in (32, 64, 128))
    assert not qmv_split.takes("affine", 8, 64) and not qmv_split.takes("mxfp8", 8, 32)
    assert qmv_split.pays(14336, 4096) and qmv_split.pays(128256, 4096)  # an 8B's gate, head
    assert not qmv_split.pays(4096, 4096) and not qmv_split.pays(1536, 576)  # an 8B's q, SmolLM2
    w, scales, *rest = mx.quantize(rand(16, 256, dtype=mx.bfloat16), 64, 4)
    x = rand(3, 256, dtype=mx.bfloat16)
    assert qmv_split.serves(x, w, scales, rest[0], group_size=64, bits=4, mode="affine")
    assert not qmv_split.serves(x.astype(mx.float32), w, scales, rest[0], group_size=64, bits=4, mode="affine")
    assert not qmv_split.serves(x[:, :200], w, scales, rest[0], group_size=64, bits=4, mode="affine")


def test_the_cpu_has_no_qmv_split():
    assert "CUDA" in qmv_split.unavailable_reason("nvfp4", mx.bfloat16)
    assert qmv_split.launch_for((1, 1), 16, 256, "affine", 4, 64, mx.bfloat16, mx.uint32, 32, mx.bfloat16,
                                mx.bfloat16) is None


# -- the layers that use it (a stand-in for the kernel) ------------------------------------

@pytest.fixture
def split(monkeypatch):
    """Every 4-bit layer of a tiny model counts as large, and qmv_split's launch is a stand-in
    the test gives; the rows of each call it runs are recorded."""
    calls = []
    monkeypatch.setattr(qmv_split, "MIN_ELEMENTS", 0)
    gemv_rows_alone.emulate(monkeypatch)  # the dense layers: rows alone
    original = qmv_split.launch_for
    original.cache_clear()

    def use(kernel):
        def launch_for(lead, n, k, mode, bits, group, *_):
            def launch(x, w, scales, biases=None):
                rows = x.reshape(-1, k)
                calls.append(rows.shape[0])
                return kernel(rows, w, scales, biases, group_size=group, bits=bits, mode=mode).reshape(*lead, n)
            return launch

        monkeypatch.setattr(qmv_split, "launch_for", launch_for)
        return calls
    yield use
    original.cache_clear()


def rows_alone(x, w, scales, biases, **kw):
    """A row-independent stand-in: every row as its own call, then halved (so a result that
    went through it is told apart from MLX's call)."""
    return mx.concatenate([mx.quantized_matmul(x[i : i + 1], w, scales, biases, transpose=True, **kw)
                           for i in range(x.shape[0])], axis=0) * 0.5


def one_call(x, w, scales, biases, **kw):
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, **kw) * 0.5


def test_large_layers_send_plain_rows_of_a_few_and_canonical_rows_of_any_width(split):
    calls = split(rows_alone)
    model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    invariance = set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,))
    assert invariance.guaranteed and invariance.layers.get("split_rows", 0) > 0 and calls
    layer = model.model.layers[0].mlp.gate_proj
    assert isinstance(layer._split_rows, layers.SplitRows)
    w, scales = layer["weight"], layer["scales"]
    kw = dict(group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
    for rows, setting, through in ((1, None, True), (split_rows.SPLIT_PLAIN_ROWS, None, True),
                                   (split_rows.SPLIT_PLAIN_ROWS + 1, None, False),
                                   (3, model._lockstep_setting, True), (9, model._lockstep_setting, False)):
        calls.clear()
        x = rand(rows, layer.weight.shape[1] * 8, seed=rows, dtype=mx.bfloat16)
        context = native_forms() if setting is None else batch_invariant(setting)
        with context:
            got = layer(x)
        plain = mx.quantized_matmul(x, w, scales, None, transpose=True, **kw)
        assert (calls == [rows]) == through, (rows, setting, calls)
        if through:
            assert bits_equal(got, rows_alone(x, w, scales, None, **kw))
        elif setting is None:
            assert bits_equal(got, plain)  # a wide plain call: MLX's quantized matmul
    set_batch_invariant_limit(model, 0)
    assert "_split_rows" not in layer.__dict__  # given back with the model's classes


def test_a_stand_in_whose_rows_depend_on_the_width_is_refused(split):
    with shape_variant_backend(quantized_rows=2):  # a quantized call of 2+ rows varies here
        split(rows_alone)
        model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
        assert set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,)).guaranteed
        split(one_call)  # all rows in one call: their bits depend on the width
        model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
        invariance = set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,))
        assert not invariance.guaranteed and "self-test failed" in invariance.reason


def test_small_layers_keep_their_calls(monkeypatch):
    qmv_split.launch_for.cache_clear()
    model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    invariance = set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,))
    assert "split_rows" not in invariance.layers  # below MIN_ELEMENTS: no layer goes through it
    assert model.model.layers[0].mlp.gate_proj._split_rows is None
    set_batch_invariant_limit(model, 0)


def test_startup_lists_large_4_bit_layers_under_every_form(monkeypatch):
    monkeypatch.setattr(qmv_split, "MIN_ELEMENTS", 0)
    model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    for form in ("chunks", "qmv_rows", "skinny"):
        kinds = {s[3] for s in linear_shapes(model, dense="gemv_rows", quantized=form)}
        assert "qmv_split" in kinds
    monkeypatch.setattr(qmv_split, "MIN_ELEMENTS", 1 << 40)
    assert "qmv_split" not in {s[3] for s in linear_shapes(model, dense="gemv_rows", quantized="qmv_rows")}


def test_with_invariance_off_large_layers_still_send_plain_rows_through_it(split, monkeypatch):
    calls = split(rows_alone)
    monkeypatch.setattr(qmv_split, "runs_here", lambda: True)  # as on CUDA
    model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    invariance = set_batch_invariant_limit(model, 0)
    assert not invariance.guaranteed and invariance.layers.get("split_rows", 0) > 0
    layer = model.model.layers[0].mlp.gate_proj
    w, scales = layer["weight"], layer["scales"]
    kw = dict(group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
    k = w.shape[1] * 8
    calls.clear()
    x = rand(1, k, seed=5, dtype=mx.bfloat16)
    assert bits_equal(layer(x), rows_alone(x, w, scales, None, **kw)) and calls == [1]
    calls.clear()
    wide = rand(split_rows.SPLIT_PLAIN_ROWS + 1, k, seed=6, dtype=mx.bfloat16)
    assert bits_equal(layer(wide), mx.quantized_matmul(wide, w, scales, None, transpose=True, **kw))
    assert calls == []
    mx.eval(model(mx.array([[1, 2, 3]])))  # the whole model runs
    assert set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,)).guaranteed  # L > 0 over it
    set_batch_invariant_limit(model, 0)
    layers.uninstall(model)
    assert type(layer) is nn.QuantizedLinear and "_split_rows" not in layer.__dict__


def test_with_invariance_off_a_backend_without_the_kernel_keeps_the_model_as_it_is(monkeypatch):
    monkeypatch.setattr(qmv_split, "MIN_ELEMENTS", 0)
    model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    invariance = set_batch_invariant_limit(model, 0)
    assert invariance.layers == {} and type(model.model.layers[0].mlp.gate_proj) is nn.QuantizedLinear
    assert not hasattr(model, "_lockstep_setting")
