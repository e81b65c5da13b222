"""qmv_mma (kernels/custom/qmv_mma.cu) on a CPU, where it cannot run: the order it follows
(lockstep's own, on tensor cores, through the index model qmv_mma_order.py), the source against
that model, its launches, and which kernel a large 4-bit layer's rows take (a stand-in for the
kernels): canonical rows through qmv_mma at every width, one plain row through qmv_split, and
the self-test refusing a stand-in whose rows depend on the width. The GPU agreement (rows alone
and among others, closeness to the model) is its smoke test's, run at startup; its speed is in
bench/results/history/2026-12-02-h200-qmv-mma-issue28.md."""
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from lockstep.kernels.custom import qmv_mma, qmv_split, quant_rows, split_rows
from lockstep.kernels.custom.precompile import instances_for
from lockstep.kernels.custom.qmv_mma_order import CHUNK, MMAS, mma_elements, schedule, warp_chunks
from lockstep.kernels.custom.qmv_mma_order import CODE_BITS, code_pair
from lockstep.kernels.custom.qmv_mma_order import qmv_mma as order_model
from lockstep.kernels.custom.qmv_order import code_values, round_to
from lockstep.kernels.invariance import layers, set_batch_invariant_limit
from lockstep.kernels.invariance.layers import batch_invariant, native_forms
from lockstep.kernels.invariance.selftest import bits_equal
from tests.doubles.shape_variant import shape_variant_backend
from tests.test_qmv_rows import rand
from tests.test_qmv_split import model_case, one_call, rows_alone, split  # noqa: F401 (a fixture)
from tiny_models import tiny_llama

