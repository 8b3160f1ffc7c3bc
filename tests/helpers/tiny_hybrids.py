"""Tiny random hybrid Mamba / linear-attention models from transformers' own config classes, one entry per family: a
family a later transformers adds is covered by adding its entry; a family this transformers lacks is skipped by
name."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=64)  # fmt: skip
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16)
# family -> its config's own fields for a 4-layer model whose layers 1 and 3 hold attention (where it has any)
HYBRIDS: dict[str, dict] = {
    "Jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
    "Bamba": dict(attn_layer_indices=[1, 3], **_MAMBA2),
    "FalconH1": dict(head_dim=16, mamba_d_ssm=128, mamba_expand=2, **_MAMBA2),  # Mamba beside attention, every layer
    "Mamba": dict(state_size=8, expand=2),
    "Mamba2": dict(num_heads=4, head_dim=32, state_size=8, n_groups=1, chunk_size=16, expand=2),
    "Zamba2": dict(mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, num_mem_blocks=1, hybrid_layer_ids=[1, 3],
                   layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], attention_head_dim=32),
    "Zamba": dict(use_mamba_kernels=False, num_hidden_layers=5, attn_layer_period=2, attn_layer_offset=1,
                  mamba_d_state=8, n_mamba_heads=2, mamba_dt_rank=8, attention_head_dim=16),  # 2 shared attentions
    "OlmoHybrid": dict(layer_types=["linear_attention", "full_attention"] * 2, pad_token_id=1, bos_token_id=2,
                       eos_token_id=3),
    "Qwen3Next": dict(layer_types=["linear_attention", "full_attention"] * 2, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, head_dim=16),
    # Qwen3.5 (dense and MoE): gated DeltaNet with in_proj_qkv / in_proj_z
    "Qwen3_5": dict(layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, head_dim=16,
                    pad_token_id=1),
    "Qwen3_5Moe": dict(layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, head_dim=16,
                       pad_token_id=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32),
    "GraniteMoeHybrid": dict(layer_types=["mamba", "attention"] * 2, num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=64, **_MAMBA2),
    # Nemotron 3's shape: Mamba, MoE (fused non-gated experts, a shared expert), attention, MoE
    "NemotronH": dict(hybrid_override_pattern="ME*E", mamba_num_heads=4, mamba_head_dim=32, n_groups=1,
                      ssm_state_size=8, chunk_size=16, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_shared_experts=1),
}  # fmt: skip


def build(family: str) -> torch.nn.Module:
    if not hasattr(transformers, f"{family}Config"):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # a multimodal family's causal LM takes its text config (Qwen3.5)
        config = getattr(transformers, f"{family}TextConfig", None) or getattr(transformers, f"{family}Config")
        cfg = config(**{**_COMMON, **HYBRIDS[family]})
        return getattr(transformers, f"{family}ForCausalLM")(cfg)
