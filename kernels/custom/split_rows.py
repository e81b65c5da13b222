"""Which of lockstep's own 4-bit row kernels a call of a layer runs (qmv_mma.py on tensor
cores, qmv_split.py on CUDA cores), from the layer's size, the format, x's dtype, the call's
rows and whether they are canonical. The one place that decides: the layers
(invariance/ops.SplitRows) and the startup compile (precompile.py) both ask it.

- canonical rows (every call a setting makes canonical, one row included): `qmv_mma` where its
  smoke test passed here, for layers from a quarter of the size its plain calls need (an 8B's
  k and v too), else `qmv_split` for large layers; one kernel a layer and dtype, so a layer's
  rows have one order at every width;
- plain calls: one row of a large layer through `qmv_split` (of a smaller one MLX's GEMV,
  faster there than `qmv_mma`); 2..32 rows of every layer canonical rows run `qmv_mma` for
  (an 8B's q, k, v and o too: MLX's tiled quantized matmul is far slower there at these widths,
  docs/BENCHMARKS.md "Kernels") through it; wider calls (prompt chunks) MLX's, and on CUDA
  those of at least dequantized_rows.min_rows rows MLX's dequantize and dense matmul;
each where it was fastest on the H200 (bench/results/history/, issue 28's kernel files) or the
H100 (prompt chunks).

Sibling layers (an attention block's q, k and v; an MLP's gate and up: they read the same x)
run as parts of one `qmv_mma_parts` launch where each part is large enough to run `qmv_mma` on
its own (an 8B's gate and up, not its k and v): a part's bits are then its own call's, so
canonical rows take the launch at every width, and plain calls of 2..PLAIN_ROWS rows do. Per
call it was as fast as the separate launches on the H200, while a q/k/v launch (k and v in it)
was slower than q's own launch beside MLX's calls for k and v
(bench/results/history/2026-12-02-h200-sibling-layers-graph-size-issue28.md)."""
import mlx.nn as nn

from . import dequantized_rows, qmv_mma, qmv_mma_parts, qmv_split

# Layers of one parent that read the same x, in the order the parent calls them.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def takes_layer(n: int, k: int, mode: str, bits: int, group: int, canonical: bool = True) -> bool:
    """Whether any of the kernels is for a layer of (N, K) weights of this quantization (the
    same layers for plain calls alone, as with batch invariance off: their calls of 2..32 rows
    run qmv_mma wherever canonical rows would)."""
    return qmv_split.takes(mode, bits, group) and (qmv_split.pays(n, k) or qmv_mma.pays(n, k, True))


# Plain calls of at most PLAIN_ROWS rows go through these kernels (wider ones, prompt chunks,
# keep MLX's); qmv_split takes plain calls of at most SPLIT_PLAIN_ROWS (it reads the weights
# once for every 4 rows), qmv_mma the wider ones.
PLAIN_ROWS = 32
SPLIT_PLAIN_ROWS = 16


def kernel_for(n: int, k: int, mode: str, dtype, rows: int, canonical: bool):
    """The module (qmv_mma, qmv_split or dequantized_rows) such a call runs, or None: the
    layer's own path."""
    large = qmv_split.pays(n, k)
    mma_here = (qmv_mma.pays(n, k, True) and k % qmv_mma.CHUNK == 0
                and qmv_mma.unavailable_reason(mode, dtype) is None)
    if canonical:
        return qmv_mma if mma_here else qmv_split if large else None
    if rows > PLAIN_ROWS:  # a prompt chunk
        return dequantized_rows if dequantized_rows.runs_here() and dequantized_rows.pays(n, k, rows) else None
    if rows == 1:
        return qmv_split if large else None
    if mma_here:  # MLX's tiled quantized matmul reads an 8B's q/k/v/o far slower at 2..32 rows
        return qmv_mma
    return qmv_split if large and rows <= SPLIT_PLAIN_ROWS else None


def prompt_chunks_native(model, rows: int) -> bool:
    """Whether a plain prompt chunk of `rows` rows runs faster in the model's native forms than
    under a batch-invariance setting: on this backend some 4-bit layer's plain call of that many
    rows takes dequantized_rows (under a setting a prompt chunk runs MLX's own call)."""
    if not dequantized_rows.runs_here():
        return False
    for _, layer in model.named_modules():
        if isinstance(layer, nn.QuantizedLinear) and layer.weight.ndim == 2:
            n, k, mode, bits, group = layer_shape(layer)
            if takes_layer(n, k, mode, bits, group, canonical=False) and dequantized_rows.pays(n, k, rows):
                return True
    return False


def _signature(layer) -> tuple | None:
    if not isinstance(layer, nn.QuantizedLinear) or layer.weight.ndim != 2:
        return None
    return (layer.bits, layer.group_size, getattr(layer, "mode", "affine"), layer.weight.shape[1],
            layer.weight.dtype, layer.scales.dtype, "biases" in layer)


def sibling_groups(model) -> list[tuple]:
    """Each group of the model's quantized sibling layers that one launch could take: the
    layers (q, k, v or gate, up) of one parent, quantized alike, with one K."""
    groups = []
    for _, parent in model.named_modules():
        for names in SIBLINGS:
            layers = [parent.get(name) if isinstance(parent, dict) else None for name in names]
            signatures = {_signature(layer) for layer in layers}
            if len(signatures) == 1 and None not in signatures:
                groups.append(tuple(layers))
    return groups


def layer_shape(layer) -> tuple:
    """(n, k, mode, bits, group) of a 4-bit quantized layer."""
    mode = getattr(layer, "mode", "affine")
    return layer.weight.shape[0], layer.weight.shape[1] * 32 // layer.bits, mode, layer.bits, layer.group_size


def group_shape(layers) -> tuple:
    """(ns, k, mode, bits, group) of a sibling group: its parts' widths, then what they share."""
    shapes = [layer_shape(layer) for layer in layers]
    return (tuple(n for n, *_ in shapes),) + shapes[0][1:]


def parts_take(rows: int, canonical: bool) -> bool:
    """Whether a call of this many rows runs its sibling group's launch (where one takes the
    group): canonical calls at every width (their parts' own kernel is qmv_mma), plain calls
    of 2..PLAIN_ROWS rows (one plain row of a large layer runs qmv_split)."""
    return canonical or 2 <= rows <= PLAIN_ROWS


def parts_kernel_for(ns: tuple, k: int, mode: str, bits: int, group: int, dtype):
    """qmv_mma_parts where layers of widths ns (one K, one quantization) can run as one
    launch for rows of this dtype: each part large enough for qmv_mma on its own (so its rows
    have that call's bits, which canonical rows run anyway); else None."""
    if not (qmv_split.takes(mode, bits, group) and qmv_mma_parts.shares_order(ns, k)
            and k % qmv_mma.CHUNK == 0 and all(qmv_mma.pays(n, k) for n in ns)):
        return None
    return qmv_mma_parts if qmv_mma_parts.unavailable_reason(mode, dtype) is None else None