# -- the order ------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [128, 640, 4096, 14336])
@pytest.mark.parametrize("warps", [4, 8])
def test_every_element_is_taken_once_by_its_warp_in_chunk_order(k, warps):
    per_warp = warp_chunks(k, warps)
    assert sorted(c for chunks in per_warp for c in chunks) == list(range(k // CHUNK))
    for w, chunks in enumerate(per_warp):
        assert chunks == sorted(chunks) and all(c % warps == w for c in chunks)
    taken = np.concatenate([idx for mmas in schedule(k, warps) for idx in mmas])
    assert sorted(taken.tolist()) == list(range(k))


def test_an_mmas_slots_are_what_the_fragment_layout_gives_the_kernels_lanes():
    """m16n8k16: lane (g, q) holds k slots 2q, 2q + 1 in its first A / B register and 2q + 8,
    2q + 9 in the second; the kernel's lane group q holds elements q * 32 .. + 31 of the chunk
    as byte pairs (byte i: elements 2i, 2i + 1) and gives MMA j bytes 2j and 2j + 1."""
    for chunk in (0, 3):
        for j in range(MMAS):
            want = np.zeros(16, int)
            for q in range(4):
                for t in range(2):
                    want[2 * q + t] = chunk * CHUNK + q * 32 + 2 * (2 * j) + t
                    want[2 * q + 8 + t] = chunk * CHUNK + q * 32 + 2 * (2 * j + 1) + t
            assert mma_elements(chunk, j).tolist() == want.tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["nvfp4", "affine"])
def test_the_model_gives_each_row_its_own_bits_and_the_product(dtype, mode):
    x, w = model_case(5, 7, 1152, mode, dtype)
    block = order_model(x, w, dtype=dtype, warps=4)
    for i in range(5):
        assert np.array_equal(block[i : i + 1], order_model(x[i : i + 1], w, dtype=dtype, warps=4))
    exact = x @ w.T
    assert np.max(np.abs(block - exact)) <= 0.02 * np.max(np.abs(exact))


def test_the_warps_are_part_of_the_order():
    """Four and eight warps split K differently, and on these values give other float32 sums:
    the warps a block has must be a function of the layer's shape alone."""
    x, w = model_case(8, 64, 4096, "nvfp4", "float16", seed=3)
    four, eight = order_model(x, w, dtype="float32", warps=4), order_model(x, w, dtype="float32", warps=8)
    assert not np.array_equal(four, eight)
    assert not np.array_equal(four, round_to(x @ w.T, "float32"))  # nor the exact sum rounded once


# -- the source -----------------------------------------------------------------------------

def test_the_source_follows_the_model():
    text = qmv_mma.SOURCE.read_text()
    assert "constexpr int CHUNK = 128;" in text and CHUNK == qmv_mma.CHUNK == 128
    assert "for (int c0 = warp; c0 < chunks; c0 += WARPS * DEPTH)" in text  # chunk c: warp c % WARPS
    assert "const int ch = c0 + d * WARPS;" in text
    assert "const int k = ch * CHUNK + q * 32;" in text  # lane group q: elements q * 32 ..
    # byte i: elements 2i, 2i + 1 (a table's entry, or the bits placed: the same value)
    assert "T2 v = __hmul2_rn(code_pair<T, FMT, ROWS>(table, wd[i >> 2] >> (8 * (i & 3)), lane), make_pair(s, s));" in text
    assert "T2 val = __hmul2_rn(code_pair<T, FMT, ROWS>(table, word >> (8 * (i & 3)), lane), make_pair(s, s));" in text
    assert "if constexpr (C::BY_BITS) return codes_as_pair<T, FMT>(bytes);" in text
    assert "else return table[(bytes & 0xFFu) * C::COPIES + (C::COPIES > 1 ? lane : 0)];" in text
    assert re.search(r"mma<T>\(acc\[t\]\[c\], lo\[2 \* j\], HALVES == 2 \? hi\[2 \* j\] : 0u, lo\[2 \* j \+ 1\],"
                     r"\s*HALVES == 2 \? hi\[2 \* j \+ 1\] : 0u, b\[2 \* j\], b\[2 \* j \+ 1\]\);", text)
    assert "for (int v = 1; v < WARPS; ++v) s = __fadd_rn(s, partial[v][idx]);" in text
    assert "v = __hadd2_rn(v, make_pair(bias[d][c], bias[d][c]));" in text  # affine: then + bias
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
    for body in qmv_mma._BODIES.values():
        assert body.startswith("lockstep_qmma::qmv_mma<T, ")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mode", ["affine", "nvfp4"])
def test_codes_as_pair_places_every_code_at_its_exact_value(mode, dtype):
    """codes_as_pair's bit placement (its NumPy model) gives each of a byte's two codes exactly the
    value the dequantization takes (signed zeros included), for all 256 bytes, so decoding by
    bits instead of a table changes no output."""
    byte = np.arange(256)
    want = np.stack([code_values(byte & 15, mode), code_values(byte >> 4, mode)], axis=-1)
    got = code_pair(byte, mode, dtype)
    assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want))
    # a placement one bit off is not exact: the check can fail
    wrong = dict(CODE_BITS[dtype], shift=CODE_BITS[dtype]["shift"] + 1, base=CODE_BITS[dtype]["base"] + 0x400)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(CODE_BITS, dtype, wrong)
        assert not np.array_equal(code_pair(byte, mode, dtype), want)


def test_codes_as_pair_source_uses_the_models_constants():
    text = quant_rows.VALUES.read_text()
    f16, bf16 = CODE_BITS["float16"], CODE_BITS["bfloat16"]
    assert f"BASE = HALF ? 0x{f16['base']:04X}{f16['base']:04X}u : 0x{bf16['base']:04X}{bf16['base']:04X}u;" in text
    neg16, negbf = f16["base"] | 0x8000, bf16["base"] | 0x8000  # minus the base: its sign bit set
    assert f"MINUS = HALF ? 0x{neg16:04X}{neg16:04X}u : 0x{negbf:04X}{negbf:04X}u;" in text
    assert f"MAGNITUDE_SHIFT = HALF ? {f16['shift']} : {bf16['shift']};" in text
    r16, rbf = f16["restore"], bf16["restore"]
    assert f"RESTORE = HALF ? 0x{r16:04X}{r16:04X}u : 0x{rbf:04X}{rbf:04X}u;" in text
    assert "const uint32_t codes = (byte & 0xFu) | ((byte & 0xF0u) << 12);" in text
    assert "((codes & 0x00080008u) << 12) | ((codes & 0x00070007u) << MAGNITUDE_SHIFT)" in text


