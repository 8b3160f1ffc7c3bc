"""A recipe's layer policy checked against its model's module names, without building the model.

A Megatron-Bridge recipe at a cluster shape (Llama-3-70B at TP 8 x PP 4) cannot be built on one machine, but the
names its layers take do not depend on the shape or the depth: a two-layer copy of the recipe's model provider,
built on the meta device (no memory) at tensor and pipeline size 1, has the same module names per layer. The
policy resolved against it shows which format every layer of the real run gets.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
from typing import Any

import torch

from ..megatron_cpu import patched
from ..qat.policy.rules import LayerPolicy, PolicyTable

__all__ = ["describe_run", "experts_as_one_row", "is_hybrid", "launch", "plan_substitutions", "policy_plan"]

_GPU_FUSIONS = (
    "apply_rope_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",
    "gradient_accumulation_fusion",
)


def _one_process_group() -> None:
    """torch.distributed and megatron-core's parallel state for one process (gloo), unless already set up."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)


def policy_plan(provider: Any, policy: str | dict | LayerPolicy, num_layers: int = 2) -> PolicyTable:
    """The layer policy resolved against the module names of the model ``provider`` builds.

    Args:
        provider: a Megatron-Bridge model provider (``cfg.model`` of a recipe); it is not changed.
        policy: a preset name, a policy dict or YAML path, or a :class:`~nemo_fp4qat.LayerPolicy`.
        num_layers: how many transformer layers the copy has (every layer is named alike); a hybrid model is built
            at its full layer pattern (which Mamba layer feeds an attention layer depends on it).

    The copy is built on the meta device at tensor, pipeline and expert size 1 with megatron-core's local layer spec
    (Transformer Engine's layers, which need a GPU, name their linear layers alike; a hybrid model's Mamba layers
    through :mod:`.hybrid_meta`), in a one-process group when torch.distributed is not initialized (call it from a
    dry run, not inside a training run); :func:`plan_substitutions` says what it builds otherwise than the recipe.

    Raises:
        ConfigError: the provider builds grouped experts (``moe_grouped_gemm=True``) that ``policy`` would quantize.
    """
    from .callback import refuse_grouped_gemm

    policy = LayerPolicy.resolve_spec(policy)
    refuse_grouped_gemm(provider, policy)
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnBackend

    _one_process_group()
    small = copy.copy(provider)
    hybrid = is_hybrid(provider)
    if hybrid:
        # every layer of the pattern (which layer feeds an attention layer depends on it), on the meta device
        from .hybrid_meta import local_hybrid_spec

        small.hybrid_stack_spec = local_hybrid_spec()
        small.vocab_size = small.vocab_size or 128  # set from the tokenizer at run time; the names do not depend on it
    else:
        small.num_layers = num_layers
        small.transformer_layer_spec = local_layer_spec
    small.tensor_model_parallel_size = small.pipeline_model_parallel_size = small.context_parallel_size = 1
    small.virtual_pipeline_model_parallel_size = None
    small.pipeline_model_parallel_layout = None
    small.num_layers_in_first_pipeline_stage = small.num_layers_in_last_pipeline_stage = None
    small.sequence_parallel = False
    small.init_model_with_meta_device = True
    small.use_cpu_initialization, small.perform_initialization = True, False  # no GPU, no weights to draw
    small.transformer_impl = "local"
    for fused in _GPU_FUSIONS:  # fused kernels the recipe turns on for GPUs; module names do not depend on them
        setattr(small, fused, False)
    if getattr(small, "num_moe_experts", None):
        # every expert on the one process, in the local spec's SequentialMLP (one linear per expert and projection,
        # the names modelopt quantizes), dispatched without Transformer Engine's fused permutation or router
        small.expert_model_parallel_size, small.expert_tensor_parallel_size = 1, None
        small.moe_grouped_gemm = small.moe_permute_fusion = small.moe_router_fusion = False
        small.moe_token_dispatcher_type = "alltoall"
        small.moe_shared_expert_overlap = False
        if hasattr(small, "moe_flex_dispatcher_backend"):
            small.moe_flex_dispatcher_backend = None
    small.attention_backend = AttnBackend.local
    small.cuda_graph_impl = "none"
    small.tp_comm_overlap = False
    small.finalize()
    small._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    with contextlib.ExitStack() as stack:
        if not torch.cuda.is_available():
            # the alltoall token dispatcher creates a CUDA stream when first built; a meta model never uses it
            from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

            stack.enter_context(patched(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object()))
        if hybrid:
            from .hybrid_meta import mamba_meta_build

            stack.enter_context(mamba_meta_build())
            stack.enter_context(torch.device("meta"))  # the hybrid provider does not open it itself
        model = small.provide(pre_process=True, post_process=True)
    return policy.resolve(model)


