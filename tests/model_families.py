"""Tiny random-weight models of the mlx-lm families people serve, built with mlx-lm's own model
classes from their published config shapes, scaled down: hidden 128, 2 layers (one of each
layer kind in the hybrids), 4 experts top-2, a vocabulary of 256 (so token ids read back from
the text of tests/deterministic_fixtures.CharTokenizer).
"""
from __future__ import annotations

import importlib

import mlx.core as mx

HIDDEN, VOCAB = 128, 256
COMMON = {"hidden_size": HIDDEN, "vocab_size": VOCAB, "num_hidden_layers": 2, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 4096, "tie_word_embeddings": False}

CONFIGS = {
    "llama": {"intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2},
    "qwen3": {"intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "rope_theta": 1e6},
    "phi3": {"intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2},
    "gemma3_text": {"intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                    "query_pre_attn_scalar": 32, "sliding_window": 8, "sliding_window_pattern": 2},
    "gpt_oss": {"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]},
    "qwen3_moe": {"intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                  "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "moe_intermediate_size": 64, "rope_theta": 1e6, "norm_topk_prob": True},
    "mixtral": {"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_next": {"intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                   "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
                   "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 4,
                   "num_experts_per_tok": 2, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64,
                   "mlp_only_layers": [], "moe_intermediate_size": 64, "rope_theta": 1e6,
                   "partial_rotary_factor": 0.25, "full_attention_interval": 2},
    "granitemoehybrid": {"intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "attention_bias": False, "embedding_multiplier": 1.0, "attention_multiplier": 0.125,
                         "logits_scaling": 1.0, "residual_multiplier": 1.0, "layer_types": ["mamba", "attention"],
                         "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 128,
                         "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_proj_bias": False, "mamba_d_state": 16,
                         "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True},
    "lfm2": {"num_attention_heads": 4, "num_key_value_heads": 2, "norm_eps": 1e-5, "conv_bias": False,
             "conv_L_cache": 3, "block_dim": HIDDEN, "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False, "block_ff_dim": 256, "layer_types": ["conv", "full_attention"]},
}
FAMILIES = tuple(CONFIGS)


def tiny_family(name: str, seed: int = 0):
    """A tiny random-weight model of family `name` (mlx-lm's own class)."""
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(seed)
    args = module.ModelArgs.from_dict({"model_type": name, **COMMON, **CONFIGS[name]})
    model = module.Model(args)
    mx.eval(model.parameters())
    return model
