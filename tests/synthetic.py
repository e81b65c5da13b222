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


# ------------------------------------------------------------- template-driven chat models

TEMPLATES = Path(__file__).parent / "chat_templates"  # published chat templates, unmodified
# Each family's tokenizer config, scaled down: its published chat template, its special tokens
# ((text, special) as in its tokenizer_config's added tokens), bos/eos and the generation
# config's eos tokens.
CHAT_FAMILIES = {
    "qwen2.5": {  # Qwen/Qwen2.5-*-Instruct: Hermes-style <tool_call> JSON
        "template": "qwen2.5-instruct.jinja",
        "specials": [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                     ("<tool_call>", False), ("</tool_call>", False)],
        "bos": None, "eos": "<|im_end|>", "eos_tokens": ["<|im_end|>", "<|endoftext|>"]},
    "llama3.2": {  # meta-llama/Llama-3.2-3B-Instruct: bare JSON calls with "parameters"
        "template": "llama-3.2-3b-instruct.jinja",
        "specials": [("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|start_header_id|>", True),
                     ("<|end_header_id|>", True), ("<|eom_id|>", True), ("<|eot_id|>", True),
                     ("<|python_tag|>", True)],
        "bos": "<|begin_of_text|>", "eos": "<|eot_id|>",
        "eos_tokens": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]},
    "mistral-nemo": {  # mistralai/Mistral-Nemo-Instruct-2407: [TOOL_CALLS] + a JSON list
        "template": "mistral-nemo-instruct-2407.jinja",
        "specials": [("<unk>", True), ("<s>", True), ("</s>", True), ("[INST]", True), ("[/INST]", True),
                     ("[AVAILABLE_TOOLS]", True), ("[/AVAILABLE_TOOLS]", True), ("[TOOL_RESULTS]", True),
                     ("[/TOOL_RESULTS]", True), ("[TOOL_CALLS]", True)],
        "bos": "<s>", "eos": "</s>", "eos_tokens": ["</s>"]},
    "gpt-oss": {  # openai/gpt-oss-20b: harmony channels; <|call|> is not in its eos list
        "template": "gpt-oss-20b.jinja",
        "specials": [("<|startoftext|>", True), ("<|endoftext|>", True), ("<|return|>", True),
                     ("<|constrain|>", True), ("<|channel|>", True), ("<|start|>", True), ("<|end|>", True),
                     ("<|message|>", True), ("<|call|>", True), ("<|endofprompt|>", True)],
        "bos": "<|startoftext|>", "eos": "<|return|>", "eos_tokens": ["<|return|>", "<|endoftext|>"]},
}


def write_chat_tokenizer(out: Path, family: str) -> dict[str, int]:
    """A byte-level BPE tokenizer (every byte a token, no merges, the family's special tokens as
    added tokens) and a tokenizer_config.json carrying the family's published chat template.
    Returns the vocabulary. Any text encodes, so the grammar engine can write any call."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    spec = CHAT_FAMILIES[family]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {text: i for i, (text, _) in enumerate(spec["specials"])}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(text, special=special, normalized=False) for text, special in spec["specials"]])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": spec["bos"], "eos_token": spec["eos"],
        "clean_up_tokenization_spaces": False, "model_max_length": 4096,
        "chat_template": (TEMPLATES / spec["template"]).read_text(),
    }))
    return vocab


def build_chat_model_dir(out: Path, family: str, seed: int = 0) -> Path:
    """A tiny random llama (hidden 64, 2 layers) with `family`'s tokenizer config: its own chat
    template, special tokens and eos tokens (generation_config.json, as mlx-lm reads them)."""
    spec = CHAT_FAMILIES[family]
    vocab = write_chat_tokenizer(out, family)
    config = llama_config(hidden=64, intermediate=128, heads=4, kv_heads=2, layers=2, vocab=len(vocab))
    config["bos_token_id"] = vocab[spec["bos"]] if spec["bos"] else None
    config["eos_token_id"] = vocab[spec["eos"]]
    write_model_dir(random_llama(config, seed=seed), config, out)
    (Path(out) / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [vocab[t] for t in spec["eos_tokens"]]}))
    return Path(out)
