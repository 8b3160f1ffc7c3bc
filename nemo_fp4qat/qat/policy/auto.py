"""A layer policy chosen by modelopt's AutoQuantize: per-layer sensitivity, formats searched under a bits budget.

:func:`auto_policy` runs ``mtq.auto_quantize`` (gradient sensitivity scores and modelopt's search) on a copy of
the model over the TensorRT-LLM-deployable formats asked for, with embeddings, the output layer, norms and routers
kept in full precision as in every preset, and turns the formats modelopt chose into a :class:`LayerPolicy` (one
rule per format, exact module names). modelopt's grouping rules keep fused siblings (q/k/v, gate/up) in one
format, which TensorRT-LLM needs. The policy can be written as YAML (:meth:`LayerPolicy.to_yaml`) so the run
that uses it is reproducible and reviewable; QAT then starts from it like from any preset.
"""

from __future__ import annotations

import copy
import fnmatch
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from nemo_fp4qat.qat.policy.rules import LayerPolicy, PolicyRule, is_quantizable_linear
from nemo_fp4qat.specs import ConfigError

__all__ = ["AUTO_FORMATS", "auto_policy"]

log = logging.getLogger("nemo_fp4qat")

# plugin format name -> (modelopt config name, the policy rule's weight and input formats)
AUTO_FORMATS: dict[str, tuple[str, str, str]] = {
    "nvfp4": ("NVFP4_DEFAULT_CFG", "nvfp4", "same"),
    "fp8": ("FP8_DEFAULT_CFG", "fp8", "same"),
    "nvfp4_w4a8": ("W4A8_NVFP4_FP8_CFG", "nvfp4", "fp8"),
}


def _hf_forward(model: nn.Module, batch: Any) -> Any:
    ids = batch["input_ids"] if isinstance(batch, dict) else batch
    return model(input_ids=ids, labels=batch.get("labels", ids) if isinstance(batch, dict) else ids)


def _hf_loss(output: Any, batch: Any) -> torch.Tensor:
    return output.loss


def _chosen(module: nn.Module) -> str | None:
    """The plugin format modelopt's search left on one linear layer (None: not quantized)."""
    wq, iq = getattr(module, "weight_quantizer", None), getattr(module, "input_quantizer", None)
    if wq is None or not wq.is_enabled:
        return None
    w_bits = tuple(wq.num_bits) if isinstance(wq.num_bits, (tuple, list)) else wq.num_bits
    i_bits = tuple(iq.num_bits) if iq is not None and isinstance(iq.num_bits, (tuple, list)) else None
    if w_bits == (4, 3):
        return "fp8"
    if w_bits == (2, 1):
        return "nvfp4_w4a8" if i_bits == (4, 3) else "nvfp4"
    raise RuntimeError(f"auto_quantize left weight num_bits={wq.num_bits} on a layer, which no asked format has")


def _names(modules: list[str]) -> list[str]:
    """Globs for exactly these modules, also when the model is wrapped (a LightningModule's ``net.``...)."""
    return [p for m in modules for p in (m, f"*.{m}")]


