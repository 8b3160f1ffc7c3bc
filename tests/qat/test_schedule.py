"""Precision schedules: validation, stage lookup, offsets, effective formats."""

from __future__ import annotations

import pytest

from nemo_fp4qat import PrecisionSchedule
from nemo_fp4qat.numerics.formats import get_format
from nemo_fp4qat.qat.schedule import effective_format

from paths import CONF

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")


def _s(*stages, **kw):
    return PrecisionSchedule(stages=[{"start": a, "format": f} for a, f in stages], **kw)


def test_progressive_preset_is_bf16_fp8_fp6_fp4():
    s = PrecisionSchedule.preset("progressive")
    assert [st.format for st in s.stages] == ["bf16", "fp8", "mxfp6_e2m3", "target"]
    assert s.boundaries(100) == [0, 10, 20, 30]
    assert [s.stage_index(t, total_steps=100) for t in (0, 9, 10, 19, 20, 29, 30, 99)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_group_offsets_delay_a_group():
    s = _s((0, "bf16"), (10, "fp8"), (20, "target"), group_offsets={"attention": 5})
    assert s.stage_index(12, "mlp") == 1 and s.stage_index(12, "attention") == 0
    assert s.stage_index(22, "mlp") == 2 and s.stage_index(22, "attention") == 1
    assert s.switch_step(2, "attention", None) == 25


@pytest.mark.parametrize(
    "stages,match",
    [
        ([], "at least one stage"),
        ([(5, "fp8"), (10, "target")], "first stage must start at 0"),
        ([(0, "bf16"), (10, "fp8"), (10, "target")], "increase strictly"),
        ([(0, "bf16"), (20, "fp8"), (10, "target")], "increase strictly"),
        ([(0, "bf16"), (0.5, "fp8"), (10, "target")], "mix steps"),
        ([(0, "bf16"), (1.5, "target")], "must be < 1.0"),
        ([(0, "bf16"), (10, "fp5")], "Unknown quantization format 'fp5'"),
    ],
)
def test_bad_schedules_are_rejected_with_the_reason(stages, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _s(*stages)


def test_schedule_must_end_in_the_policys_target():
    s = _s((0, "bf16"), (10, "fp8"))
    with pytest.raises(ValueError, match=r"ends in 'fp8' but the policy's target format is 'nvfp4'.*format: target"):
        s.validate_for(get_format("nvfp4"))
    _s((0, "fp8"), (10, "nvfp4")).validate_for(get_format("nvfp4"))
    with pytest.raises(ValueError, match="ends in 'fp8'"):
        from nemo_fp4qat import QATController

        QATController(policy="default", schedule={"stages": [{"start": 0, "format": "fp8"}]})


def test_fractions_need_total_steps():
    with pytest.raises(ValueError, match="set trainer.max_steps"):
        PrecisionSchedule.preset("progressive").stage_index(5)


def test_short_runs_keep_every_stage():
    assert PrecisionSchedule.preset("progressive").boundaries(8) == [0, 1, 2, 3]


def test_effective_format_is_the_less_aggressive_of_stage_and_target():
    nv, mx8 = get_format("nvfp4"), get_format("mxfp8")
    assert effective_format("bf16", nv).name == "bf16"
    assert effective_format("fp8", nv).name == "fp8"
    assert effective_format("mxfp6_e2m3", nv).name == "mxfp6_e2m3"
    assert effective_format("mxfp6_e2m3", mx8).name == "mxfp8"  # already more precise: keep target
    assert effective_format("target", nv).name == "nvfp4"
    assert effective_format("fp8", get_format("bf16")).name == "bf16"


def test_yaml_schedules(tmp_path):
    text = (
        (CONF / "schedule" / "progressive.yaml")
        .read_text()
        .replace("group_offsets: {}", "group_offsets:\n  attention: 0.05")
    )
    (tmp_path / "offsets.yaml").write_text(text)
    s = PrecisionSchedule.resolve_spec(str(tmp_path / "offsets.yaml"))
    assert s.group_offsets == {"attention": 0.05}
    assert s.stage_index(31, "mlp", 100) == 3 and s.stage_index(31, "attention", 100) == 2
    assert PrecisionSchedule.resolve_spec(str(CONF / "schedule" / "direct.yaml")).stages[0].format == "target"


@pytest.mark.parametrize("path", sorted((CONF / "schedule").glob("*.yaml")),
                         ids=lambda p: p.stem)  # fmt: skip
def test_each_conf_schedule_file_is_its_preset(path):
    """A user who switches from ``schedule="<name>"`` to ``conf/schedule/<name>.yaml`` gets the same run."""
    from nemo_fp4qat.qat.schedule import SCHEDULE_PRESETS

    assert path.stem in SCHEDULE_PRESETS, f"{path} has no preset of the same name"
    assert PrecisionSchedule.resolve_spec(str(path)).to_dict() == PrecisionSchedule.resolve_spec(path.stem).to_dict()
