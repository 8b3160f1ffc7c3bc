"""The unquantized weights a float32 run trains, seen at the 16-bit precision its checkpoint will hold them in.

An engine runs 16-bit tensors, so a float32 model's checkpoint for it holds its unquantized tensors (embeddings,
norms, the linears a policy keeps in 16 bits, biases) in float16 or bfloat16 (``ExportConfig.dtype``). Their
rounding is small, but it moves the inputs of the quantized layers, which flips FP4 / FP8 activation codes
downstream: on SmolLM2 in NVFP4 the served perplexity moved by 1-3% against the float32 model that trained
(measured on two machines, by different amounts: which codes flip depends on the machine's float32 arithmetic).
Here every forward of the run sees those weights rounded to the deployment dtype (straight-through: the gradient
reaches the float32 weight unchanged, which keeps its small updates), so the checkpoint holds exactly what trained.
Weights of quantized linears are left to their quantizers. A run in bfloat16 or float16 already trains what it
deploys and needs none of this. PyTorch has no hook for "this parameter as another dtype in every forward" without
renaming it in the state dict (``torch.nn.utils.parametrize`` moves it to ``parametrizations.weight.original``,
which every checkpoint and exporter would then have to know), so the parameter is swapped for its rounded view
around each module's forward and put back after.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["AUTO", "DEPLOY_DTYPES", "DeployPrecision", "refuse_deploy_dtype"]

# deploy_dtype="auto": the end-of-fit export's dtype for a float32 model's unquantized tensors, where it has one
AUTO = "auto"

DEPLOY_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _rounded(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return p + (p.detach().to(dtype).to(p.dtype) - p.detach())


def _held_by_a_quantizer(module: nn.Module, name: str) -> bool:
    q = getattr(module, f"{name}_quantizer", None)
    return bool(getattr(q, "is_enabled", False))


def _owns_weights(module: nn.Module) -> bool:
    """Modules whose forward reads their own parameters: torch's linear, embedding and norms, and any norm module."""
    name = type(module).__name__
    return isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)) or name.endswith(("RMSNorm", "LayerNorm"))


class DeployPrecision:
    """Forward hooks that show a float32 model's unquantized weights rounded to ``dtype``.

    Args:
        dtype: ``"float16"`` or ``"bfloat16"`` (the export's dtype for the unquantized tensors).

    Raises:
        ValueError: another dtype.

    Example:
        >>> hooks = DeployPrecision("float16"); hooks.install(model)  # doctest: +SKIP
        >>> ...  # train, export
        >>> hooks.remove()  # doctest: +SKIP
    """

    def __init__(self, dtype: str) -> None:
        if dtype not in DEPLOY_DTYPES:
            raise ValueError(
                f"deploy_dtype={dtype!r}: use one of {sorted(DEPLOY_DTYPES)} (the dtype the export writes the "
                "unquantized tensors in), or None to train them in the model's own dtype."
            )
        self.dtype = DEPLOY_DTYPES[dtype]
        self.handles: list[Any] = []

    def install(self, model: nn.Module) -> int:
        """Hook every module of ``model`` that holds float32 weights of its own; returns how many."""
        self.remove()
        for module in model.modules():
            if _owns_weights(module) and any(p.dtype == torch.float32 for p in module.parameters(recurse=False)):
                self.handles.append(module.register_forward_pre_hook(self._swap_in))
                self.handles.append(module.register_forward_hook(self._swap_back, always_call=True))
        return len(self.handles) // 2

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _swap_in(self, module: nn.Module, args: Any) -> None:
        saved = {}
        for name, p in module._parameters.items():
            if p is None or p.dtype != torch.float32 or _held_by_a_quantizer(module, name):
                continue
            saved[name] = p
            module._parameters[name] = _rounded(p, self.dtype)  # type: ignore[assignment]
        module.__dict__["_nemo_fp4qat_deploy_saved"] = saved

    @staticmethod
    def _swap_back(module: nn.Module, args: Any, output: Any) -> None:
        for name, p in module.__dict__.pop("_nemo_fp4qat_deploy_saved", {}).items():
            module._parameters[name] = p


def refuse_deploy_dtype(deploy_dtype: str | None) -> None:
    """The megatron-core front ends (NeMo 2, Megatron-Bridge) train in bfloat16 on GPUs, which deploys as trained;
    their parallel linears and embeddings are not hooked here, so a float32 run's ``deploy_dtype`` is refused there.

    Raises:
        ValueError: ``deploy_dtype`` set.
    """
    if deploy_dtype not in (None, AUTO):
        raise ValueError(
            f"deploy_dtype={deploy_dtype!r} on a megatron-core model (NeMo 2 / Megatron-Bridge): not supported (its "
            "parallel linears and embeddings are not covered). Train in bfloat16 (what the engines run, so the "
            "checkpoint holds what trained), or set deploy_dtype=None."
        )
