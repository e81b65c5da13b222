"""A quantized embedding's lookup with its one-byte scales (nvfp4, mxfp4, mxfp8) gathered four
at a time, as 32-bit words: the same bytes, so the same bits as `nn.QuantizedEmbedding`'s own
call, where MLX's CUDA gather of single bytes is many times slower than the weight's own
gather at 16 and 32 rows (docs/BENCHMARKS.md, Kernels). layers.py gives it to the embeddings it
swaps.
"""
import mlx.core as mx
import mlx.nn as nn

_own_call = nn.QuantizedEmbedding.__call__


def looks_up_words(layer) -> bool:
    """Whether the layer's scales are one-byte rows that split into whole 32-bit words."""
    scales = layer["scales"]
    return scales.dtype == mx.uint8 and scales.ndim == 2 and scales.shape[-1] % 4 == 0


def lookup(layer, x):
    """nn.QuantizedEmbedding.__call__(layer, x), its scales gathered as words where
    looks_up_words."""
    if not looks_up_words(layer):
        return _own_call(layer, x)
    biases = layer.get("biases")
    return mx.dequantize(layer["weight"][x], scales=layer["scales"].view(mx.uint32)[x].view(mx.uint8),
                         biases=biases[x] if biases is not None else None, group_size=layer.group_size,
                         bits=layer.bits, mode=layer.mode)
