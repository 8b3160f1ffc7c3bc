"""Tiny random mixture-of-experts causal LMs from transformers' own config classes: every family whose experts
transformers holds fused (transformers 5), built by one shrinking of its config's own fields, so a family a later
transformers adds is covered by adding its name (and, where its config needs them, its own fields)."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

from nemo_fp4qat.architectures import FAMILIES

# the fields a config has are set (by name) to a 2-layer model with 4 experts, top-2, every layer MoE
_SHRINK = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=32, first_k_dense_replace=0,
    max_position_embeddings=128, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=16, n_group=1, topk_group=1, decoder_sparse_step=1, mlp_only_layers=[], moe_layer_freq=1,
    tie_word_embeddings=False,
)  # fmt: skip
# families whose experts are fused in transformers 5's standard layout ([experts, out, in] gate_up_proj and
# down_proj): those the family table (nemo_fp4qat/architectures.py) carries through test_fused_experts.py, with the
# fields of their own a tiny model needs
_OWN_FIELDS: dict[str, dict] = {
    "FlexOlmo": dict(pad_token_id=1, bos_token_id=2, eos_token_id=3),  # its defaults lie outside a small vocabulary
    "Lfm2Moe": dict(layer_types=["full_attention", "conv"], num_dense_layers=0),  # short convolutions beside attention
    "DeepseekV3": dict(head_dim=8),  # its rotary embedding spans head_dim, which MLA sets to qk_rope_head_dim
    # multi-head latent attention gives every head its own keys: as many key heads as query heads
    "DeepseekV32": dict(num_key_value_heads=4, index_n_heads=2, index_head_dim=16),
    "GlmMoeDsa": dict(num_key_value_heads=4, index_n_heads=2, index_head_dim=16),
    "Zaya": dict(num_experts_per_tok=1),  # its router picks one expert
    "Gemma4": dict(enable_moe_block=True, top_k_experts=2, hidden_size_per_layer_input=0, global_head_dim=16),
    "MiniMaxM3VL": dict(
        bos_token_id=1,
        eos_token_id=2,
        shared_intermediate_size=32,
        dense_intermediate_size=64,
        layer_types=["minimax_m3_sparse", "full_attention"],
        index_n_heads=2,
        index_head_dim=16,
        index_block_size=4,
        index_topk_blocks=2,
    ),
    "Inkling": dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16),
    "AriaText": dict(moe_num_experts=4, moe_num_shared_experts=1),
    "LongcatFlash": dict(
        num_layers=2, ffn_hidden_size=64, expert_ffn_hidden_size=32, zero_expert_num=0, moe_topk=2, head_dim=8
    ),
    "Dbrx": dict(
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=128,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(hidden_size=64, ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
    ),
}
# families whose causal LM is the text half of a multimodal model: (config class, causal LM class)
_CLASSES = {
    "Gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "MiniMaxM3VL": ("MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM"),
    "Inkling": ("InklingTextConfig", "InklingForCausalLM"),
}
_TESTED = [f for f in FAMILIES if "tests/lightning/test_fused_experts.py" in f.tests]
FUSED_MOE: dict[str, dict] = {c: _OWN_FIELDS.get(c, {}) for f in _TESTED if not f.refused for c in f.classes}
# the families the table refuses by name at prepare (gpt-oss: tests/lightning/test_gpt_oss.py)
OTHER_LAYOUT_MOE: dict[str, dict] = {c: _OWN_FIELDS.get(c, {}) for f in _TESTED if f.refused for c in f.classes}


def build(family: str, table: dict[str, dict] = FUSED_MOE) -> torch.nn.Module:
    """A tiny random ``<family>ForCausalLM`` (its config names its architecture, as a hub checkpoint's does)."""
    config_name, model_name = _CLASSES.get(family, (f"{family}Config", f"{family}ForCausalLM"))
    config_class = getattr(transformers, config_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    fields = config_class().to_dict()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_class(**{**{k: v for k, v in _SHRINK.items() if k in fields}, **table[family]})
        model = getattr(transformers, model_name)(config)
    model.config.architectures = [type(model).__name__]
    return model