@pytest.mark.parametrize("n, k", [(1024, 4096), (4096, 14336), (14336, 4096), (128256, 4096), (33, 1152)])
def test_launches_cover_every_output_and_keep_the_order_at_every_width(n, k):
    warps = set()
    for m in (1, 2, 7, 8, 9, 16, 17, 32, 33, 100):
        plan = qmv_mma._launch_plan(m, n, k, "nvfp4", 16, mx.bfloat16)
        t = dict(plan["template"])
        warps.add(t["WARPS"])
        groups = max(t["CG"], 1)  # the staged tile's column groups (calls of 2..16 rows)
        assert t["CG"] == qmv_mma.column_groups(n, k, m) and (t["CG"] > 0) == (2 <= m <= 16)
        assert plan["threadgroup"] == (32 * t["WARPS"] * groups, 1, 1)
        assert (plan["grid"][0] // (32 * t["WARPS"] * groups)) * 8 * t["NT"] * groups >= n
        assert plan["grid"][1] * t["ROWS"] >= m and t["ROWS"] in (8, 16, 32)
    assert warps == {qmv_mma.block_warps(n, k)}  # the order's only launch parameter: never the width


def test_which_cases_the_kernel_takes():
    assert qmv_mma.takes("nvfp4", 4, 16) and qmv_mma.takes("mxfp4", 4, 32)
    assert all(qmv_mma.takes("affine", 4, g) for g in (32, 64, 128))
    assert not qmv_mma.takes("affine", 8, 64) and not qmv_mma.takes("mxfp8", 8, 32)
    w, scales, *rest = mx.quantize(rand(16, 256, dtype=mx.bfloat16), 64, 4)
    kw = dict(group_size=64, bits=4, mode="affine")
    assert qmv_mma.serves(rand(3, 256, dtype=mx.bfloat16), w, scales, rest[0], **kw)
    assert not qmv_mma.serves(rand(3, 256, dtype=mx.float32), w, scales, rest[0], **kw)
    w2, scales2, *rest2 = mx.quantize(rand(16, 192, dtype=mx.bfloat16), 64, 4)  # K not a multiple of 128
    assert not qmv_mma.serves(rand(3, 192, dtype=mx.bfloat16), w2, scales2, rest2[0], **kw)


def test_the_cpu_has_no_qmv_mma():
    assert "CUDA" in qmv_mma.unavailable_reason("nvfp4", mx.bfloat16)
    assert qmv_mma.launch_for((1, 1), 16, 256, "affine", 4, 64, mx.bfloat16, mx.uint32, 32, mx.bfloat16,
                              mx.bfloat16) is None


def test_startup_compiles_the_kernel_each_width_runs(monkeypatch):
    monkeypatch.setattr(qmv_split, "unavailable_reason", lambda *a: None)
    shape = (14336, 4096, mx.bfloat16, "qmv_split", 16, "nvfp4", 4)
    monkeypatch.setattr(qmv_mma, "unavailable_reason", lambda *a: None)
    names = [family.name for family, _ in instances_for([shape], range(1, 9))]
    assert names.count("lockstep_qmv_mma_fp") == 8 and names.count("lockstep_qmv_split_fp") == 1
    monkeypatch.setattr(qmv_mma, "unavailable_reason", lambda *a: "not here")
    names = [family.name for family, _ in instances_for([shape], range(1, 9))]
    assert names.count("lockstep_qmv_split_fp") == 8 and "lockstep_qmv_mma_fp" not in names


# -- which kernel a large layer's rows take (stand-ins for both kernels) ----------------------

@pytest.fixture
def kernels(monkeypatch, split):
    """qmv_split's stand-in (test_qmv_split.split) and one for qmv_mma, which counts as proven
    here; every 4-bit layer of a tiny model counts as large for both; each records the rows of
    the calls it runs."""
    mma_calls = []
    monkeypatch.setattr(qmv_mma, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(qmv_mma, "CANONICAL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(qmv_mma, "unavailable_reason", lambda *a: None)
    original = qmv_mma.launch_for
    original.cache_clear()

    def use(split_kernel, mma_kernel):
        split_calls = split(split_kernel)

        def launch_for(lead, n, k, mode, bits, group, *_):
            def launch(x, w, scales, biases=None):
                rows = x.reshape(-1, k)
                mma_calls.append(rows.shape[0])
                return mma_kernel(rows, w, scales, biases, group_size=group, bits=bits, mode=mode).reshape(*lead, n)
            return launch

        monkeypatch.setattr(qmv_mma, "launch_for", launch_for)
        return split_calls, mma_calls
    yield use
    original.cache_clear()


def rows_alone_quarter(x, w, scales, biases, **kw):
    """Rows alone, then quartered: told apart from qmv_split's stand-in and MLX's call."""
    return rows_alone(x, w, scales, biases, **kw) * 0.5


@pytest.fixture(scope="module")
def model():
    return tiny_llama(quant="nvfp4", dtype=mx.bfloat16)


def test_canonical_rows_take_qmv_mma_at_every_width_and_one_plain_row_qmv_split(kernels, model):
    split_calls, mma_calls = kernels(rows_alone, rows_alone_quarter)
    invariance = set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,))
    assert invariance.guaranteed and invariance.layers.get("split_rows", 0) > 0 and mma_calls
    layer = model.model.layers[0].mlp.gate_proj
    w, scales = layer["weight"], layer["scales"]
    kw = dict(group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
    setting = model._lockstep_setting
    # (rows, setting, kernel): canonical 1 and 3 rows, plain 1, 2, 16, 17 and 32, a wide plain call
    for rows, s, kernel in ((1, setting, "mma"), (3, setting, "mma"), (1, None, "split"), (2, None, "mma"),
                            (split_rows.SPLIT_PLAIN_ROWS, None, "mma"), (split_rows.SPLIT_PLAIN_ROWS + 1, None, "mma"),
                            (split_rows.PLAIN_ROWS, None, "mma"), (split_rows.PLAIN_ROWS + 1, None, "mlx")):
        split_calls.clear()
        mma_calls.clear()
        x = rand(rows, layer.weight.shape[1] * 8, seed=rows, dtype=mx.bfloat16)
        with native_forms() if s is None else batch_invariant(s):
            got = layer(x)
        assert (mma_calls, split_calls) == {"mma": ([rows], []), "split": ([], [rows]), "mlx": ([], [])}[kernel]
        want = {"mma": rows_alone_quarter, "split": rows_alone, "mlx": lambda *a, **k: mx.quantized_matmul(
            *a, transpose=True, **k)}[kernel](x, w, scales, None, **kw)
        assert bits_equal(got, want), (rows, kernel)
    set_batch_invariant_limit(model, 0)


def test_a_middling_layer_takes_qmv_mma_for_canonical_rows_and_plain_calls_of_two_rows_on(kernels, monkeypatch):
    """Below qmv_split's size (an 8B's q and o): canonical rows and plain calls of 2+ rows
    through qmv_mma, a plain row MLX's; without qmv_mma here, the layer's own forms."""
    split_calls, mma_calls = kernels(rows_alone, rows_alone_quarter)
    monkeypatch.setattr(qmv_split, "MIN_ELEMENTS", 1 << 40)
    monkeypatch.setattr(qmv_mma, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(qmv_mma, "CANONICAL_MIN_ELEMENTS", 0)
    model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    assert set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,)).guaranteed
    layer = model.model.layers[0].self_attn.q_proj
    k = layer.weight.shape[1] * 8
    for rows, s, through in ((1, model._lockstep_setting, True), (3, model._lockstep_setting, True),
                             (1, None, False), (2, None, True), (split_rows.PLAIN_ROWS, None, True),
                             (split_rows.PLAIN_ROWS + 1, None, False)):
        mma_calls.clear()
        with native_forms() if s is None else batch_invariant(s):
            mx.eval(layer(rand(rows, k, seed=rows, dtype=mx.bfloat16)))
        assert mma_calls == ([rows] if through else []) and split_calls == [], (rows, s)
    set_batch_invariant_limit(model, 0)
    monkeypatch.setattr(qmv_mma, "unavailable_reason", lambda *a: "its smoke test failed")
    model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    assert set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,)).guaranteed
    mma_calls.clear()
    with batch_invariant(model._lockstep_setting):
        mx.eval(model.model.layers[0].self_attn.q_proj(rand(3, k, seed=3, dtype=mx.bfloat16)))
    assert mma_calls == [] and split_calls == []
    set_batch_invariant_limit(model, 0)