def is_hybrid(provider: Any) -> bool:
    """A hybrid Mamba / attention provider (Nemotron-H, Nemotron 3: ``HybridModelProvider``), by its layer pattern."""
    return bool(getattr(provider, "hybrid_layer_pattern", None) or getattr(provider, "hybrid_override_pattern", None))


def plan_substitutions(provider: Any) -> list[str]:
    """What :func:`policy_plan` builds otherwise than ``provider`` would on GPUs, and why the names still hold."""
    out = []
    impl = getattr(provider, "transformer_impl", None)
    if impl and impl != "local":
        out.append(f"transformer_impl={impl!r} built as megatron-core's local spec: Transformer Engine needs a GPU "
                   "(its linear layers take the same names)")  # fmt: skip
    if getattr(provider, "num_moe_experts", None) and getattr(provider, "moe_grouped_gemm", False) and impl != "local":
        out.append("moe_grouped_gemm=True (TEGroupedMLP experts, kept in 16 bits by the policy) built as "
                   "SequentialMLP: Transformer Engine needs a GPU; the plan shows each expert's linears")  # fmt: skip
    if is_hybrid(provider):
        out.append("Mamba layers built with megatron-core's local hybrid spec and a stand-in of mamba_ssm's gated norm "
                   "(mamba_ssm and Transformer Engine are CUDA packages): every linear layer takes the recipe's name; "
                   "the depthwise conv1d is a parameter of the mixer, not a layer, and stays in 16 bits")  # fmt: skip
    sizes = {k: getattr(provider, k, None) or 1 for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                          "expert_model_parallel_size")}  # fmt: skip
    if any(v > 1 for v in sizes.values()):
        depth = "every layer of its pattern" if is_hybrid(provider) else "two layers"
        out.append(f"built at tensor, pipeline and expert size 1, {depth}, on the meta device (module names do not "
                   "depend on the parallel shape)")  # fmt: skip
    return out


def describe_run(cfg: Any, qat: Any) -> str:
    """What a recipe turned QAD run will do, as a dry run prints it: the model and its parallel shape (experts and
    expert parallelism for an MoE), where it starts, the training budget, the QAT configuration and every layer's
    format (:func:`policy_plan`). ``cfg``: a Bridge ``ConfigContainer``; ``qat``: its ``FP4QATBridgeCallback``."""
    m = cfg.model
    layers = (f"every one of its {m.num_layers} layers" if is_hybrid(m)
              else f"every one of its {m.num_layers} layers as layer 0 and 1")  # fmt: skip
    moe = getattr(m, "num_moe_experts", None)
    experts = f" experts={moe} top_k={m.moe_router_topk}" if moe else ""
    ep = f" EP={m.expert_model_parallel_size}" if moe else ""
    return "\n".join([
        f"model: {type(m).__name__} layers={m.num_layers} hidden={m.hidden_size}{experts} "
        f"TP={m.tensor_model_parallel_size} PP={m.pipeline_model_parallel_size}{ep} CP={m.context_parallel_size} "
        f"seq={m.seq_length}",
        f"start from: {cfg.checkpoint.pretrained_checkpoint}",
        f"train: {cfg.train.train_iters} iters x {cfg.train.global_batch_size} sequences, lr {cfg.optimizer.lr}",
        f"qat: {qat.config}",
        *(f"planned on this machine: {s}" for s in plan_substitutions(m)),
        f"policy on the model's modules ({layers}; a layer's experts as one row, local_experts.*):",
        experts_as_one_row(policy_plan(m, qat.config.policy)).format_table(),
    ])  # fmt: skip


_LOCAL_EXPERT = re.compile(r"(\.local_experts\.)\d+(\.)")


def experts_as_one_row(table: PolicyTable) -> PolicyTable:
    """``table`` with each layer's routed experts in one row per projection (``mlp.experts.local_experts.*.
    linear_fc1``) where they share a format and rule, as the policy requires of them."""
    rows, seen = [], set()
    for r in table.rows:
        name = _LOCAL_EXPERT.sub(r"\1*\2", r.module)
        key = (name, r.group, r.rule, r.weight, r.input, r.quantizable)
        if key not in seen:
            seen.add(key)
            rows.append(dataclasses.replace(r, module=name))
    return PolicyTable(rows)


def launch(cfg: Any, qat: Any, dryrun: bool = False) -> int:
    """Run a QAD recipe with Bridge's ``pretrain`` (the callback's wrapped GPT forward step), or with ``dryrun`` print
    :func:`describe_run` instead of training. Returns 0 (a script's exit code)."""
    if dryrun:
        print(describe_run(cfg, qat))
        return 0
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    pretrain(cfg, qat.forward_step(forward_step), callbacks=[qat])
    return 0
