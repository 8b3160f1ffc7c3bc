"""A real-weights mixture-of-experts model from the embedded dense one: sparse upcycling.

Sparse upcycling (Komatsuzaki et al., 2023) turns a dense transformer into a MoE by copying each MLP into every
expert and adding a router; it is how several production MoEs started. transformers' Mixtral is Llama's attention
with a sparse MoE block (``block_sparse_moe``: a linear router, experts ``w1`` gate / ``w3`` up / ``w2`` down, top-k
weights renormalized to sum to one), so the embedded SmolLM2 (a Llama) upcycles into it without other changes: with
identical experts the MoE computes exactly what the dense model computes, whatever the router picks. ``noise`` makes
the experts differ from each other (a relative Gaussian perturbation per expert) so routing matters, as it does in a
trained MoE.

No library does this for transformers models (megatron-core's upcycling works on its own checkpoints), hence here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..transformers_compat import rope_fields

__all__ = ["upcycle_llama_to_mixtral"]


def upcycle_llama_to_mixtral(
    dense: nn.Module, num_experts: int = 4, top_k: int = 2, noise: float = 0.0, seed: int = 0
) -> nn.Module:
    """A ``MixtralForCausalLM`` whose every layer's experts are copies of the dense Llama layer's MLP.

    Args:
        dense: a ``LlamaForCausalLM`` (e.g. :func:`nemo_fp4qat.demo.model.load_smollm2`'s); not changed.
        num_experts: routed experts per layer.
        top_k: experts each token goes to.
        noise: each expert's weights times ``1 + noise * N(0, 1)`` elementwise (0: exact copies).
        seed: for the router's initialisation and the noise.

    Raises:
        ValueError: ``dense`` is not a Llama-architecture causal LM, or ``top_k`` is not in ``[1, num_experts]``.

    Example:
        >>> moe = upcycle_llama_to_mixtral(load_smollm2()[0], num_experts=4, top_k=2, noise=0.01)  # doctest: +SKIP
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg: Any = getattr(dense, "config", None)
    if getattr(cfg, "model_type", None) != "llama":
        raise ValueError(
            f"upcycling takes a Llama causal LM (model_type 'llama'), got {getattr(cfg, 'model_type', None)!r}"
        )
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must lie in [1, num_experts={num_experts}]")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise ValueError("upcycling into Mixtral needs a Llama without attention or MLP biases (Mixtral has none)")
    moe_cfg = MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=getattr(cfg, "head_dim", None),
        hidden_act=cfg.hidden_act, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, num_local_experts=num_experts,
        num_experts_per_tok=top_k, sliding_window=None, router_aux_loss_coef=0.0, output_router_logits=False,
        **rope_fields(getattr(cfg, "rope_theta", 10000.0), cfg),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    dtype = next(dense.parameters()).dtype
    moe = MixtralForCausalLM(moe_cfg).to(dtype).eval()
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    missing, unexpected = moe.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    std = float(getattr(cfg, "initializer_range", 0.02))
    with torch.no_grad():
        for layer, dense_layer in zip(moe.model.layers, dense.model.layers, strict=True):
            # transformers 4: block_sparse_moe with per-expert w1 / w3 / w2 linears; 5: mlp with fused experts
            block, mlp = getattr(layer, "block_sparse_moe", None) or layer.mlp, dense_layer.mlp
            block.gate.weight.copy_(std * torch.randn(block.gate.weight.shape, generator=gen).to(dtype))
            for e in range(num_experts):
                gate, up, down = (
                    (src.weight.float() * (1.0 + noise * torch.randn(src.weight.shape, generator=gen))).to(dtype)
                    if noise else src.weight.to(dtype)
                    for src in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
                )  # fmt: skip
                if isinstance(block.experts, nn.ModuleList):
                    expert = block.experts[e]
                    expert.w1.weight.copy_(gate), expert.w3.weight.copy_(up), expert.w2.weight.copy_(down)
                else:  # [gate; up] rows of gate_up_proj[e], as the fused experts split them
                    block.experts.gate_up_proj[e].copy_(torch.cat([gate, up], 0))
                    block.experts.down_proj[e].copy_(down)
    left = {k for k in missing if ".block_sparse_moe." not in k and ".mlp." not in k and k != "lm_head.weight"}
    if left:
        raise RuntimeError(f"upcycling left these weights at their initialisation: {sorted(left)[:4]}")
    if moe_cfg.tie_word_embeddings:
        moe.tie_weights()
    return moe