def test_a_small_layer_takes_qmv_mma_from_the_canonical_size_on(kernels, monkeypatch):
    """From CANONICAL_MIN_ELEMENTS on (an 8B's k and v), canonical rows and plain calls of 2+
    rows run qmv_mma, a plain row MLX's; below it, every call keeps the layer's own form."""
    split_calls, mma_calls = kernels(rows_alone, rows_alone_quarter)
    monkeypatch.setattr(qmv_split, "MIN_ELEMENTS", 1 << 40)
    probe = tiny_llama(quant="nvfp4", dtype=mx.bfloat16).model.layers[0].self_attn.k_proj
    size = probe.weight.shape[0] * probe.weight.shape[1] * 8
    monkeypatch.setattr(qmv_mma, "MIN_ELEMENTS", 4 * size)
    for canonical_min, through in ((size, True), (size + 1, False)):
        monkeypatch.setattr(qmv_mma, "CANONICAL_MIN_ELEMENTS", canonical_min)
        model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
        assert set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,)).guaranteed
        layer = model.model.layers[0].self_attn.k_proj
        for rows, s, want in ((1, model._lockstep_setting, through), (3, model._lockstep_setting, through),
                              (1, None, False), (2, None, through)):
            mma_calls.clear()
            x = rand(rows, layer.weight.shape[1] * 8, seed=rows, dtype=mx.bfloat16)
            with native_forms() if s is None else batch_invariant(s):
                got = layer(x)
            assert mma_calls == ([rows] if want else []) and split_calls == [], (canonical_min, rows, s)
            if want:
                assert bits_equal(got, rows_alone_quarter(x, layer["weight"], layer["scales"], None,
                                                          group_size=layer.group_size, bits=layer.bits,
                                                          mode=layer.mode))
        set_batch_invariant_limit(model, 0)
    # with invariance off the same layers are swapped (their plain calls of 2+ rows run qmv_mma):
    # k and v from CANONICAL_MIN_ELEMENTS on, not below it
    monkeypatch.setattr(qmv_split, "runs_here", lambda: True)  # as on CUDA
    monkeypatch.setattr(qmv_mma, "MIN_ELEMENTS", size + 1)
    for canonical_min, swapped in ((size, True), (size + 1, False)):
        monkeypatch.setattr(qmv_mma, "CANONICAL_MIN_ELEMENTS", canonical_min)
        model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
        invariance = set_batch_invariant_limit(model, 0)
        attention = model.model.layers[0].self_attn
        assert invariance.layers.get("split_rows", 0) > 0 and "_split_rows" in attention.q_proj.__dict__
        assert ("_split_rows" in attention.k_proj.__dict__) == swapped, canonical_min
        assert ("_split_rows" in attention.v_proj.__dict__) == swapped, canonical_min
        layers.uninstall(model)


