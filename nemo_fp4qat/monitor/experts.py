"""Expert load in mixture-of-experts layers: how many tokens each routed expert receives, and which are starved.

A dead or starved expert gets (almost) no gradient, so QAT cannot adapt it to its format, and what it holds is
whatever calibration left. Counted by forward hooks on the routers, for both naming sets: a transformers 4 router is
a linear layer whose logits the MoE block takes the top-k of (``mlp.gate``, ``block_sparse_moe.gate``; k is the
block's ``top_k``); a transformers 5 router returns the experts it picked; megatron-core's ``TopKRouter`` returns its
routing map (tokens x experts) itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..qat.experts.moe import is_router

__all__ = ["ExpertLoad", "expert_load_findings", "starved_experts"]


class ExpertLoad:
    """Token counts per routed expert, per MoE layer, since the last :meth:`reset`.

    Example:
        >>> load = ExpertLoad()
        >>> load.attach(model)  # doctest: +SKIP
        >>> model(batch); load.counts  # doctest: +SKIP
        {'model.layers.0.mlp.gate': tensor([31, 12, 0, 21])}
    """

    def __init__(self) -> None:
        self.counts: dict[str, torch.Tensor] = {}
        self._hooks: list[Any] = []

    def attach(self, model: nn.Module, names: dict[str, str] | None = None) -> int:
        """Hook every router of ``model`` (``names``: module name -> the name to report it under). Returns the count."""
        self.detach()
        modules = dict(model.named_modules())
        routers: dict[str, nn.Module] = {}
        for name, module in modules.items():
            if not is_router(name) or "shared_expert_gate" in name or _inside_router(name):
                continue
            parent_name = name.rpartition(".")[0]
            parent = modules.get(parent_name)
            if parent is not None and type(parent).__name__.endswith("Router"):
                name, module = parent_name, parent  # a projection whose router module (norm, top-k) holds it
            routers[name] = module
        for name, module in routers.items():
            block = modules.get(name.rpartition(".")[0])
            k = getattr(block, "top_k", None) or getattr(module, "top_k", None) or getattr(module, "topk", None)
            experts = getattr(getattr(block, "experts", None), "num_experts", None)
            key = (names or {}).get(name, name)
            self._hooks.append(module.register_forward_hook(self._hook(key, k, experts)))
        return len(self._hooks)

    def _hook(self, key: str, top_k: int | None, num_experts: int | None) -> Any:
        def count(module: nn.Module, args: Any, output: Any) -> None:
            with torch.no_grad():
                if isinstance(output, tuple) and len(output) == 2 and output[1].dtype == torch.bool:
                    chosen = output[1].reshape(-1, output[1].shape[-1]).sum(0)  # megatron-core: the routing map
                elif isinstance(output, tuple) and (picked := _top_k_indices(output)) is not None:
                    # transformers 5's routers return the experts they picked (and their weights, and the logits)
                    picks, weights, classes = picked
                    if num_experts is not None and classes > num_experts and weights is not None:
                        # a router with a "skip" class (Zaya) re-points its skips to expert 0 at weight 0
                        picks = picks[weights.reshape(-1) != 0]
                    chosen = torch.bincount(picks, minlength=num_experts or classes)
                else:
                    logits = output[0] if isinstance(output, tuple) else output
                    logits = logits.reshape(-1, logits.shape[-1])
                    picks = torch.topk(logits.float(), min(int(top_k or 1), logits.shape[-1]), dim=-1).indices
                    chosen = torch.bincount(picks.reshape(-1), minlength=logits.shape[-1])
                chosen = chosen.to("cpu", torch.long)
                self.counts[key] = self.counts[key] + chosen if key in self.counts else chosen

        return count

    def reset(self) -> None:
        self.counts = {}

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def snapshot(self) -> dict[str, list[int]]:
        """The counts as plain lists (for reports and logs)."""
        return {k: [int(x) for x in v] for k, v in sorted(self.counts.items())}

    def summed(self, group: Any = None) -> dict[str, list[int]]:
        """:meth:`snapshot` summed over the ranks of ``group`` (None: every rank), each of which routed its own
        tokens: an expert that no token of this rank reached may have had others' (every rank must call it, with the
        same routers hooked). One collective for all layers, on the device the group's backend reduces on."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1 or not self.counts:
            return self.snapshot()
        names = sorted(self.counts)
        flat = torch.cat([self.counts[n] for n in names])
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        flat = flat.to(device)
        dist.all_reduce(flat, group=group)
        parts = torch.split(flat.cpu(), [len(self.counts[n]) for n in names])
        return {n: [int(x) for x in part] for n, part in zip(names, parts, strict=True)}


def _top_k_indices(output: tuple) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """``(picked expert indices, their weights, number of router classes)`` from a router's output tuple, whichever
    order the family returns them in (``(logits, weights, indices)``; Granite's ``(indices, weights, logits)``)."""
    tensors = [t for t in output if isinstance(t, torch.Tensor)]
    indices = next((t for t in tensors if not t.is_floating_point() and t.dtype != torch.bool), None)
    if indices is None:
        return None
    weights = next((t for t in tensors if t.is_floating_point() and t.shape == indices.shape), None)
    classes = max((t.shape[-1] for t in tensors if t.is_floating_point() and t is not weights), default=0)
    return indices.reshape(-1), weights, int(classes or indices.max().item() + 1)


def _inside_router(name: str) -> bool:
    """A module within a router (a router that is a small MLP, a quantizer a router's linear holds): counted once,
    at the router."""
    parts = name.split(".")
    return any(is_router(".".join(parts[:i])) for i in range(1, len(parts)))


def starved_experts(counts: dict[str, list[int]], min_share: float) -> list[tuple[str, int, int, float]]:
    """``(router, expert, tokens, share of an even load)`` of each expert whose load is below ``min_share`` of an even
    split of its layer's routed tokens (0 tokens: dead)."""
    out = []
    for router, per_expert in counts.items():
        total = sum(per_expert)
        if total == 0:
            continue
        even = total / len(per_expert)
        for expert, tokens in enumerate(per_expert):
            if tokens < min_share * even:
                out.append((router, expert, tokens, tokens / even))
    return out


def expert_load_findings(counts: dict[str, list[int]], min_share: float) -> list[tuple[str, str, str, float, float]]:
    """``(expert, problem, metric, value, threshold)`` for each dead (no token) or starved expert, the expert named
    ``<MoE layer>.experts.<global index>`` after its router (what both monitors report)."""
    out = []
    for router, expert, tokens, share in starved_experts(counts, min_share):
        name = f"{router.rpartition('.')[0]}.experts.{expert}"
        if tokens == 0:
            out.append((name, "dead_expert", "tokens", 0.0, 1.0))
        else:
            out.append((name, "starved_expert", "share_of_even_load", share, min_share))
    return out
