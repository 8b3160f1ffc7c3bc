"""Helpers to build a tiny megatron-core GPTModel on the CPU (nemo env only)."""

from __future__ import annotations

import os
import socket

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process_parallel() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def tiny_gpt(vocab: int = 96, hidden: int = 64, layers: int = 2, seed: int = 0, llama: bool = False):
    """A tiny megatron-core GPTModel; ``llama``: NeMo's Llama layout (gated SiLU MLP, RMSNorm, 2 query groups
    for 4 heads), whose qkv rows and fc1 halves the exporters reorder."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **(dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
                num_query_groups=2, add_bias_linear=False) if llama else {}),
    )  # fmt: skip
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab,
        max_sequence_length=64,
        position_embedding_type="rope",
    )


def gpt_inputs(tokens: torch.Tensor):
    b, t = tokens.shape
    pos = torch.arange(t).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1).view(1, 1, t, t)
    return tokens, pos, mask


def nemo_is_qnemo_checkpoint():
    """NeMo's own ``is_qnemo_checkpoint``, loaded from its file: the package ``__init__`` imports
    tensorrt_llm (not installable on CPU machines), the function itself does not need it."""
    import importlib.util
    from pathlib import Path

    import nemo.export

    path = Path(nemo.export.__file__).parent / "trt_llm" / "qnemo" / "utils.py"
    spec = importlib.util.spec_from_file_location("nemo_qnemo_utils", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.is_qnemo_checkpoint


MOE_EXPERTS = 4


def tiny_moe_gpt(ep: int = 1, seed: int = 0, shared: bool = True):
    """A tiny megatron-core MoE GPT (local spec, SequentialMLP experts, 4 experts top-2, alltoall dispatcher, a shared
    expert, Llama layout) for expert-parallel size ``ep``: each rank builds ``4 / ep`` local experts."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=MOE_EXPERTS, moe_ffn_hidden_size=64, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_load_balancing_type="none",
        expert_model_parallel_size=ep, **({"moe_shared_expert_intermediate_size": 32} if shared else {}),
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(num_experts=MOE_EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm")
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=96, max_sequence_length=64,
                    position_embedding_type="rope")  # fmt: skip


def expert_rank_state(full: dict, rank: int, ep: int) -> dict:
    """The state dict an expert-parallel rank holds, cut from the one-rank model's: global expert ``rank * n + i`` as
    ``local_experts.i`` (``n = experts / ep``), everything else whole."""
    from nemo_fp4qat.qat.parallel.groups import local_expert_name

    per = MOE_EXPERTS // ep
    out = {}
    for key, value in full.items():
        local = local_expert_name(key, rank * per, per)
        if local is not None:
            out[local] = value
    return out