def test_without_qmv_mma_here_canonical_rows_keep_qmv_split(kernels, model, monkeypatch):
    split_calls, mma_calls = kernels(rows_alone, rows_alone_quarter)
    monkeypatch.setattr(qmv_mma, "unavailable_reason", lambda *a: "its smoke test failed")
    assert set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,)).guaranteed
    layer = model.model.layers[0].mlp.gate_proj
    for rows in (1, 3):
        split_calls.clear()
        with batch_invariant(model._lockstep_setting):
            mx.eval(layer(rand(rows, layer.weight.shape[1] * 8, seed=rows, dtype=mx.bfloat16)))
        assert split_calls == [rows]
    assert mma_calls == []
    set_batch_invariant_limit(model, 0)


def test_a_qmv_mma_stand_in_whose_rows_depend_on_the_width_is_refused(kernels):
    with shape_variant_backend(quantized_rows=2):  # a quantized call of 2+ rows varies here
        kernels(rows_alone, one_call)  # qmv_mma's stand-in: all rows in one call
        model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
        invariance = set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,))
        assert not invariance.guaranteed and "self-test failed" in invariance.reason


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("n, k", [(1024, 4096), (4096, 14336), (14336, 4096), (33, 1152)])
def test_staged_launches_cover_every_output_with_the_same_warps(n, k, groups):
    for m in (1, 8, 9, 16, 17, 32, 33):
        plain = dict(qmv_mma._launch_plan(m, n, k, "nvfp4", 16, mx.bfloat16, groups=0)["template"])
        plan = qmv_mma._launch_plan(m, n, k, "nvfp4", 16, mx.bfloat16, groups=groups)
        t = dict(plan["template"])
        assert t["WARPS"] == plain["WARPS"] and t["CG"] == groups  # the K split (the order) as unstaged
        assert plan["threadgroup"] == (32 * t["WARPS"] * groups, 1, 1)
        assert qmv_mma.block_threads(plan["template"]) == 32 * t["WARPS"] * groups
        blocks = plan["grid"][0] // plan["threadgroup"][0]
        assert blocks * groups * 8 * t["NT"] >= n > (blocks - 1) * groups * 8 * t["NT"]
        assert plan["shared_memory"] == qmv_mma.staged_bytes(t["WARPS"], t["NT"], t["ROWS"], t["DEPTH"], groups)
        assert 0 < plan["shared_memory"] <= qmv_mma.MAX_SHARED_BYTES
    assert "shared_memory" not in qmv_mma._launch_plan(32, n, k, "nvfp4", 16, mx.bfloat16, groups=0)
    assert qmv_mma.block_threads(plain.items()) is None


