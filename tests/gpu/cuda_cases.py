"""What the GPU suite's tests share: an 8B's layer shapes, the quantized formats, random arrays
made on the device, the output columns an order model is checked on, and the models' inputs.

An order model is a NumPy loop over K for every output; at an 8B's widths it runs on a sample
of each layer's columns (the first and last ones, where partial warps, blocks and tiles sit,
and a random spread), while the kernel computes the whole layer: which block or warp runs an
output never changes its order, so the sample checks every part of the index math a column
has."""
import mlx.core as mx
import numpy as np

from lockstep.kernels.custom.qmv_order import dequantize

HIDDEN, INTERMEDIATE, KV, VOCAB = 4096, 14336, 1024, 128256
# (N, K) of each linear of a Llama-3-8B layer, and its head
LINEARS = {"q_o": (HIDDEN, HIDDEN), "k_v": (KV, HIDDEN), "gate_up": (INTERMEDIATE, HIDDEN),
           "down": (HIDDEN, INTERMEDIATE), "head": (VOCAB, HIDDEN)}
# (N, K) of each linear of a SmolLM2-135M layer (9 / 3 heads of 64), and its (tied) head: every
# one below the size of lockstep's own 4-bit kernels (qmv_mma, qmv_split; the head's K is not a
# multiple of qmv_mma's 128), so their deterministic rows run qmv_rows
SMOL_HIDDEN, SMOL_INTERMEDIATE, SMOL_KV, SMOL_VOCAB = 576, 1536, 192, 49152
SMOL_LINEARS = {"q_o": (SMOL_HIDDEN, SMOL_HIDDEN), "k_v": (SMOL_KV, SMOL_HIDDEN),
                "gate_up": (SMOL_INTERMEDIATE, SMOL_HIDDEN), "down": (SMOL_HIDDEN, SMOL_INTERMEDIATE),
                "head": (SMOL_VOCAB, SMOL_HIDDEN)}
# (mode, bits, group size) of each quantized format
FORMATS = {"affine4": ("affine", 4, 64), "affine4_g32": ("affine", 4, 32), "affine4_g128": ("affine", 4, 128),
           "affine8": ("affine", 8, 64), "nvfp4": ("nvfp4", 4, 16), "mxfp4": ("mxfp4", 4, 32),
           "mxfp8": ("mxfp8", 8, 32)}
FOUR_BIT = [name for name, (_, bits, _) in FORMATS.items() if bits == 4]
# Row counts the suite proves every row of, 1..L: a deployment's L (32 covers every row block of
# the kernels: qmv_rows' 2 and 4 rows a warp, qmv_split's 4 a block, qmv_mma's 8, 16 and 32).
L = 32
# Random columns besides the first and last 32. A 16-bit output hides most float32-level order
# differences (a float32 sum in another order rounds to the same bfloat16 nearly always), so a
# model check needs thousands of outputs to see one: 256 columns x 29 rows a layer.
SAMPLED = 192


def rand(shape, dtype, seed: int) -> mx.array:
    a = mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)
    mx.eval(a)
    return a


def quantized(n: int, k: int, fmt: str, dtype, seed: int) -> tuple:
    """(weight, scales, biases or None, quantization keywords) of a random (n, k) weight."""
    mode, bits, group = FORMATS[fmt]
    wq, scales, *rest = mx.quantize(rand((n, k), dtype, seed), group, bits, mode=mode)
    biases = rest[0] if rest else None
    mx.eval(wq, scales, *rest)
    return wq, scales, biases, dict(group_size=group, bits=bits, mode=mode)


def columns(n: int, seed: int = 0) -> np.ndarray:
    """Output columns an order model is checked on: the first and last 32 and a random spread."""
    rng = np.random.default_rng(seed)
    picked = np.concatenate([np.arange(min(32, n)), np.arange(max(0, n - 32), n), rng.integers(0, n, SAMPLED)])
    return np.unique(picked)


def values(a) -> np.ndarray:
    """An MLX array's values as float64 (16-bit floats and float32 convert exactly)."""
    return np.array(a.astype(mx.float32)).astype(np.float64)


def dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def dequantized_columns(wq, scales, biases, cols, kw: dict, dtype, fused: bool = False) -> np.ndarray:
    """The weight rows `cols` dequantized in x's type T the way the quantized GEMV kernels do
    it (qmv_order.dequantize), as float64 values of T."""
    pick = mx.array(cols.astype(np.int32))
    s = scales[pick]
    return dequantize(np.array(wq[pick]), values(s) if kw["mode"] == "affine" else np.array(s),
                      None if biases is None else values(biases[pick]), mode=kw["mode"], bits=kw["bits"],
                      group_size=kw["group_size"], dtype=dtype_name(dtype), fused=fused)


def as_dtype(model_out: np.ndarray, dtype) -> np.ndarray:
    """An order model's float32/float64 result rounded to the kernel's output type by MLX's own
    conversion (round to nearest even), as float64 values."""
    return values(mx.array(np.asarray(model_out, np.float32)).astype(dtype))


def mismatches(got: np.ndarray, want: np.ndarray) -> str:
    """A short account of where two arrays of values differ (for assertion messages)."""
    bad = np.argwhere(got != want)
    if not len(bad):
        return "none"
    i = tuple(bad[0])
    return f"{len(bad)} of {got.size} differ, first at {i}: kernel {got[i]!r}, model {want[i]!r}"


def rows_alone(call, x: mx.array) -> mx.array:
    """call(x[i:i+1]) for each row of x, stacked: what every wider call's rows must equal."""
    out = mx.concatenate([call(x[i : i + 1]) for i in range(x.shape[0])], axis=0)
    mx.eval(out)
    return out


def widths_keeping_row_bits(call, x: mx.array, alone: mx.array, widths) -> list:
    """The row counts m at which call(x[:m]) is not alone[:m] bit for bit (want: none). One
    evaluation per width; f(a[:1]) == f(a)[:1] for every row and width."""
    bad = []
    for m in widths:
        out = call(x[:m])
        mx.eval(out)
        if not mx.array_equal(out, alone[:m]).item():
            bad.append(m)
    return bad
