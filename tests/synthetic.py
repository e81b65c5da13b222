"""Build small synthetic llama models as mlx-lm model directories (random weights).

The default shape is the one that breaks MLX's nvfp4 kernels: hidden 1040 and
intermediate 2064 are both 16 mod 32, which only nvfp4 (group 16) can quantize.
Weights are random but scaled so that logits are spread out (greedy choices are not
ties) and activations stay finite through the layers.
"""
from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama
from mlx_lm.utils import quantize_model, save_config, save_model

HIDDEN = 1040        # 16 mod 32
INTERMEDIATE = 2064  # 16 mod 32
HEADS = 13           # head_dim 80
KV_HEADS = 1
LAYERS = 2
VOCAB = 384


def llama_config(
    hidden: int = HIDDEN,
    intermediate: int = INTERMEDIATE,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    layers: int = LAYERS,
    vocab: int = VOCAB,
    tie_word_embeddings: bool = True,
) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def random_llama(config: dict, seed: int = 0) -> nn.Module:
    """A float32 llama `Model` with reproducible random weights."""
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # mlx's default embedding init (std ~ dims**-0.5) makes tied logits nearly flat;
    # std 0.1 gives logits of std ~3, so greedy picks are not near-ties.
    embed = model.model.embed_tokens
    embed.weight = mx.random.normal(embed.weight.shape) * 0.1
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    return model


def write_model_dir(model: nn.Module, config: dict, out: Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(dict(config), out / "config.json")
    return out


def build_llama_dir(
    out: Path,
    q_mode: str | None = None,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    seed: int = 0,
    **config_overrides,
) -> Path:
    """Write a synthetic llama model dir; quantized with mlx-lm's quantizer if q_mode."""
    config = llama_config(**config_overrides)
    model = random_llama(config, seed=seed)
    if q_mode is not None:
        model, config = quantize_model(model, config, q_group_size, q_bits, mode=q_mode)
    return write_model_dir(model, config, out)


def write_tiny_tokenizer(out: Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer.json + tokenizer_config.json covering ids 0..vocab-1.

    Enough for `mlx_lm.load`/`models.load` to build a tokenizer wrapper; the text it
    produces is meaningless, which is fine for a random model.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(len(words), vocab):
        words[f"w{i}"] = i
    tok = Tokenizer(WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    out = Path(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": 2048,
    }))


def parameter_names(model: nn.Module) -> list[str]:
    return [name for name, _ in tree_flatten(model.parameters())]