def test_staged_shared_memory_is_the_kernels_layout():
    # Staged<WARPS, NT, ROWS, DEPTH, CG>::BYTES in qmv_mma.cu: table + slab, or the partial sums
    assert qmv_mma.staged_bytes(8, 2, 32, 1, 1) == 32 * 8 * 16 * 16  # 64 KB of x: 32 rows place bits
    assert qmv_mma.staged_bytes(8, 4, 16, 1, 1) == 256 * 32 * 4 + 16 * 8 * 16 * 16  # a table copy a lane
    assert qmv_mma.staged_bytes(4, 4, 8, 2, 2) == 256 * 4 + 8 * 4 * 2 * 16 * 16
    assert qmv_mma.staged_bytes(8, 8, 32, 1, 4) == 4 * 8 * 2 * 8 * 128 * 4  # partial sums the larger
    assert qmv_mma.staged_bytes(8, 2, 32, 1, 0) == 0
    with pytest.raises(ValueError, match="shared memory"):
        qmv_mma.launch_shape(4096, 4096, 32, tiles=4, ahead=4, groups=1)
    text = qmv_mma.SOURCE.read_text()
    for line in ("BY_BITS = ROWS >= 32;", "COPIES = ROWS >= 16 ? 32 : 1;", "BYTES = BY_BITS ? 0 : 256 * COPIES * 4;",
                 "TABLE_BYTES = CodeTable<ROWS>::BYTES;", "UNITS = WARPS * DEPTH * 16", "SLAB_BYTES = ROWS * UNITS * 16",
                 "PARTIAL_BYTES = CG * WARPS * MT * NT * 128 * 4",
                 "TABLE_BYTES + SLAB_BYTES > PARTIAL_BYTES ? TABLE_BYTES + SLAB_BYTES : PARTIAL_BYTES;"):
        assert line in text


def test_the_smoke_test_fails_a_staged_tile_whose_bits_differ(monkeypatch):
    """The smoke test runs each staged CG beside the unstaged tile (here a stand-in: MLX's call row
    by row); a staged launch one epsilon off is named, the honest one is not."""
    def stand_in(broken):
        def matmul(x, wq, scales, biases, *, group_size, bits, mode, tiles=None, ahead=None, groups=None):
            rows = [mx.quantized_matmul(x[i:i + 1], wq, scales, biases, transpose=True, group_size=group_size,
                                        bits=bits, mode=mode) for i in range(x.shape[0])]
            y = mx.concatenate(rows, axis=0)
            return y * (1 + 2.0 ** -6) if broken and groups in qmv_mma.STAGED_GROUPS else y
        return matmul

    monkeypatch.setattr(qmv_mma.compiled, "precompile", lambda instances: 0)
    monkeypatch.setattr(qmv_mma, "SMOKE_SHAPES", ((2, 33, 256), (5, 16, 128)))
    monkeypatch.setattr(qmv_mma, "matmul", stand_in(broken=True))
    assert "the staged tile (CG 1) differs" in qmv_mma._smoke_test("nvfp4", mx.bfloat16)
    monkeypatch.setattr(qmv_mma, "matmul", stand_in(broken=False))
    assert "staged" not in (qmv_mma._smoke_test("nvfp4", mx.bfloat16) or "")
