"""Calibration: collect N representative samples, run modelopt's calibration, keep ranks in sync.

modelopt owns the algorithms (``max``, ``smoothquant``, ``awq_lite`` ...); this module decides *what
data* goes through the model (a fixed set of samples taken once and reused for recalibration at
precision-stage switches) and makes data-parallel ranks agree (``all_reduce(MAX)`` of every amax,
since each rank saw different samples).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from nemo_fp4qat.qat.calibration.batches import collect_batches, default_forward, forward_batches
from nemo_fp4qat.qat.calibration.gptq import GPTQConfig, require_gptq
from nemo_fp4qat.qat.calibration.scale_levers import ACT_SCALES, WEIGHT_SCALES, check_choice, require_levers
from nemo_fp4qat.qat.calibration.smoothing import SmoothingConfig
from nemo_fp4qat.qat.experts.moe import split_expert_name
from nemo_fp4qat.qat.parallel.groups import all_reduce_flat, expert_data_parallel_group, same_layers_group
from nemo_fp4qat.qat.policy.rules import is_quantizer
from nemo_fp4qat.specs import ConfigError, from_fields

__all__ = [
    "CalibrationConfig",
    "collect_batches",
    "default_forward",
    "forward_batches",
    "run_calibration",
    "sync_amax_across_ranks",
]


@dataclass
class CalibrationConfig:
    """How to calibrate before QAT (and at each precision switch).

    Attributes:
        num_samples: samples (rows of the batch) to calibrate on; 100-500 is the usual range.
        seq_len: truncate token sequences to this length (``None``: as batched).
        algorithm: modelopt algorithm, or ``"auto"`` to use what the policy's formats need.
        recalibrate_on_switch: re-run calibration for quantizers whose format changed.
        sync_ranks: all-reduce amax (MAX) across data-parallel ranks after calibrating.
        smoothing: fold SmoothQuant factors into the norms / ``up_proj`` rows before the first
            calibration (``True``, an alpha, a dict or a :class:`SmoothingConfig`; ``None``: off).
            A plain-model transform: exports need nothing extra.
        block_scale_search: after each calibration, give every NVFP4 weight block the E4M3 scale of least
            quantization error (``True``, or the lowest scale to try as a fraction of the max rule's, in
            (0, 1); ``True`` is 0.75), weighting each weight's error by its input channel's mean square on the
            calibration batches (the layer output's error), applied by clipping the weights
            (``nemo_fp4qat.qat.calibration.block_scale_search``): exports and runtimes derive the same scales with
            nothing extra.
        weight_scale: how NVFP4 weight block scales are set: ``"max"`` (from each block's amax, every forward),
            ``"mse"``, ``"local_hessian"``, ``"four_over_six"`` (modelopt's calibrations; static block scales) or
            ``"search"`` (this plugin's search, the same as ``block_scale_search=True``). See
            :mod:`nemo_fp4qat.qat.calibration.scale_levers`; all but ``max`` and ``search`` need modelopt >= 0.46.
        act_scale: how NVFP4 activation global scales are set: ``"max"`` or ``"act_headroom"`` (modelopt's
            ``nvfp4_act_headroom``, modelopt >= 0.46).
        gptq: after the first calibration, round every quantized weight with modelopt's GPTQ on the calibration
            batches, on the scales ``weight_scale`` set (``True``, or a dict / :class:`~.gptq.GPTQConfig` with
            ``perc_damp`` and ``block_size``; ``None``: off). Needs modelopt >= 0.47.
    """

    num_samples: int = 128
    seq_len: int | None = None
    algorithm: str | dict[str, Any] | None = "auto"
    recalibrate_on_switch: bool = True
    sync_ranks: bool = True
    smoothing: Any = None
    block_scale_search: bool | float = False
    weight_scale: str = "max"
    act_scale: str = "max"
    gptq: Any = None

    def __post_init__(self) -> None:
        self.smoothing = SmoothingConfig.resolve_spec(self.smoothing)
        self.gptq = GPTQConfig.resolve_spec(self.gptq)
        if self.gptq is not None:
            require_gptq()
            if self.block_scale_search is not False or self.weight_scale == "search":
                raise ConfigError(
                    "calibration gptq and block_scale_search both move NVFP4 weights after calibration; keep one "
                    "(gptq=None, or block_scale_search=False and weight_scale other than 'search')."
                )
        check_choice(self.weight_scale, WEIGHT_SCALES, "calibration weight_scale")
        check_choice(self.act_scale, ACT_SCALES, "calibration act_scale")
        if self.weight_scale == "search" and self.block_scale_search is False:
            self.block_scale_search = True
        if self.block_scale_search is not False and self.weight_scale not in ("max", "search"):
            raise ConfigError(
                f"calibration block_scale_search and weight_scale={self.weight_scale!r} both set NVFP4 weight block "
                "scales; keep one (block_scale_search=False, or weight_scale='search')."
            )
        for field, value in (("weight_scale", self.weight_scale), ("act_scale", self.act_scale)):
            if value not in ("max", "search"):
                require_levers(f"calibration {field}={value!r}")
        bss = self.block_scale_search
        if not isinstance(bss, (bool, int, float)) or (not isinstance(bss, bool) and not 0 < bss < 1):
            raise ValueError(
                f"calibration block_scale_search must be true/false or the lowest block scale to try as a fraction "
                f"of the max rule's, in (0, 1) (e.g. 0.5), got {bss!r}."
            )
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            raise ValueError(f"calibration num_samples must be a positive int, got {self.num_samples!r}")
        if not 100 <= self.num_samples <= 500:
            warnings.warn(
                f"Calibrating on {self.num_samples} samples; 100-500 representative samples are "
                "recommended for stable amax.",
                stacklevel=3,
            )
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ValueError(f"calibration seq_len must be a positive int or null, got {self.seq_len!r}")

    @classmethod
    def resolve_spec(cls, spec: CalibrationConfig | dict | int | None) -> CalibrationConfig:
        if spec is None:
            return cls()
        if isinstance(spec, CalibrationConfig):
            return spec
        if isinstance(spec, int) and not isinstance(spec, bool):
            return cls(num_samples=spec)
        if not (isinstance(spec, dict) or hasattr(spec, "items")):
            raise ConfigError(
                f"calibration={spec!r} is not understood; give a sample count (e.g. calibration=256), a dict of "
                "CalibrationConfig fields (e.g. {'num_samples': 256}) or a CalibrationConfig."
            )
        return from_fields(cls, spec, "calibration")


def run_calibration(
    model: nn.Module,
    batches: list[Any],
    algorithm: str | dict[str, Any] | None,
    forward_fn: Callable[[nn.Module, Any], Any] = default_forward,
) -> None:
    """Run modelopt's calibration ``algorithm`` over ``batches`` (no gradients)."""
    import modelopt.torch.quantization as mtq

    if algorithm is None:
        return
    mtq.calibrate(model, algorithm=algorithm, forward_loop=lambda m: forward_batches(m, batches, forward_fn))


def _tp_size(module: nn.Module) -> int:
    """Tensor-parallel world size modelopt recorded for a quantized module (-1 / 1: not sharded)."""
    state = getattr(module, "_parallel_state", None)
    group = getattr(state, "tensor_parallel_group", None)
    return group.world_size() if group is not None else -1


def sync_amax_across_ranks(model: nn.Module) -> int:
    """All-reduce (MAX) quantizer amax across the ranks holding the same layers. Returns the count.

    A per-tensor amax (one value: NVFP4's global scale, FP8, per-tensor INT8) is the max over the
    whole tensor, so MAX over every rank is right under data *and* tensor parallelism. A per-channel
    amax inside a tensor-parallel linear (modelopt's ``parallel_state`` names a TP group) is not: a
    column-parallel shard holds other output channels than its TP peers. modelopt's ``max_calibrate``
    already syncs those over the right groups (DP, and TP where the axis allows), so they are left to
    it; per-channel amax outside tensor parallelism (DDP replicas hold the same channels) is synced here.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0
    tp_sharded = {
        f"{name}.{child}" if name else child
        for name, module in model.named_modules()
        if _tp_size(module) > 1
        for child, sub in module.named_modules()
        if child and is_quantizer(sub)
    }
    entries = [
        (name, module._amax)
        for name, module in sorted(model.named_modules(), key=lambda kv: kv[0])
        if is_quantizer(module) and isinstance(getattr(module, "_amax", None), torch.Tensor)
        and not (module._amax.numel() > 1 and name in tp_sharded)
    ]  # fmt: skip
    # Check first that every rank holds the same amax buffers: a mismatch would otherwise hang the
    # collective below with no message.
    group = same_layers_group()
    mine = [(name, tuple(a.shape)) for name, a in entries]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs != mine:
            diff = sorted(set(mine) ^ set(theirs))[:6]
            raise RuntimeError(
                f"Rank {dist.get_rank()} and rank {rank} of its group hold different quantizer amax buffers "
                f"({len(mine)} vs {len(theirs)}; first differences {diff}). Every rank must prepare and "
                "calibrate the same model with the same policy and schedule."
            )
    if not entries:
        return 0
    # under expert parallelism each rank holds other experts under the same local names: an expert's amax is
    # reduced only over the ranks that hold that expert (megatron's expert data-parallel group)
    expert_group = expert_data_parallel_group()
    by_group: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for name, a in entries:
        g = expert_group if expert_group is not None and split_expert_name(name.rsplit(".", 1)[0]) else group
        by_group.setdefault(id(g), (g, []))[1].append(a)
    for g, amaxes in by_group.values():
        reduced = all_reduce_flat([a.detach().float() for a in amaxes], dist.ReduceOp.MAX, g)
        for a, r in zip(amaxes, reduced, strict=True):
            a.data.copy_(r.view_as(a))
    return len(entries)
