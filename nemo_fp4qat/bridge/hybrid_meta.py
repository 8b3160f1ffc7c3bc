"""A hybrid Mamba / attention model provider (Nemotron-H, Nemotron 3) built on the meta device on a machine without
CUDA, for its module names.

megatron-core's hybrid stack needs ``mamba_ssm`` (its ``MambaMixer`` refuses to build without it and takes its gated
norm from it) and Transformer Engine (the recipe's spec, and the stack's final norm), both CUDA packages. Module names
do not depend on either: megatron-core's own local hybrid spec (modelopt's, with ``SequentialMLP`` experts and torch
norms) names every linear layer as the recipe's Transformer Engine spec does (``mixer.in_proj`` / ``out_proj``,
``self_attention.linear_qkv`` / ``linear_proj``, ``mlp.router``, ``mlp.experts.local_experts.N.linear_fc1``,
``mlp.shared_experts.*``; Transformer Engine fuses the norms into ``in_proj`` / ``linear_qkv`` under the same names).
:func:`mamba_meta_build` is explicit, opt-in and inert where CUDA is available.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from ..megatron_cpu import patched

__all__ = ["GatedNormShape", "local_hybrid_spec", "mamba_meta_build"]


class GatedNormShape(nn.Module):
    """The parameters of ``mamba_ssm``'s gated RMS norm (``weight``, no bias), for a model that is never run."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device: Any = None, dtype: Any = None) -> None:  # fmt: skip
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)


def local_hybrid_spec() -> Any:
    """megatron-core's local hybrid stack spec (modelopt's: column / row parallel linears, ``SequentialMLP``
    experts, local attention) with torch norms where it asks Transformer Engine for them."""
    from megatron.core.post_training.modelopt.hybrid.model_specs import get_hybrid_stack_modelopt_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = get_hybrid_stack_modelopt_spec(local_core_attention=True, remap_te_layernorm=False)
    layers = spec.submodules
    layers.mamba_layer.submodules.norm = WrappedTorchNorm
    for name in ("attention_layer", "gdn_layer", "dsa_layer"):
        getattr(layers, name).submodules.input_layernorm = WrappedTorchNorm
    layers.gdn_layer.submodules.self_attention.submodules.out_norm = WrappedTorchNorm
    layers.mlp_layer.submodules.pre_mlp_layernorm = WrappedTorchNorm
    layers.moe_layer.submodules.pre_mlp_layernorm = WrappedTorchNorm
    for mtp in layers.mtp_block_spec.submodules.layer_specs:
        mtp.submodules.enorm = mtp.submodules.hnorm = mtp.submodules.layer_norm = WrappedTorchNorm
    return spec


@contextlib.contextmanager
def mamba_meta_build() -> Iterator[None]:
    """Let megatron-core build Mamba layers on the meta device without ``mamba_ssm`` and the hybrid stack's final
    norm without Transformer Engine (a stand-in of the gated norm's shape; torch's RMS norm); the mixer's explicitly
    placed parameters go to the meta device, and its initialisation's CUDA RNG fork is a no-op. Inert where CUDA is
    available (the real packages build there)."""
    if torch.cuda.is_available():
        yield
        return
    import megatron.core.models.hybrid.hybrid_block as hybrid_block
    import megatron.core.ssm.mamba_mixer as mamba_mixer
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    with contextlib.ExitStack() as stack:
        # the mixer draws its initial values under the CUDA RNG tracker's fork; a meta model draws none
        no_fork = lambda self, name=None: contextlib.nullcontext()  # noqa: E731
        stack.enter_context(patched(mrandom.CudaRNGStatesTracker, "fork", no_fork))
        stack.enter_context(patched(mamba_mixer, "HAVE_MAMBA_SSM", True))
        stack.enter_context(patched(mamba_mixer, "ExtendedRMSNorm", GatedNormShape))
        stack.enter_context(patched(hybrid_block, "TENorm", WrappedTorchNorm))
        stack.enter_context(patched(torch.cuda, "current_device", lambda: torch.device("meta")))
        yield
