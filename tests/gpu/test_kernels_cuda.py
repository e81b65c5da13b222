"""Every CUDA kernel of kernels/custom/ on the GPU, at a Llama-3-8B's layer shapes, against its
NumPy order model, and every row of every call of 1..L rows against the row computed alone
(f(a[:1]) == f(a)[:1], the property the guarantee rests on).

Bit for bit where the model is: gemv_rows, qmv_rows, qmv_split and the scalar skinny kernel
(loop_order.py), whose models emulate each rounding. The tensor-core kernels (skinny's MMA
path, qmv_mma) are within two of T's epsilon of theirs (an MMA's internal rounding is the
hardware's, which no model has), the attention kernels within one bfloat16 step (expf is the
device's); their rows are still checked bit for bit against each other. Random weights, made on
the device; outputs checked on a sample of columns (tests/gpu/cuda_cases.py).
"""
import mlx.core as mx
import numpy as np
import pytest

from lockstep.kernels.custom import (attention, attention_order, gemv_order, gemv_rows, loop_order, mma_order,
                                     qmv_mma, qmv_mma_order, qmv_mma_parts, qmv_order, qmv_rows, qmv_split,
                                     qmv_split_order, skinny, split_attention, split_attention_order)
from tests.gpu.cuda_cases import (FOUR_BIT, FORMATS, LINEARS, L, SMOL_LINEARS, as_dtype, columns, dequantized_columns,
                                  dtype_name, mismatches, quantized, rand, rows_alone, values, widths_keeping_row_bits)

pytestmark = pytest.mark.gpu

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
HALF = ("bfloat16", "float16")
MODEL_ROWS = 29  # rows checked against a model: a partial row group of every kernel (cuda_cases.SAMPLED)
ALL_WIDTHS = range(1, L + 1)


def epsilon_gap(have: np.ndarray, want: np.ndarray, dtype) -> float:
    """How far have is from want in units of T's epsilon at each output (plus a thousandth of the
    largest output): below 2 where only a tensor core's own rounding differs (qmv_mma._model_gap)."""
    eps = 2.0 ** (-7 if dtype == mx.bfloat16 else -10)
    scale = eps * (np.abs(want) + 1e-3 * np.max(np.abs(want)))
    return float(np.max(np.abs(have - want) / scale))


# -- gemv_rows: dense rows in the order of MLX's single-row GEMV ----------------------------

