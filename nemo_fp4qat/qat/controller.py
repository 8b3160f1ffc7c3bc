"""The QAT state machine shared by the Lightning callback, the mixin and the NeMo integration.

``QATController`` owns: the resolved policy table, the formats each quantizer is in now, the
calibration samples, the precision-schedule progress (switches and blending ramps) and the state
that must survive a restart. It talks to models only through modelopt (``mtq.quantize``,
``set_quantizer_by_cfg``, ``mtq.calibrate``) so what it builds is plain modelopt state that NeMo's
and modelopt's own save/restore/export understand.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from nemo_fp4qat.numerics.formats import QuantFormat, get_format
from nemo_fp4qat.numerics.weight_reuse import clear_weight_reuse
from nemo_fp4qat.qat.calibration.block_scale_search import (
    DEFAULT_MIN_RATIO,
    BlockClip,
    clip_nvfp4_weights,
    input_second_moments,
)
from nemo_fp4qat.qat.calibration.calibrate import (
    CalibrationConfig,
    default_forward,
    run_calibration,
    sync_amax_across_ranks,
)
from nemo_fp4qat.qat.calibration.gptq import apply_gptq
from nemo_fp4qat.qat.calibration.scale_levers import (
    LearnedScalesConfig,
    learned_scale_parameters,
    lever_algorithm,
    make_weights_static,
    promote_static,
    restore_lsq,
    uses_static_weights,
)
from nemo_fp4qat.qat.calibration.smoothing import SmoothingSite, smooth_model
from nemo_fp4qat.qat.calibration.w4a8_scaling import scale_w4a8_weight_amax
from nemo_fp4qat.qat.config import QATConfig, check_levers
from nemo_fp4qat.qat.experts.fused import is_fused_projection, quantizer_glob, quantizer_owner, run_experts_eagerly
from nemo_fp4qat.qat.experts.moe import module_standing_for, tie_expert_amax
from nemo_fp4qat.qat.modelopt_compat import apply_quant_cfg, build_quant_cfg, calibration_algorithm
from nemo_fp4qat.qat.policy.fused_siblings import find_fused_siblings, share_fused_amax
from nemo_fp4qat.qat.policy.rules import POLICY_PRESETS, LayerPolicy, PolicyTable, element_bits, is_quantizer
from nemo_fp4qat.qat.schedule import PrecisionSchedule, effective_format
from nemo_fp4qat.specs import ConfigError

__all__ = ["QATController"]

log = logging.getLogger("nemo_fp4qat")
STATE_VERSION = 1


def _check_offset_groups(offsets: dict[str, Any], policy: LayerPolicy) -> None:
    """A schedule's ``group_offsets`` must name groups the policy has (a typo would be silently ignored).

    Group names of the presets are accepted for any policy (a preset schedule with an ``attention``
    offset also fits a policy that keeps attention in full precision); anything else must be a group of
    this policy.
    """
    import difflib

    groups = {r.group for r in policy.rules} | {"other"}
    preset_groups = {r["group"] for p in POLICY_PRESETS.values() for r in p["rules"]}
    for g in offsets:
        if g not in groups | preset_groups:
            near = difflib.get_close_matches(str(g), sorted(groups), n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise ValueError(
                f"Schedule group_offsets names group {g!r}, which policy {policy.name!r} does not have "
                f"(groups: {sorted(groups)}).{hint}"
            )


def refuse_rows_modelopt_left_unquantized(model: nn.Module, table: PolicyTable) -> None:
    """Every module the policy quantizes holds modelopt's weight quantizer(s) after ``mtq.quantize``: a module type
    modelopt wraps another way (or not at all) would otherwise train in 16 bits under a table that says FP4.

    Raises:
        ConfigError: naming the modules and their type.
    """
    quantizers = [n for n, m in model.named_modules() if is_quantizer(m)]
    have = set(quantizers)
    missing = [
        r.module
        for r in table.rows
        if r.quantized
        and not (
            fnmatch.filter(quantizers, quantizer_glob(r.module, "weight"))
            if is_fused_projection(r.module)
            else quantizer_glob(r.module, "weight") in have
        )
    ]
    if missing:
        modules = dict(model.named_modules())
        owner = modules.get(missing[0].rpartition(".")[0] if is_fused_projection(missing[0]) else missing[0])
        raise ConfigError(
            f"modelopt inserted no quantizer into {len(missing)} module(s) the policy quantizes ({missing[0]}, "
            f"{type(owner).__name__}{' ...' if len(missing) > 1 else ''}): modelopt wraps this module type another "
            "way or not at all, so it would train in 16 bits under a policy that says otherwise. Keep it in 16 bits "
            "on purpose with a policy rule that matches it and gives no format."
        )


def refuse_attention_modelopt_cannot_convert(model: nn.Module, error: AssertionError) -> None:
    """modelopt (0.37) converts every Hugging Face attention class it meets for KV-cache quantization, rewriting its
    ``forward``; on a decorated ``forward`` (Jamba's SDPA attention) it fails a bare ``assert``.

    Raises:
        ConfigError: when ``error`` came from there, naming the model and the ways forward.
    """
    import traceback

    import modelopt

    frames = traceback.extract_tb(error.__traceback__)
    if frames and frames[-1].filename.replace("\\", "/").endswith("quantization/plugins/attention.py"):
        raise ConfigError(
            f"modelopt {modelopt.__version__} cannot quantize {type(model).__name__}: converting its attention for "
            "KV-cache quantization fails on the attention's decorated forward (a modelopt limitation, not this "
            "policy's). modelopt 0.47 converts it: install nvidia-modelopt>=0.47."
        ) from error


class QATController:
    """Applies a :class:`LayerPolicy` and a :class:`PrecisionSchedule` to one model.

    Args:
        policy: preset name, YAML path, dict or :class:`LayerPolicy`.
        schedule: preset name, YAML path, dict or :class:`PrecisionSchedule`.
        calibration: :class:`CalibrationConfig`, dict or sample count.
        share_fused_amax: give q/k/v and gate/up siblings one amax (what deployment uses).
        forward_fn: ``forward_fn(model, batch)`` used for calibration forwards.
    """

    def __init__(
        self,
        policy: Any = QATConfig.policy,
        schedule: Any = QATConfig.schedule,
        calibration: Any = QATConfig.calibration,
        share_fused_amax: bool = QATConfig.share_fused_amax,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        learned_scales: Any = QATConfig.learned_scales,
    ) -> None:
        self.policy = LayerPolicy.resolve_spec(policy)
        self.schedule = PrecisionSchedule.resolve_spec(schedule)
        self.schedule.validate_for(self.policy.target_format)
        _check_offset_groups(self.schedule.group_offsets, self.policy)
        self.calibration = CalibrationConfig.resolve_spec(calibration)
        self.learned_scales = LearnedScalesConfig.resolve_spec(learned_scales)
        check_levers(self.calibration, self.learned_scales, self.schedule)
        self.share_fused_amax = share_fused_amax
        self.forward_fn = forward_fn or default_forward
        self.table: PolicyTable | None = None
        self.current: dict[str, tuple[str, str]] = {}
        self.calibrated = False
        self.history: list[dict[str, Any]] = []
        self.ramps: dict[str, dict[str, Any]] = {}  # quantizer name -> {"start", "old"}
        self.total_steps: int | None = None
        self.calib_batches: list[Any] = []
        self.smoothed: list[SmoothingSite] = []  # sites smoothed by this run's calibration
        self.block_clips: dict[str, BlockClip] = {}  # layer -> what the block scale search changed
        self.fused_groups: list[list[str]] = []
        self.pins: dict[str, int] = {}  # layer group -> highest stage index it may use (rollbacks)
        self._step = 0
        self._hooks: dict[str, Any] = {}
        self._old_quantizers: dict[str, nn.Module] = {}

    @classmethod
    def from_config(cls, config: QATConfig, forward_fn: Callable[[nn.Module, Any], Any] | None = None) -> QATController:
        """The controller of a :class:`QATConfig` (its policy, schedule, calibration and fused-amax setting).

        Example:
            >>> ctl = QATController.from_config(QATConfig(policy="default"), forward_fn=lambda m, b: m(b))
        """
        return cls(
            policy=config.policy,
            schedule=config.schedule,
            calibration=config.calibration,
            share_fused_amax=config.share_fused_amax,
            forward_fn=forward_fn,
            learned_scales=config.learned_scales,
        )

    # --- set-up -------------------------------------------------------------------------------
    def resolve(self, model: nn.Module) -> PolicyTable:
        self.table = self.policy.resolve(model)
        self._refuse_levers_on_fused_experts(self.table)
        self.fused_groups = find_fused_siblings(model) if self.share_fused_amax else []
        return self.table

    def _refuse_levers_on_fused_experts(self, table: PolicyTable) -> None:
        """The calibration levers that rewrite or learn a linear layer's weight scales (GPTQ, smoothing, the block
        scale search, static and learned NVFP4 scales) reach a linear layer's one weight quantizer, not a fused
        expert container's per-expert ones: refused by name rather than left out of the experts silently."""
        fused = [r.module for r in table.rows if r.quantized and is_fused_projection(r.module)]
        cal = self.calibration
        levers = {
            "calibration.gptq": cal.gptq is not None,
            "calibration.smoothing": cal.smoothing is not None,
            "calibration.block_scale_search": cal.block_scale_search is not False,
            f"calibration.weight_scale={cal.weight_scale!r}": cal.weight_scale != "max",
            f"calibration.act_scale={cal.act_scale!r}": cal.act_scale != "max",
            "learned_scales": self.learned_scales is not None,
        }
        used = [name for name, on in levers.items() if on]
        if fused and used:
            raise ConfigError(
                f"{', '.join(used)} with fused experts ({fused[0]}{' ...' if len(fused) > 1 else ''}): these levers "
                "act on a linear layer's one weight quantizer, not on the per-expert quantizers of a fused expert "
                "container, so the experts would train without them. Turn them off for this model (max "
                "calibration quantizes every expert), or keep the experts in 16 bits with a policy rule "
                "{patterns: ['*.experts.*'], weight: null, group: experts}."
            )

    def _targets(self) -> dict[str, tuple[QuantFormat, QuantFormat, str]]:
        assert self.table is not None
        return {
            r.module: (get_format(r.weight), get_format(r.input), r.group) for r in self.table.rows if r.quantizable
        }

    def formats_at(self, step: int) -> dict[str, tuple[str, str]]:
        """Module -> (weight format, input format) the schedule prescribes at ``step``."""
        out = {}
        for module, (wt, it, group) in self._targets().items():
            idx = self.schedule.stage_index(step, group, self.total_steps)
            st = self.schedule.stage_format(min(idx, self.pins.get(group, idx)))
            out[module] = (effective_format(st, wt).name, effective_format(st, it).name)
        return out

    def prepare(self, model: nn.Module) -> PolicyTable:
        """Insert modelopt quantizers in the formats of step 0 (no calibration yet)."""
        import modelopt.torch.quantization as mtq

        table = self.resolve(model)
        self.current = self.formats_at(0)
        run_experts_eagerly(model)
        try:
            mtq.quantize(model, self._quant_cfg(), forward_loop=None)
        except AssertionError as e:
            refuse_attention_modelopt_cannot_convert(model, e)
            raise
        refuse_rows_modelopt_left_unquantized(model, table)
        return table

    @property
    def static_weights(self) -> bool:
        """NVFP4 weight quantizers hold calibrated (static or learned) block scales (:mod:`.scale_levers`)."""
        cal = self.calibration
        return uses_static_weights(cal.weight_scale, cal.act_scale, self.learned_scales)

    def _quant_cfg(self) -> dict[str, Any]:
        """The modelopt config of the formats now (``self.current``), static NVFP4 weights where the levers ask."""
        cfg = build_quant_cfg(self._assignment(self.current), algorithm=None, extra=self.policy.kv_cache_entries())
        if self.static_weights:
            cfg["quant_cfg"] = make_weights_static(cfg["quant_cfg"], self.calibration.weight_scale == "four_over_six")
        return cfg

    def sync_to_checkpoint(self, root: nn.Module, state: dict[str, Any], model_state_dict: dict[str, Any]) -> None:
        """Make already-inserted quantizers match a checkpoint before its tensors are loaded.

        Sets the saved schedule progress, reconfigures every quantizer to the saved formats, and
        creates the quantizer buffers (``_amax`` ...) the checkpoint holds, so a strict
        ``load_state_dict`` of ``model_state_dict`` (keys relative to ``root``) then succeeds.
        """
        self.load_state_dict(state)
        cfg = self._quant_cfg()
        modules = dict(root.named_modules())
        # the quantized module may be a submodule of root: find the prefix of the policy's names
        first = next(iter(self.current), None)
        prefix = ""
        if first is not None and first not in modules:
            prefix = next((n[: -len(first)] for n in modules if n.endswith("." + first)), "")
        qcfg = cfg["quant_cfg"]
        if prefix:
            sub = modules[prefix.rstrip(".")]
            apply_quant_cfg(sub, qcfg)
        else:
            apply_quant_cfg(root, qcfg)
        for key, value in model_state_dict.items():
            mod_name, _, attr = key.rpartition(".")
            q = modules.get(mod_name)
            if q is None or not is_quantizer(q) or not attr.startswith("_"):
                continue
            if attr in ("_amax_post", "_amax_pre") and self.learned_scales is not None:
                if not getattr(q, "_lsq", False):  # LSQ turns the calibrated amax into parameters
                    restore_lsq(q, value, self.learned_scales)
                continue
            if attr == "_global_amax":
                promote_static(q)
            if not isinstance(getattr(q, attr, None), torch.Tensor):
                q.register_buffer(attr, torch.empty_like(value))
        self.attach(modules[prefix.rstrip(".")] if prefix else root)

    @staticmethod
    def _assignment(formats: dict[str, tuple[str, str]]) -> dict[str, tuple[QuantFormat, QuantFormat]]:
        return {m: (get_format(w), get_format(i)) for m, (w, i) in formats.items()}

    # --- calibration --------------------------------------------------------------------------
    def _algorithm(self) -> Any:
        algo = self.calibration.algorithm
        levers = lever_algorithm(self.calibration.weight_scale, self.calibration.act_scale, self.learned_scales)
        if levers is not None and algo == "auto":
            return levers
        if algo == "auto":
            fmts = [get_format(f) for pair in self.current.values() for f in pair]
            # the KV-cache quantizers need their amax even while the linears are still in BF16
            return calibration_algorithm(fmts) or ("max" if self.policy.kv_cache else None)
        return algo

    def calibrate(self, model: nn.Module, batches: list[Any] | None = None) -> None:
        """Initial calibration on ``batches`` (kept for recalibration at switches)."""
        if batches is not None:
            self.calib_batches = list(batches)
        if not self.calib_batches:
            raise ValueError(
                "Calibration got no batches: the calibration data is empty. Pass calibration_data with at least one "
                "batch (100-500 representative samples), or let the callback draw them from the train dataloader."
            )
        if self.calibration.smoothing is not None and not self.calibrated:
            # once per run, before the first amax: the smoothed weights are what the checkpoint holds
            self.smoothed = smooth_model(model, self.calib_batches, self.calibration.smoothing, self.forward_fn)
        first = not self.calibrated
        run_calibration(model, self.calib_batches, self._algorithm(), self.forward_fn)
        scale_w4a8_weight_amax(model)
        self._after_calibration(model)
        if first:  # once per layer and format: a clipped weight searched again would be clipped further
            self._search_block_scales(model, None)
        if first and self.calibration.gptq is not None:  # once: the rounded weights are what the checkpoint holds
            apply_gptq(model, self.calib_batches, self.forward_fn, self.calibration.gptq)
        if first and self.learned_scales is not None:
            learned = learned_scale_parameters(model)
            if not learned:
                raise ValueError(
                    "learned_scales is set but no NVFP4 weight quantizer became learnable: the policy quantizes no "
                    "weight in NVFP4. Use a policy with NVFP4 weights, or learned_scales=None."
                )
            if self.learned_scales.mode == "scale_only":
                keep = {id(p) for p in learned}
                for p in model.parameters():
                    if id(p) not in keep:
                        p.requires_grad_(False)
            log.info("nemo_fp4qat: %d NVFP4 weight quantizers learn their block scales (%s, lr %g)",
                     len(learned) // len(self.learned_scales.learnable_amax), self.learned_scales.mode,
                     self.learned_scales.lr)  # fmt: skip
        self.calibrated = True
        clear_weight_reuse()  # amax, and the weights smoothing / GPTQ / the block search wrote, are new

    def _search_block_scales(self, model: nn.Module, modules: set[str] | None) -> None:
        bss = self.calibration.block_scale_search
        if bss is False or (modules is not None and not modules):
            return
        ratio = DEFAULT_MIN_RATIO if bss is True else float(bss)
        # the error that matters is the layer output's: weight each input channel by its mean square
        moments = (
            input_second_moments(model, self.calib_batches, self.forward_fn, modules) if self.calib_batches else None
        )
        found = clip_nvfp4_weights(model, modules, min_ratio=ratio, channel_weights=moments)
        self.block_clips.update(found)
        if found:
            clipped = sum(c.clipped for c in found.values())
            blocks = sum(c.blocks for c in found.values())
            log.info("nemo_fp4qat: block scale search lowered %d of %d NVFP4 weight block scales (%d layers)",
                     clipped, blocks, len(found))  # fmt: skip

    def _after_calibration(self, model: nn.Module) -> None:
        if self.calibration.sync_ranks:
            sync_amax_across_ranks(model)
        # one input amax per projection across a MoE layer's experts (the engines' fused MoE kernels take one)
        tie_expert_amax(model)
        if self.fused_groups:
            share_fused_amax(model, self.fused_groups)

    def _recalibrate(self, model: nn.Module, modules: list[str]) -> None:
        """Recalibrate (max) only the quantizers of ``modules``; others keep their amax."""
        if not self.calib_batches or not self.calibration.recalibrate_on_switch:
            return
        keep = set(modules)
        saved = {}
        for name, q in model.named_modules():
            if not is_quantizer(q):
                continue
            owner = quantizer_owner(name)
            if owner is None or owner[0] not in keep:
                amax = getattr(q, "_amax", None)
                if isinstance(amax, torch.Tensor):
                    saved[name] = amax.detach().clone()
            elif hasattr(getattr(q, "_calibrator", None), "reset"):
                # modelopt 0.37's MaxCalibrator keeps its running max across calibrate() calls: without
                # a reset the new amax would be max(old data, new data), and differ after a resume.
                q._calibrator.reset()
        run_calibration(model, self.calib_batches, "max", self.forward_fn)
        mods = dict(model.named_modules())
        for name, amax in saved.items():
            q = mods[name]
            if getattr(q, "_amax", None) is not None and q._amax.shape == amax.shape:
                q._amax.data.copy_(amax)
        scale_w4a8_weight_amax(model, keep)
        self._after_calibration(model)

    # --- the schedule -------------------------------------------------------------------------
    def step(self, model: nn.Module, step: int) -> list[dict[str, Any]]:
        """Apply the schedule for ``step``: switch formats that change, recalibrate, ramp."""
        self._step = step
        desired = self.formats_at(step)
        changed = {m: f for m, f in desired.items() if self.current.get(m) != f}
        events: list[dict[str, Any]] = []
        if changed:
            old = {m: self.current[m] for m in changed}
            cfg = build_quant_cfg(self._assignment(changed), algorithm=None)
            qcfg = cfg["quant_cfg"]
            # Drop the catch-all "disable everything" entry: only the changed quantizers move.
            qcfg = qcfg[1:] if isinstance(qcfg, list) else {k: v for k, v in qcfg.items() if k != "default"}
            apply_quant_cfg(model, qcfg)
            self.current.update(changed)
            needs = [m for m, (w, i) in changed.items() if get_format(w).needs_amax or get_format(i).needs_amax]
            if needs:
                self._recalibrate(model, needs)
            self._search_block_scales(model, {m for m, (w, _) in changed.items() if w != old[m][0]})
            targets = self._targets()
            by_group: dict[tuple[str, str, str], int] = {}
            for m, (w, _) in changed.items():
                key = (targets[m][2], old[m][0], w)
                by_group[key] = by_group.get(key, 0) + 1
            for (group, frm, to), n in sorted(by_group.items()):
                ev = {"step": step, "group": group, "from": frm, "to": to, "modules": n}
                events.append(ev)
                self.history.append(ev)
                log.info("nemo_fp4qat: step %d: %s %s -> %s (%d modules)", step, group, frm, to, n)
            if self.schedule.ramp_steps > 0:
                quantizers = [n for n, q in model.named_modules() if is_quantizer(q)]
                for m in changed:
                    for kind, idx in (("weight", 0), ("input", 1)):
                        if old[m][idx] == changed[m][idx]:
                            continue
                        # one quantizer of a linear layer; every expert's of a fused projection
                        for qname in fnmatch.filter(quantizers, quantizer_glob(m, kind)):
                            # a switch inside a running ramp: its hook blends with the format before that one;
                            # drop it so attach() blends with the format this switch leaves (as a resume does)
                            self._drop_ramp_hook(qname)
                            self.ramps[qname] = {"start": step, "old": old[m][idx]}
            self.attach(model)
            clear_weight_reuse()  # recalibrated amax and searched weights were written in place
        self._expire_ramps(model)
        return events

    def group_of(self, layer: str) -> str | None:
        """The layer group (policy rule) of the quantized module ``layer`` (or of the module a finding's name stands
        for: an expert's, :func:`~.moe.module_standing_for`); None for a module it does not quantize (or before the
        policy is resolved)."""
        targets = self._targets() if self.table is not None else {}
        module = module_standing_for(layer, targets)
        return targets[module][2] if module is not None else None

    def roll_back_layer(self, layer: str) -> int | None:
        """Roll back the layer group ``layer`` belongs to (:meth:`roll_back_group`); None for a layer it does not
        quantize (or before the policy is resolved)."""
        group = self.group_of(layer)
        return self.roll_back_group(group) if group is not None else None

    def roll_back_group(self, group: str) -> int:
        """Keep ``group`` one stage below where it is now for the rest of the run (applied next step)."""
        now = self.schedule.stage_index(self._step, group, self.total_steps)
        now = min(now, self.pins.get(group, now))
        self.pins[group] = max(0, now - 1)
        log.warning("nemo_fp4qat: layer group %r rolled back to stage %d", group, self.pins[group])
        return self.pins[group]

    def stage_summary(self, step: int | None = None) -> dict[str, int]:
        """Group -> element bits of its weight format now (for logging)."""
        out: dict[str, int] = {}
        targets = self._targets() if self.table else {}
        for m, (w, _) in self.current.items():
            g = targets[m][2] if m in targets else "other"
            out[g] = min(out.get(g, 16), element_bits(get_format(w)))
        return out

    # --- blending ramps -----------------------------------------------------------------------
    def ramp_alpha(self, qname: str) -> float:
        r = self.ramps[qname]
        return min(1.0, (self._step - r["start"] + 1) / (self.schedule.ramp_steps + 1))

    def attach(self, model: nn.Module) -> None:
        """(Re)install forward hooks for active ramps (also after a restore)."""
        from modelopt.torch.quantization.config import QuantizerAttributeConfig
        from modelopt.torch.quantization.nn import TensorQuantizer

        mods = dict(model.named_modules())
        for qname, r in self.ramps.items():
            if qname in self._hooks or qname not in mods:
                continue
            q = mods[qname]
            old_fmt = get_format(r["old"])
            old_q = None
            if not old_fmt.is_full_precision:
                kind = quantizer_owner(qname)[1]
                attrs = {k: v for k, v in old_fmt.quantizer_cfg(kind).items() if k != "enable"}
                old_q = TensorQuantizer(QuantizerAttributeConfig(**attrs))
                old_q.to(next((b.device for b in q.buffers()), torch.device("cpu")))
            self._old_quantizers[qname] = old_q

            def hook(module, args, output, _qname=qname):
                if _qname not in self.ramps:
                    return output
                alpha = self.ramp_alpha(_qname)
                oq = self._old_quantizers.get(_qname)
                amax = getattr(module, "_amax", None)
                if oq is not None and isinstance(amax, torch.Tensor):
                    # read at call time: after a restore the buffer is filled only after attach()
                    oq.amax = amax.detach()
                previous = args[0] if oq is None else oq(args[0])
                return alpha * output + (1.0 - alpha) * previous

            self._hooks[qname] = q.register_forward_hook(hook)

    def _drop_ramp_hook(self, qname: str) -> None:
        h = self._hooks.pop(qname, None)
        if h is not None:
            h.remove()
        self._old_quantizers.pop(qname, None)

    def _expire_ramps(self, model: nn.Module) -> None:
        done = [q for q, r in self.ramps.items() if self._step >= r["start"] + self.schedule.ramp_steps]
        for q in done:
            self.ramps.pop(q)
            self._drop_ramp_hook(q)

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "policy": self.policy.to_dict(),
            "schedule": self.schedule.to_dict(),
            "current": {m: list(f) for m, f in self.current.items()},
            "calibrated": self.calibrated,
            "history": list(self.history),
            "ramps": {k: dict(v) for k, v in self.ramps.items()},
            "total_steps": self.total_steps,
            "step": self._step,
            "pins": dict(self.pins),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"nemo_fp4qat state version {state.get('version')} != {STATE_VERSION}")
        if state.get("schedule") != self.schedule.to_dict():
            log.warning("nemo_fp4qat: resuming with a different schedule than the checkpoint's.")
        self.current = {m: (f[0], f[1]) for m, f in state["current"].items()}
        self.calibrated = bool(state["calibrated"])
        self.history = list(state["history"])
        self.ramps = {k: dict(v) for k, v in state["ramps"].items()}
        self.total_steps = state["total_steps"]
        self._step = int(state.get("step", 0))
        self.pins = dict(state.get("pins", {}))
