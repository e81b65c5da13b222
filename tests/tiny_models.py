"""Small random-weight mlx-lm llama models for the batch-invariance tests (2 CPU cores)."""
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

# mode -> (group_size, bits), mlx's defaults; hidden 128 keeps every K a multiple of 64.
QUANT_MODES = {"affine": (64, 4), "mxfp4": (32, 4), "mxfp8": (32, 8), "nvfp4": (16, 4)}


def tiny_llama(*, tied=False, bias=False, quant=None, dtype=mx.float32, sliding=False, seed=0):
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
        tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias,
        layer_types=["sliding_attention", "full_attention"] if sliding else None,
        sliding_window=8 if sliding else None,
    )
    model = llama.Model(args)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    if quant is not None:
        group_size, bits = QUANT_MODES[quant]
        nn.quantize(model, group_size=group_size, bits=bits, mode=quant)
    mx.eval(model.parameters())
    return model
