"""Tiny transformers MoE models of every family the integration supports, built with ``from_config``
(2 layers, d 64, E 8, K 2): the configurations shared by tests/test_hf.py and tests/test_hf_router.py."""

from __future__ import annotations

import torch

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=64, head_dim=16, initializer_range=0.1, tie_word_embeddings=False)
_DEEPSEEK_ATTN = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, head_dim=8, qk_nope_head_dim=16,
                      v_head_dim=16, num_key_value_heads=4)
# family -> config overrides. DeepSeek-V3 and GLM-4-MoE: group-limited top-k, correction bias, scaling.
FAMILIES: dict[str, dict] = {
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2_moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                      num_experts_per_tok=2, intermediate_size=96),
    "qwen3_next": dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                       num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"],
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16),
    "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "granitemoe": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(moe_intermediate_size=32, intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=0,
                        routed_scaling_factor=2.5, **_DEEPSEEK_ATTN),
    "glm4_moe": dict(moe_intermediate_size=32, intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2,
                     n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=0,
                     routed_scaling_factor=1.5),
    "ernie4_5_moe": dict(moe_intermediate_size=32, intermediate_size=96, moe_num_experts=8, moe_k=2,
                         moe_num_shared_experts=1, moe_layer_start_index=0),
    "gpt_oss": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"]),
    # squared ReLU, non-gated, with a shared expert; an MoE block then attention (no Mamba block: its kernels)
    "nemotron_h": dict(layers_block_type=["moe", "full_attention"], n_routed_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_shared_experts=1,
                       intermediate_size=96, use_mamba_kernels=False, mtp_layers_block_type=[]),
    # GeGLU with tanh GELU (gelu_pytorch_tanh), the MoE block beside a dense MLP
    "gemma4_text": dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                        intermediate_size=96, layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                        hidden_size_per_layer_input=16, vocab_size_per_layer_input=128, per_layer_config={}),
}
# GraniteMoE's model does not collect router logits in transformers 5.17 (its aux loss is then the int 0).
NO_ROUTER_LOGITS = ("granitemoe",)


def tiny_config(family: str, **overrides):
    """A 2-layer, d 64, E 8, K 2 config of ``family`` (a transformers ``model_type``)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **overrides})


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """``AutoModelForCausalLM.from_config`` of :func:`tiny_config` (with config ``overrides``), in ``dtype``,
    with random (non-zero) score-correction biases where the router has them, so that selection-only
    biases are exercised."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).to(dtype)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand_like(buf) * 0.1)
    return model