@pytest.mark.parametrize("linear", LINEARS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_rows_is_its_order_model_and_mlxs_single_row_call(linear, dtype):
    n, k = LINEARS[linear]
    t = DTYPES[dtype]
    x, w = rand((MODEL_ROWS, k), t, 1), rand((n, k), t, 2)
    got = gemv_rows.matmul(x, w)
    cols = columns(n)
    model = as_dtype(gemv_order.gemv_rows(values(x), values(w[mx.array(cols)])), t)
    assert np.array_equal(values(got)[:, cols], model), mismatches(values(got)[:, cols], model)
    assert mx.array_equal(got, rows_alone(lambda r: r @ w.T, x)).item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_rows_rows_keep_their_bits_at_every_width_up_to_l(dtype):
    n, k = LINEARS["gate_up"]
    t = DTYPES[dtype]
    x, w = rand((L, k), t, 3), rand((n, k), t, 4)
    alone = rows_alone(lambda r: r @ w.T, x)  # MLX's own single-row GEMV: a decode step's call
    assert widths_keeping_row_bits(lambda r: gemv_rows.matmul(r, w), x, alone, ALL_WIDTHS) == []


# -- qmv_rows: quantized rows in the order of MLX's single-row quantized GEMV ----------------

@pytest.mark.parametrize("linear", LINEARS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_qmv_rows_is_its_order_model_in_both_dequantization_roundings(fmt, linear):
    n, k = LINEARS[linear]
    for dtype in HALF if linear == "gate_up" else HALF[:1]:
        t = DTYPES[dtype]
        x = rand((MODEL_ROWS, k), t, 5)
        wq, scales, biases, kw = quantized(n, k, fmt, t, 6)
        cols = columns(n)
        w_bits = qmv_order.weight_bits(kw["mode"], kw["bits"])
        for fused in (0, 1) if kw["mode"] == "affine" else (0,):
            got = values(qmv_rows.matmul(x, wq, scales, biases, fused=fused, **kw))[:, cols]
            w = dequantized_columns(wq, scales, biases, cols, kw, t, fused=bool(fused))
            model = qmv_order.qmv_rows(values(x), w, w_bits=w_bits, dtype=dtype)
            assert np.array_equal(got, model), f"{dtype} fused={fused}: {mismatches(got, model)}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_qmv_rows_rows_are_mlxs_single_row_call_at_every_width_up_to_l(fmt):
    n, k = LINEARS["gate_up"]
    for t in (mx.bfloat16, mx.float16):
        x = rand((L, k), t, 7)
        wq, scales, biases, kw = quantized(n, k, fmt, t, 8)
        fused = qmv_rows.proven_variant(kw["mode"], qmv_order.weight_bits(kw["mode"], kw["bits"]), t)
        assert fused is not None, qmv_rows.unavailable_reason(kw["mode"], kw["bits"], t)
        alone = rows_alone(lambda r: mx.quantized_matmul(r, wq, scales, biases, transpose=True, **kw), x)
        bad = widths_keeping_row_bits(lambda r: qmv_rows.matmul(r, wq, scales, biases, fused=fused, **kw), x, alone,
                                      ALL_WIDTHS)
        assert bad == [], f"{t}: rows differ from MLX's single-row call at widths {bad}"


MLX_ROWS_SHAPES = [SMOL_LINEARS["k_v"], SMOL_LINEARS["gate_up"], SMOL_LINEARS["head"], LINEARS["k_v"]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_mlxs_own_call_of_up_to_7_rows_gives_each_row_its_single_row_bits(fmt):
    """What qmv_rows leaves to MLX (calls of 2..MLX_GEMV_ROWS rows: its per-row GEMV) keeps every
    row's single-row bits, at a small model's shapes and an 8B's, x as (M, K) and (1, M, K)."""
    group = FORMATS[fmt][2]
    for n, k in [(n, k) for n, k in MLX_ROWS_SHAPES if k % group == 0]:  # SmolLM2's K = 576: no g128
        for t in (mx.bfloat16, mx.float16):
            x = rand((qmv_order.MLX_GEMV_ROWS, k), t, 11)
            wq, scales, biases, kw = quantized(n, k, fmt, t, 8)
            call = lambda r: mx.quantized_matmul(r, wq, scales, biases, transpose=True, **kw)  # noqa: E731
            alone = rows_alone(call, x)
            widths = range(2, qmv_order.MLX_GEMV_ROWS + 1)
            assert widths_keeping_row_bits(call, x, alone, widths) == [], (n, k, t)
            assert widths_keeping_row_bits(lambda r: call(r[None])[0], x, alone, widths) == [], (n, k, t)


WIDE = (33, 48, 64)  # a wide deterministic call in one launch: up to the kernel's 64 rows


@pytest.mark.parametrize("linear", SMOL_LINEARS)
@pytest.mark.parametrize("fmt", ["nvfp4", "affine4"])
def test_qmv_rows_at_a_small_models_shapes_is_its_model_and_mlxs_single_row_call_up_to_64_rows(fmt, linear):
    """A SmolLM2's layers, below the size of lockstep's own 4-bit kernels, whose deterministic
    rows run qmv_rows in one launch up to 64 rows (K = 576: a partial last tile of 512)."""
    n, k = SMOL_LINEARS[linear]
    t = mx.bfloat16
    x = rand((max(WIDE), k), t, 26)
    wq, scales, biases, kw = quantized(n, k, fmt, t, 27)
    fused = qmv_rows.proven_variant(kw["mode"], qmv_order.weight_bits(kw["mode"], kw["bits"]), t)
    assert fused is not None, qmv_rows.unavailable_reason(kw["mode"], kw["bits"], t)

    def call(r):
        return qmv_rows.matmul(r, wq, scales, biases, fused=fused, **kw)

    cols = columns(n)
    got = values(call(x[:MODEL_ROWS]))[:, cols]
    w = dequantized_columns(wq, scales, biases, cols, kw, t, fused=bool(fused))
    model = qmv_order.qmv_rows(values(x[:MODEL_ROWS]), w, w_bits=4, dtype="bfloat16")
    assert np.array_equal(got, model), mismatches(got, model)
    alone = rows_alone(lambda r: mx.quantized_matmul(r, wq, scales, biases, transpose=True, **kw), x)
    bad = widths_keeping_row_bits(call, x, alone, [*ALL_WIDTHS, *WIDE])
    assert bad == [], f"rows differ from MLX's single-row call at widths {bad}"


# -- qmv_split: 4-bit rows, K split across a block, lockstep's own order ---------------------

@pytest.mark.parametrize("linear", LINEARS)
@pytest.mark.parametrize("fmt", FOUR_BIT)
def test_qmv_split_is_its_order_model(fmt, linear):
    n, k = LINEARS[linear]
    for dtype in HALF if linear == "down" else HALF[:1]:
        t = DTYPES[dtype]
        x = rand((MODEL_ROWS, k), t, 9)
        wq, scales, biases, kw = quantized(n, k, fmt, t, 10)
        cols = columns(n)
        got = values(qmv_split.matmul(x, wq, scales, biases, **kw))[:, cols]
        model = qmv_split_order.qmv_split(values(x), dequantized_columns(wq, scales, biases, cols, kw, t), dtype=dtype)
        assert np.array_equal(got, model), f"{dtype}: {mismatches(got, model)}"


# -- qmv_mma: 4-bit rows on tensor cores -----------------------------------------------------

@pytest.mark.parametrize("linear", LINEARS)
@pytest.mark.parametrize("fmt", FOUR_BIT)
def test_qmv_mma_is_within_two_epsilons_of_its_order_model(fmt, linear):
    n, k = LINEARS[linear]
    t = mx.bfloat16
    x = rand((MODEL_ROWS, k), t, 11)
    wq, scales, biases, kw = quantized(n, k, fmt, t, 12)
    cols = columns(n)
    got = values(qmv_mma.matmul(x, wq, scales, biases, **kw))[:, cols]
    # the warps a block splits K across are part of the order: the whole layer's, not the sample's
    model = qmv_mma_order.qmv_mma(values(x), dequantized_columns(wq, scales, biases, cols, kw, t),
                                  dtype="bfloat16", warps=qmv_mma.block_warps(n, k))
    assert epsilon_gap(got, model, t) <= 2.0


@pytest.mark.parametrize("kernel", ["qmv_split", "qmv_mma"])
@pytest.mark.parametrize("fmt", FOUR_BIT)
def test_4bit_kernels_rows_keep_their_bits_at_every_width_up_to_l(kernel, fmt):
    module = {"qmv_split": qmv_split, "qmv_mma": qmv_mma}[kernel]
    for linear in ("k_v", "down"):  # narrow (8 warps a block for qmv_mma) and K = 14336
        n, k = LINEARS[linear]
        x = rand((L, k), mx.bfloat16, 13)
        wq, scales, biases, kw = quantized(n, k, fmt, mx.bfloat16, 14)

        def call(r):
            return module.matmul(r, wq, scales, biases, **kw)

        assert widths_keeping_row_bits(call, x, rows_alone(call, x), ALL_WIDTHS) == [], linear


@pytest.mark.parametrize("parts", [("q_o", "k_v", "k_v"), ("gate_up", "gate_up")])
@pytest.mark.parametrize("fmt", ["nvfp4", "affine4"])
def test_qmv_mma_parts_give_each_part_its_own_calls_bits_at_every_width_up_to_l(fmt, parts):
    """q, k, v in one launch (8 warps a block each) and gate, up (4 each), against each layer's
    own qmv_mma call, row by row alone."""
    k = LINEARS[parts[0]][1]
    layers = []
    for i, name in enumerate(parts):
        wq, scales, biases, kw = quantized(LINEARS[name][0], k, fmt, mx.bfloat16, 20 + i)
        layers.append((wq, scales, biases))
    x = rand((L, k), mx.bfloat16, 15)
    alone = [rows_alone(lambda r, part=part: qmv_mma.matmul(r, *part, **kw), x) for part in layers]
    bad = []
    for m in ALL_WIDTHS:
        together = qmv_mma_parts.matmuls(x[:m], layers, **kw)
        mx.eval(together)
        bad += [(m, i) for i in range(len(layers)) if not mx.array_equal(together[i], alone[i][:m]).item()]
    assert bad == [], f"(width, part) differing from the part's own one-row call: {bad[:8]}"


# -- skinny: the scalar kernel (float32 x) and the tensor-core one (16-bit x) ----------------

SKINNY_WIDTHS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64)  # columns_per_warp and R8 steps


@pytest.mark.parametrize("linear", LINEARS)
@pytest.mark.parametrize("kind", ["dense", "affine4", "nvfp4"])
def test_skinny_scalar_kernel_is_its_order_model(kind, linear):
    n, k = LINEARS[linear]
    x = rand((MODEL_ROWS, k), mx.float32, 16)
    cols = columns(n)
    pick = mx.array(cols.astype(np.int32))
    if kind == "dense":
        w = rand((n, k), mx.float32, 17)
        got = skinny.dense_matmul(x, w)
        wf, unit = values(w[pick]), loop_order.unit_elements(4)
    else:
        wq, scales, biases, kw = quantized(n, k, kind, mx.float32, 17)
        got = skinny.quantized_matmul(x, wq, scales, biases, **kw)
        wf = loop_order.dequantize(np.array(wq[pick]), np.array(scales[pick]),
                                   None if biases is None else np.array(biases[pick]),
                                   group_size=kw["group_size"], mode=kw["mode"])
        unit = loop_order.QUANT_UNIT
    assert not skinny.uses_mma(mx.float32)
    model = loop_order.skinny_matmul(values(x), wf, unit).astype(np.float64)
    have = values(got)[:, cols]
    assert np.array_equal(have, model), mismatches(have, model)


@pytest.mark.parametrize("linear", ["k_v", "down", "head"])
@pytest.mark.parametrize("kind", ["dense", "affine4", "nvfp4"])
def test_skinny_tensor_core_kernel_is_close_to_its_order_model(kind, linear):
    n, k = LINEARS[linear]
    t = mx.bfloat16
    x = rand((MODEL_ROWS, k), t, 18)
    cols = columns(n)
    pick = mx.array(cols.astype(np.int32))
    if kind == "dense":
        w = rand((n, k), t, 19)
        got = skinny.dense_matmul(x, w)
        wt, bits = values(w[pick]), 16
    else:
        wq, scales, biases, kw = quantized(n, k, kind, t, 19)
        got = skinny.quantized_matmul(x, wq, scales, biases, **kw)
        wf = loop_order.dequantize(np.array(wq[pick]), values(scales[pick]) if biases is not None
                                   else np.array(scales[pick]), None if biases is None else values(biases[pick]),
                                   group_size=kw["group_size"], mode=kw["mode"])
        wt, bits = as_dtype(wf, t), 4  # the kernel feeds the MMA weights of x's type
    assert skinny.uses_mma(t)
    model = as_dtype(mma_order.skinny_mma(values(x), wt, bits), t)
    # a weight dequantized in float32 then rounded to T may sit one step of T from the kernel's
    assert epsilon_gap(values(got)[:, cols], model, t) <= (2.0 if kind == "dense" else 4.0)


@pytest.mark.parametrize("case", ["dense float32", "dense bfloat16", "affine4 bfloat16", "nvfp4 float16"])
def test_skinny_rows_keep_their_bits_at_every_width(case):
    kind, dtype = case.split()
    t = DTYPES[dtype]
    n, k = LINEARS["q_o"]
    x = rand((max(SKINNY_WIDTHS), k), t, 24)
    if kind == "dense":
        w = rand((n, k), t, 25)

        def call(r):
            return skinny.dense_matmul(r, w)
    else:
        wq, scales, biases, kw = quantized(n, k, kind, t, 25)

        def call(r):
            return skinny.quantized_matmul(r, wq, scales, biases, **kw)

    assert widths_keeping_row_bits(call, x, rows_alone(call, x), SKINNY_WIDTHS) == []


# -- the pool attention kernels: pooled (deterministic passes) and split (plain passes) ------

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
# keys each row sees: one key, tile and pass tails around 32 / 256, mlx-lm's cache step, long
LENGTHS = (1, 31, 32, 33, 255, 256, 257, 1000, 4097)


def pool_case(count: int, dtype, seed: int):
    """(queries (1, 32, count, 128), key pool, value pool (8, slots, 128), PoolRows): row r sees
    LENGTHS[r % 9] keys from its own base slot."""
    lens = [LENGTHS[r % len(LENGTHS)] for r in range(count)]
    base = list(np.cumsum([0] + [n + 3 for n in lens[:-1]]))
    slots = int(base[-1] + lens[-1] + 5)
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, HEADS, count, HEAD_DIM), key=kq).astype(dtype)
    kp = mx.random.normal((KV_HEADS, slots, HEAD_DIM), key=kk).astype(dtype)
    vp = mx.random.normal((KV_HEADS, slots, HEAD_DIM), key=kv).astype(dtype)
    mx.eval(q, kp, vp)
    return q, kp, vp, attention.PoolRows([int(b) for b in base], lens)