def auto_policy(
    model: nn.Module,
    batches: Iterable[Any],
    effective_bits: float,
    formats: tuple[str, ...] | list[str] = ("nvfp4", "fp8"),
    forward_fn: Callable[[nn.Module, Any], Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    name: str = "auto",
) -> LayerPolicy:
    """A :class:`LayerPolicy` whose per-layer formats modelopt's ``auto_quantize`` chose under a bits budget.

    Args:
        model: the full-precision model (left unchanged: the search runs on a copy).
        batches: a few batches of the training data (each used to calibrate and to score every candidate).
        effective_bits: the budget, in modelopt's effective bits per linear weight (NVFP4 4.5 with its scales,
            4.0 in modelopt 0.37; FP8 8.0; NVFP4 weights with FP8 activations 4.0 by modelopt's count; 16 for a
            layer left in full precision); the output layer counts at 16 bits, so the lowest reachable budget
            depends on its size.
        formats: the candidates, from :data:`AUTO_FORMATS` (all of them deployable by TensorRT-LLM).
        forward_fn: ``forward_fn(model, batch)`` -> output (default: a Hugging Face causal LM on ``input_ids``,
            labels the same ids).
        loss_fn: ``loss_fn(output, batch)`` -> the scalar loss whose gradients score sensitivity (default:
            ``output.loss``).
        name: the policy's name (in logs, reports and the YAML).

    Returns:
        The policy: routers (their own group) and embeddings / output / norms in full precision, then one rule per
        chosen format.

    Raises:
        ConfigError: an unknown format, one this modelopt version has no config for, or a budget outside
            (4, 16).

    Example:
        >>> policy = auto_policy(model, batches[:8], effective_bits=6.0, formats=("nvfp4", "fp8"))
        >>> policy.to_yaml("runs/auto_policy.yaml")
        >>> FP4QATCallback(QATConfig(policy="runs/auto_policy.yaml"))  # doctest: +SKIP
    """
    import modelopt
    import modelopt.torch.quantization as mtq

    unknown = [f for f in formats if f not in AUTO_FORMATS]
    if unknown or not formats:
        raise ConfigError(f"auto_policy formats {unknown or formats}: choose from {sorted(AUTO_FORMATS)}.")
    missing = [AUTO_FORMATS[f][0] for f in formats if not hasattr(mtq, AUTO_FORMATS[f][0])]
    if missing:
        raise ConfigError(
            f"modelopt {modelopt.__version__} has no {missing}: drop those formats from auto_policy, or use a "
            "modelopt version that has them (0.47 has all three)."
        )
    if not 4.0 < float(effective_bits) < 16.0:
        raise ConfigError(f"effective_bits={effective_bits}: the budget must lie between 4 and 16 bits per weight.")
    batches = list(batches)
    if not batches:
        raise ConfigError("auto_policy needs at least one batch to calibrate and score the formats on.")
    # routers, embeddings, output layer, norms: full precision (the default preset's first two rules)
    router, embed = LayerPolicy.preset("default").rules[:2]
    keep = PolicyRule(patterns=router.patterns + embed.patterns, weight=None, group=embed.group)
    work = copy.deepcopy(model).train()  # a copy: the caller's model keeps its mode and weights
    try:
        search = mtq.auto_quantize(
            work,
            constraints={"effective_bits": float(effective_bits)},
            quantization_formats=[getattr(mtq, AUTO_FORMATS[f][0]) for f in formats],
            data_loader=batches,
            forward_step=forward_fn or _hf_forward,
            loss_func=loss_fn or _hf_loss,
            disabled_layers=list(keep.patterns),
            num_calib_steps=len(batches),
            num_score_steps=len(batches),
            verbose=False,
        )
    except ValueError as e:  # modelopt 0.47 refuses an infeasible budget before searching
        if "infeasible" not in str(e):
            raise
        raise ConfigError(f"effective_bits={effective_bits} is below what these formats reach: {e}") from e
    best = search[1].get("best", {}) if isinstance(search, tuple) and isinstance(search[1], dict) else {}
    if not best.get("is_satisfied", True):  # modelopt 0.37 searches anyway and only warns
        raise ConfigError(
            f"effective_bits={effective_bits} is below what these formats reach (modelopt found no solution "
            f"within it; best {best.get('constraints')}): raise the budget or add a cheaper format."
        )
    chosen: dict[str, list[str]] = {}
    for mod_name, m in work.named_modules():
        kept = any(fnmatch.fnmatch(mod_name, p) for p in keep.patterns)  # the first rule holds them already
        if mod_name and not kept and is_quantizable_linear(m) and hasattr(m, "weight_quantizer"):
            fmt = _chosen(m)
            chosen.setdefault(fmt or "bf16", []).append(mod_name)
    del work, search
    # the routers in their own group, as in the presets (a schedule offset or a rollback names it)
    rules = [PolicyRule(patterns=list(router.patterns), weight=None, group=router.group, optional=True),
             PolicyRule(patterns=list(embed.patterns), weight=None, group=embed.group)]  # fmt: skip
    for fmt in formats:
        if chosen.get(fmt):
            _, weight, inp = AUTO_FORMATS[fmt]
            rules.append(PolicyRule(patterns=_names(chosen[fmt]), weight=weight, input=inp, group=f"auto_{fmt}"))
    if chosen.get("bf16"):
        rules.append(PolicyRule(patterns=_names(chosen["bf16"]), weight=None, group="auto_bf16"))
    log.info("nemo_fp4qat: auto_policy at %.2f effective bits: %s", effective_bits,
             ", ".join(f"{k} {len(v)}" for k, v in sorted(chosen.items())))  # fmt: skip
    return LayerPolicy(rules=rules, default=None, name=name, runtime="trtllm")
