"""Progressive precision: which format each layer group trains in at each step.

A :class:`PrecisionSchedule` is a validated list of stages ``(start, format)`` in the spirit of
Lightning's ``GradientAccumulationScheduler`` ``{epoch: value}`` schedule: starts are steps (ints)
or fractions of training (floats in [0, 1)), strictly increasing from 0. A stage's format is a
*ceiling on aggressiveness*: a layer trains in the stage format unless its policy target is
already at least as precise (``"target"`` means each layer's own policy format). The schedule must
end in the policy's target format, so training ends in what will be deployed.

Options: per-group offsets (``{"attention": 100}`` reaches each stage 100 steps later than the
rest) and a ramp that blends the previous and the new format over ``ramp_steps`` instead of a hard
switch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_fp4qat.numerics.formats import FULL_PRECISION, QuantFormat, get_format
from nemo_fp4qat.qat.policy.rules import element_bits
from nemo_fp4qat.specs import ConfigError, did_you_mean, from_fields

__all__ = ["SCHEDULE_PRESETS", "TARGET", "PrecisionSchedule", "Stage", "effective_format"]

TARGET = "target"


@dataclass(frozen=True)
class Stage:
    """Train in ``format`` from ``start`` (a step, or a fraction of the run if a float < 1)."""

    start: int | float
    format: str

    def __post_init__(self) -> None:
        fmt = self.format
        if not isinstance(fmt, str):
            raise TypeError(f"Stage format must be a string, got {fmt!r}")
        if fmt.lower() != TARGET:
            object.__setattr__(self, "format", get_format(fmt).name)
        else:
            object.__setattr__(self, "format", TARGET)
        if isinstance(self.start, bool) or not isinstance(self.start, (int, float)) or self.start < 0:
            raise ValueError(f"Stage start must be a non-negative step or fraction, got {self.start!r}")


SCHEDULE_PRESETS: dict[str, dict[str, Any]] = {
    "direct": {"stages": [{"start": 0, "format": TARGET}]},
    "progressive": {
        "stages": [
            {"start": 0.0, "format": "bf16"},
            {"start": 0.1, "format": "fp8"},
            {"start": 0.2, "format": "fp6"},
            {"start": 0.3, "format": TARGET},
        ]
    },
}


@dataclass
class PrecisionSchedule:
    """Ordered precision stages with optional per-group offsets and a blending ramp.

    Args:
        stages: :class:`Stage` objects or ``{"start": ..., "format": ...}`` dicts.
        group_offsets: layer group -> delay (steps, or a fraction if the stages use fractions).
        ramp_steps: blend old and new formats linearly over this many steps after each switch.
        name: label for logs.
    """

    stages: list[Stage] = field(default_factory=lambda: [Stage(0, TARGET)])
    group_offsets: dict[str, int | float] = field(default_factory=dict)
    ramp_steps: int = 0
    name: str = "custom"

    def __post_init__(self) -> None:
        stages = []
        for i, s in enumerate(self.stages):
            if isinstance(s, Stage):
                stages.append(s)
            elif hasattr(s, "items"):
                d = dict(s)
                if set(d) - {"start", "format"}:
                    raise ValueError(
                        f"Stage {i} has unknown keys {sorted(set(d) - {'start', 'format'})}; "
                        "a stage is {start: <step or fraction>, format: <name>}."
                    )
                stages.append(Stage(**d))
            elif isinstance(s, (tuple, list)) and len(s) == 2:
                stages.append(Stage(*s))
            else:
                raise TypeError(f"Stage {i} must be a Stage, a dict or a (start, format) pair, got {s!r}")
        if not stages:
            raise ValueError("A PrecisionSchedule needs at least one stage, e.g. [{start: 0, format: target}].")
        if stages[0].start != 0:
            raise ValueError(f"The first stage must start at 0, not {stages[0].start!r}.")
        nonzero = [s.start for s in stages if s.start != 0]
        if any(isinstance(x, float) for x in nonzero) and any(not isinstance(x, float) for x in nonzero):
            raise ValueError("Stage starts mix steps (ints) and fractions (floats); use one kind.")
        if any(isinstance(s.start, float) and s.start >= 1.0 for s in stages):
            raise ValueError("Fractional stage starts must be < 1.0 (fractions of the training run).")
        for a, b in zip(stages, stages[1:]):
            if not b.start > a.start:
                raise ValueError(
                    f"Stage starts must increase strictly: {a.format}@{a.start} is followed by {b.format}@{b.start}."
                )
        self.stages = stages
        if not isinstance(self.ramp_steps, int) or self.ramp_steps < 0:
            raise ValueError(f"ramp_steps must be a non-negative int, got {self.ramp_steps!r}")
        self.group_offsets = dict(self.group_offsets or {})
        for g, off in self.group_offsets.items():
            if not isinstance(off, (int, float)) or off < 0:
                raise ValueError(f"group_offsets[{g!r}] must be a non-negative number, got {off!r}")

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> PrecisionSchedule:
        if name not in SCHEDULE_PRESETS:
            raise ConfigError(
                f"Unknown schedule preset {name!r}{did_you_mean(name, SCHEDULE_PRESETS)}; presets: "
                f"{', '.join(SCHEDULE_PRESETS)}"
            )
        return cls(name=name, **SCHEDULE_PRESETS[name])

    @classmethod
    def resolve_spec(cls, spec: str | Path | dict | PrecisionSchedule) -> PrecisionSchedule:
        if isinstance(spec, PrecisionSchedule):
            return spec
        if isinstance(spec, dict) or hasattr(spec, "items"):
            return from_fields(cls, spec, "schedule")
        s = str(spec)
        if s in SCHEDULE_PRESETS:
            return cls.preset(s)
        if s.endswith((".yaml", ".yml")) or Path(s).is_file():
            from nemo_fp4qat.qat.config_io import instantiate_yaml

            obj = instantiate_yaml(s, default_target=cls)
            if not isinstance(obj, PrecisionSchedule):
                raise TypeError(f"{s} does not describe a PrecisionSchedule (got {type(obj).__name__})")
            return obj
        raise ConfigError(
            f"Schedule {spec!r} is neither a preset{did_you_mean(s, SCHEDULE_PRESETS)} ({', '.join(SCHEDULE_PRESETS)}) "
            "nor a YAML file."
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "stages": [{"start": s.start, "format": s.format} for s in self.stages],
            "group_offsets": dict(self.group_offsets),
            "ramp_steps": self.ramp_steps,
        }

    # --- validation against a policy ----------------------------------------------------------
    def validate_for(self, target: QuantFormat) -> None:
        """The last stage must reach the policy's target format (``"target"`` always does)."""
        last = self.stages[-1].format
        if last != TARGET and get_format(last).name != target.name:
            raise ValueError(
                f"Schedule {self.name!r} ends in {last!r} but the policy's target format is "
                f"{target.name!r}: training would end in a format that is not deployed. End the "
                f"schedule with a stage {{format: target}} (or {{format: {target.name}}})."
            )

    @property
    def needs_total_steps(self) -> bool:
        return any(isinstance(s.start, float) and s.start > 0 for s in self.stages) or any(
            isinstance(v, float) for v in self.group_offsets.values()
        )

    def boundaries(self, total_steps: int | None) -> list[int]:
        """Absolute start step of each stage."""
        out = []
        for s in self.stages:
            if isinstance(s.start, float):
                if total_steps is None or total_steps <= 0:
                    raise ValueError(
                        f"Schedule {self.name!r} uses fractions of training but the total number of steps "
                        "is unknown; set trainer.max_steps or give stage starts as steps."
                    )
                out.append(int(round(s.start * total_steps)))
            else:
                out.append(int(s.start))
        # Rounding fractions of a short run can merge stages; give every stage at least one step.
        for i in range(1, len(out)):
            out[i] = max(out[i], out[i - 1] + 1)
        return out

    def _offset(self, group: str, total_steps: int | None) -> int:
        off = self.group_offsets.get(group, 0)
        if isinstance(off, float) and 0 < off < 1:
            if not total_steps:
                raise ValueError("Fractional group offsets need the total number of steps.")
            return int(round(off * total_steps))
        return int(off)

    def stage_index(self, step: int, group: str = "other", total_steps: int | None = None) -> int:
        """Index of the stage ``group`` is in at ``step``."""
        if step <= 0 or len(self.stages) == 1:
            return 0  # every schedule starts at 0: no total needed yet
        eff = step - self._offset(group, total_steps)
        idx = 0
        for i, b in enumerate(self.boundaries(total_steps)):
            if eff >= b:
                idx = i
        return idx

    def switch_step(self, stage: int, group: str, total_steps: int | None) -> int:
        """The step at which ``group`` enters ``stage``."""
        return self.boundaries(total_steps)[stage] + self._offset(group, total_steps)

    def stage_format(self, stage: int) -> str:
        return self.stages[stage].format


def effective_format(stage_format: str, target: QuantFormat) -> QuantFormat:
    """The format a quantizer with policy ``target`` trains in during a stage.

    Full-precision targets stay full precision; ``"target"`` gives the target; otherwise the stage
    format applies unless the target is at least as precise (more element bits).
    """
    if target.is_full_precision:
        return FULL_PRECISION
    if stage_format == TARGET:
        return target
    stage = get_format(stage_format)
    if stage.is_full_precision:
        return FULL_PRECISION
    return target if element_bits(target) >= element_bits(stage) else stage