def attend(module, q, kp, vp, rows):
    out = module.kernel_attention(q, kp, vp, rows, HEAD_DIM ** -0.5)
    mx.eval(out)
    return out


@pytest.mark.parametrize("kernel", ["pooled", "split"])
def test_pool_attention_is_close_to_its_order_model(kernel):
    module = {"pooled": attention, "split": split_attention}[kernel]
    t = mx.bfloat16
    q, kp, vp, rows = pool_case(len(LENGTHS), t, 30)
    got = values(attend(module, q, kp, vp, rows))[0]
    qv, kv, vv = values(q)[0], values(kp), values(vp)
    for h in (0, 3, 4, 31):  # heads of the first, second and last kv head
        kvh = h // (HEADS // KV_HEADS)
        for r, (start, length) in enumerate(zip(rows.base, rows.lens)):
            keys, vals = kv[kvh, start : start + length], vv[kvh, start : start + length]
            if kernel == "pooled":
                want = attention_order.attention_row(qv[h, r], keys, vals, HEAD_DIM ** -0.5)
            else:
                want = split_attention_order.attention_row(qv[h, r], keys, vals, HEAD_DIM ** -0.5, itemsize=t.size)
            np.testing.assert_allclose(got[h, r], as_dtype(want, t), rtol=2 ** -7, atol=1e-3,
                                       err_msg=f"head {h}, row {r} ({length} keys)")


@pytest.mark.parametrize("kernel", ["pooled", "split"])
@pytest.mark.parametrize("dtype", HALF)
def test_pool_attention_rows_keep_their_bits_at_every_width_up_to_l(kernel, dtype):
    module = {"pooled": attention, "split": split_attention}[kernel]
    q, kp, vp, rows = pool_case(L, DTYPES[dtype], 31)
    alone = mx.concatenate([attend(module, q[:, :, r : r + 1], kp, vp,
                                   attention.PoolRows(rows.base[r : r + 1], rows.lens[r : r + 1]))
                            for r in range(L)], axis=2)
    bad = []
    for m in ALL_WIDTHS:
        out = attend(module, q[:, :, :m], kp, vp, attention.PoolRows(rows.base[:m], rows.lens[:m]))
        if not mx.array_equal(out, alone[:, :, :m]).item():
            bad.append(m)
    assert bad == []
