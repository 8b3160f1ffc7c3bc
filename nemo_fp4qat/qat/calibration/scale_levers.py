"""How NVFP4 block scales are set and trained: modelopt's weight-scale calibrations, activation headroom and LSQ.

modelopt >= 0.46 ships the levers; this module names them once and turns a choice into modelopt's own
configuration:

* **weight scales** (``CalibrationConfig.weight_scale``): ``"max"`` (each block's scale from its amax, computed
  from the weights on every forward), ``"mse"`` (per block the least-squared-error scale, with modelopt's FP8
  scale sweep), ``"local_hessian"`` (the same error weighted by the layer input's per-block Hessian),
  ``"four_over_six"`` (per block the better of M = 6 and M = 4, modelopt's ``NVFP4_FOUR_OVER_SIX_CFG``), or
  ``"search"`` (this plugin's own least-error clip, :mod:`nemo_fp4qat.qat.calibration.block_scale_search`). Every
  choice but ``max`` and ``search`` makes NVFP4 weight quantizers *static*: the per-block amax is calibrated once and
kept. * **activation scales** (``CalibrationConfig.act_scale``): ``"max"`` or ``"act_headroom"`` (modelopt's
  ``nvfp4_act_headroom``: the NVFP4 activation global scale anchored at a low percentile of the per-block amax).
* **learned scales** (``QATConfig.learned_scales``, :class:`LearnedScalesConfig`): modelopt's LSQ makes the
  calibrated per-block weight amax a trained parameter: ``"post"`` (the dequantization scale), ``"dual"`` (the
  quantization and dequantization scales, untied), ``"scale_only"`` (``post``, with every other parameter
  frozen), each with its own learning rate (modelopt's recipes: 1e-4 for the amax, 1e-5 for the weights).

A learned quantizer holds two amax tensors (``w_q = Q(w / s_pre) * s_post``), which no checkpoint format
stores; :func:`fold_learned_scales` writes the trained weights as ``w_q`` and the scales as ``s_post`` into a
plain static quantizer, which modelopt's exporters write as ordinary NVFP4 block scales (the same forward,
so validation finds the export equal to what was trained).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from nemo_fp4qat.specs import ConfigError, did_you_mean, optional_spec

__all__ = [
    "ACT_SCALES",
    "LEARNED_SCALE_MODES",
    "WEIGHT_SCALES",
    "LearnedScalesConfig",
    "check_choice",
    "fold_learned_scales",
    "learned_scale_parameters",
    "lever_algorithm",
    "make_weights_static",
    "promote_static",
    "require_levers",
    "restore_lsq",
    "uses_static_weights",
]

WEIGHT_SCALES = ("max", "mse", "local_hessian", "four_over_six", "search")
ACT_SCALES = ("max", "act_headroom")
LEARNED_SCALE_MODES = ("post", "dual", "scale_only")
LEVERS_MODELOPT = "0.46"  # the first modelopt with static NVFP4 weight scales, LSQ and activation headroom

# modelopt's weight-scale calibration for each choice (its presets' settings)
_WEIGHT_ALGORITHMS: dict[str, dict[str, Any]] = {
    "max": {"method": "max"},
    "mse": {"method": "mse", "fp8_scale_sweep": True},
    "local_hessian": {"method": "local_hessian"},
    "four_over_six": {
        "method": "mse",
        "fp8_scale_sweep": False,
        "start_multiplier": 1.0,
        "stop_multiplier": 1.5,
        "step_size": 0.5,
    },
}


def check_choice(value: Any, valid: tuple[str, ...], field: str) -> str:
    """``value`` if it is one of ``valid``, else a :class:`ConfigError` naming the field and the choices."""
    if not isinstance(value, str) or value not in valid:
        raise ConfigError(f"{field}={value!r} is not one of {list(valid)}{did_you_mean(str(value), valid)}.")
    return value


def require_levers(what: str) -> None:
    """Refuse ``what`` (a lever) on a modelopt without it, naming the version that has it."""
    from packaging.version import Version

    from nemo_fp4qat.qat.modelopt_compat import modelopt_version

    if modelopt_version() < Version(LEVERS_MODELOPT):
        raise ConfigError(
            f"{what} needs modelopt >= {LEVERS_MODELOPT} (static NVFP4 weight scales, LSQ, nvfp4_act_headroom); "
            f"modelopt {modelopt_version()} is installed (NeMo 2.7.3 pins 0.37). Install nvidia-modelopt>=0.47 "
            "or leave weight_scale / act_scale at 'max' and learned_scales off."
        )


@dataclass
class LearnedScalesConfig:
    """Learned NVFP4 weight block scales (modelopt's LSQ) during QAT / QAD.

    Attributes:
        mode: ``"post"`` (learn the dequantization amax), ``"dual"`` (learn the quantization and the
            dequantization amax, untied) or ``"scale_only"`` (``post``, every other parameter frozen).
        lr: the learning rate of the amax parameters (their own optimizer parameter group, no weight decay).

    Raises:
        ConfigError: an unknown mode or a learning rate that is not a positive number.

    Example:
        >>> QATConfig(distillation="qad", learned_scales={"mode": "dual", "lr": 1e-4})  # doctest: +SKIP
    """

    mode: str = "post"
    lr: float = 1e-4

    def __post_init__(self) -> None:
        check_choice(self.mode, LEARNED_SCALE_MODES, "learned_scales mode")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ConfigError(f"learned_scales lr must be a positive number (e.g. 1e-4), got {self.lr!r}.")
        self.lr = float(self.lr)

    @property
    def learnable_amax(self) -> list[str]:
        return ["pre", "post"] if self.mode == "dual" else ["post"]

    @classmethod
    def resolve_spec(cls, spec: Any) -> LearnedScalesConfig | None:
        if isinstance(spec, str):
            return None if spec == "off" else cls(mode=spec)
        return optional_spec(cls, spec, "learned_scales", "use 'post', 'dual', 'scale_only', a dict "
                             "{'mode': ..., 'lr': ...} or None (off).")  # fmt: skip


def uses_static_weights(weight_scale: str, act_scale: str, learned: LearnedScalesConfig | None) -> bool:
    """Whether NVFP4 weight quantizers must be static (calibrated per-block amax) for these levers."""
    return weight_scale not in ("max", "search") or act_scale != "max" or learned is not None


def lever_algorithm(weight_scale: str, act_scale: str, learned: LearnedScalesConfig | None) -> dict[str, Any] | None:
    """modelopt's calibration algorithm for the levers (``None``: none of them, the formats' own algorithm)."""
    if not uses_static_weights(weight_scale, act_scale, learned):
        return None
    weights = dict(_WEIGHT_ALGORITHMS["max" if weight_scale == "search" else weight_scale])
    if learned is not None:
        return {"method": "lsq", "scale_algorithm": weights, "learnable_amax": learned.learnable_amax,
                "tied_amax": False}  # fmt: skip
    if act_scale == "act_headroom":
        return {"method": "nvfp4_act_headroom", "weight_scale_algorithm": weights}
    return weights


def _is_nvfp4(cfg: dict[str, Any] | None) -> bool:
    bs = (cfg or {}).get("block_sizes") or {}
    return bs.get("type") == "dynamic" and bs.get("scale_bits") == (4, 3)


def make_weights_static(quant_cfg: Any, four_over_six: bool = False) -> Any:
    """``quant_cfg`` (from :func:`~.modelopt_compat.build_quant_cfg`, list form) with the NVFP4 weight quantizer of
    every NVFP4 (W4A4) layer made static (and Four-Over-Six where asked); other entries unchanged. W4A8 layers
    keep dynamic weight scales (their export convention, :mod:`.w4a8_scaling`)."""
    entries = [e for e in quant_cfg if isinstance(e, dict)]
    inputs = {str(e.get("quantizer_name", ""))[: -len("input_quantizer")]: e.get("cfg") for e in entries
              if str(e.get("quantizer_name", "")).endswith("input_quantizer")}  # fmt: skip
    out = []
    for entry in quant_cfg:
        name = str(entry.get("quantizer_name", "")) if isinstance(entry, dict) else ""
        cfg = entry.get("cfg") if isinstance(entry, dict) else None
        layer = name[: -len("weight_quantizer")]
        if name.endswith("weight_quantizer") and _is_nvfp4(cfg) and _is_nvfp4(inputs.get(layer)):
            bs = {**cfg["block_sizes"], "type": "static"}
            if four_over_six:
                bs["four_over_six"] = True
            entry = {**entry, "cfg": {**cfg, "block_sizes": bs}}
        out.append(entry)
    return out


def _lsq_quantizers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if getattr(m, "_lsq", False)]


def learned_scale_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The learnable amax parameters of ``model``'s LSQ quantizers, in module order."""
    return [p for _, q in _lsq_quantizers(model) for n, p in q.named_parameters(recurse=False) if p.requires_grad]


