"""Tiny random-weight models vLLM can serve on CPU (no download): built with transformers."""

from __future__ import annotations

import json
import os

MODELS = ("llama", "gemma3", "deepseek", "qwen3_next")


def build(kind: str, out_dir: str) -> str:
    """Write a tiny ``kind`` model to ``out_dir`` (once) and return the directory."""
    marker = os.path.join(out_dir, "config.json")
    if os.path.exists(marker):
        return out_dir
    import torch
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        max_position_embeddings=4096,
        initializer_range=0.2,
    )
    if kind == "llama":  # GQA: 4 query heads over 2 KV heads
        model = tf.LlamaForCausalLM(
            tf.LlamaConfig(**common, num_hidden_layers=4, num_key_value_heads=2, head_dim=64)
        )
    elif kind == "gemma3":  # sliding (window 128) and full layers, as Gemma 3 interleaves them
        layer_types = ["sliding_attention"] * 2 + ["full_attention"]
        model = tf.Gemma3ForCausalLM(
            tf.Gemma3TextConfig(
                **common,
                num_hidden_layers=6,
                num_key_value_heads=2,
                head_dim=64,
                sliding_window=128,
                layer_types=layer_types * 2,
            )
        )
    elif (
        kind == "deepseek"
    ):  # MLA: one 576-wide latent per token (the only size the CPU MLA kernels take)
        model = tf.DeepseekV3ForCausalLM(
            tf.DeepseekV3Config(
                **common,
                num_hidden_layers=2,
                num_key_value_heads=4,
                q_lora_rank=None,
                kv_lora_rank=512,
                qk_rope_head_dim=64,
                qk_nope_head_dim=64,
                v_head_dim=64,
                first_k_dense_replace=2,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=128,
            )
        )
    elif kind == "qwen3_next":  # Gated DeltaNet (recurrent state) and full attention alternate
        model = tf.Qwen3NextForCausalLM(
            tf.Qwen3NextConfig(
                **common,
                num_hidden_layers=4,
                num_key_value_heads=2,
                head_dim=64,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=64,
                linear_value_head_dim=64,
                linear_conv_kernel_dim=4,
                layer_types=["linear_attention", "full_attention"] * 2,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=128,
                shared_expert_intermediate_size=128,
                decoder_sparse_step=1,
            )
        )
    else:
        raise ValueError(f"kind: expected one of {MODELS}, got {kind!r}")
    model.to(torch.bfloat16).save_pretrained(out_dir)
    with open(os.path.join(out_dir, "kvgroups_tiny.json"), "w") as f:
        json.dump({"kind": kind}, f)
    return out_dir