@torch.no_grad()
def fold_learned_scales(model: nn.Module) -> int:
    """Turn every LSQ weight quantizer of ``model`` into a plain static NVFP4 quantizer with the same forward.

    The layer's weight becomes what the LSQ quantizer made of it (``Q(w / s_pre) * s_post``) and the quantizer's
    per-block amax ``6 * s_post`` (the learned scale as quantized): static fake quant of that weight returns it
    unchanged, so the model computes what it trained, and modelopt's exporters write the trained codes with the
    learned block scales. Returns the number of quantizers folded (0: nothing learned).
    """
    folded = 0
    for name, module in model.named_modules():
        q = getattr(module, "weight_quantizer", None)
        if q is None or not getattr(q, "_lsq", False):
            continue
        weight = module.weight
        trained = q(weight)
        # the block amax whose scale is exactly the learned one, already on the E4M3 grid (clamped, rounded), so the
        # static forward and the exporter's own arithmetic both land on it: a raw learned amax (which may have moved
        # below the smallest scale, or next to an E4M3 rounding boundary) would not
        bound = float(getattr(q, "_quant_max_bound", 6.0))
        post = (q._block_scale_from_amax(q.amax_post.detach(), q._quantize_scales).float() * bound).reshape(
            q.amax_post.shape
        )
        for attr in ("_amax_post", "_amax_pre"):
            if attr in q._parameters:
                del q._parameters[attr]
            elif attr in q._buffers:
                del q._buffers[attr]
        q._lsq = False
        q._learnable_amax = []
        q._tied_amax = False
        q.register_buffer("_amax", post)
        weight.data.copy_(trained.to(weight.dtype))
        again = q(weight)
        if not torch.equal(again, weight):
            raise RuntimeError(
                f"Folding the learned scales of {name} changed its quantized weight ({int((again != weight).sum())} "
                "elements); the export would not hold what was trained."
            )
        folded += 1
    return folded


def promote_static(q: nn.Module) -> nn.Module:
    """Make ``q`` (a weight quantizer configured static NVFP4) modelopt's ``StaticBlockScaleQuantizer`` in place,
    as its calibration does, so a checkpoint's per-block ``_amax`` / ``_global_amax`` load into it."""
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import StaticBlockScaleQuantizer

    if not isinstance(q, StaticBlockScaleQuantizer):
        StaticBlockScaleQuantizer.from_tensor_quantizer(q, global_amax=torch.zeros(()))
    elif getattr(q, "_global_amax", None) is None:
        q.global_amax = torch.zeros(())
    return q


def restore_lsq(q: nn.Module, saved_amax: torch.Tensor, learned: LearnedScalesConfig) -> None:
    """Give ``q`` the LSQ parameters a checkpoint holds (values filled by the checkpoint's ``load_state_dict``)."""
    promote_static(q)
    if not isinstance(getattr(q, "_amax", None), torch.Tensor):
        q.register_buffer("_amax", torch.zeros_like(saved_amax))
    q.enable_lsq(quantize_scales=True, learnable_amax=learned.learnable_amax, tied_amax=False, dtype=saved_amax.dtype)
