"""The scale levers' configuration (:mod:`nemo_fp4qat.qat.calibration.scale_levers`): one spelling each, modelopt's
algorithm for each choice, refusals that name the fix (and the modelopt version that has a lever), and the static
weight config."""

from __future__ import annotations

import pytest

from nemo_fp4qat import QATConfig
from nemo_fp4qat.qat.calibration import scale_levers
from nemo_fp4qat.qat.calibration.calibrate import CalibrationConfig
from nemo_fp4qat.qat.calibration.scale_levers import LearnedScalesConfig, lever_algorithm, make_weights_static
from nemo_fp4qat.qat.modelopt_compat import uses_list_config
from nemo_fp4qat.specs import ConfigError

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")

needs_047 = pytest.mark.skipif(not uses_list_config(), reason="the levers need modelopt >= 0.46")


def test_lever_algorithms_are_modelopts():
    assert lever_algorithm("max", "max", None) is None  # no lever: the formats' own calibration
    assert lever_algorithm("search", "max", None) is None  # the plugin's own search runs after max
    assert lever_algorithm("mse", "max", None) == {"method": "mse", "fp8_scale_sweep": True}
    assert lever_algorithm("local_hessian", "max", None) == {"method": "local_hessian"}
    assert lever_algorithm("four_over_six", "max", None)["stop_multiplier"] == 1.5
    mse = {"method": "mse", "fp8_scale_sweep": True}
    headroom = {"method": "nvfp4_act_headroom", "weight_scale_algorithm": mse}
    assert lever_algorithm("mse", "act_headroom", None) == headroom
    dual = lever_algorithm("local_hessian", "max", LearnedScalesConfig("dual"))
    assert dual == {"method": "lsq", "scale_algorithm": {"method": "local_hessian"},
                    "learnable_amax": ["pre", "post"], "tied_amax": False}  # fmt: skip
    assert lever_algorithm("max", "max", LearnedScalesConfig("scale_only"))["learnable_amax"] == ["post"]


def test_learned_scales_specs():
    assert LearnedScalesConfig.resolve_spec(None) is None and LearnedScalesConfig.resolve_spec("off") is None
    assert LearnedScalesConfig.resolve_spec("dual").mode == "dual"
    assert LearnedScalesConfig.resolve_spec({"mode": "post", "lr": 3e-4}).lr == 3e-4
    with pytest.raises(ConfigError, match="'dual'"):
        LearnedScalesConfig.resolve_spec("duel")
    with pytest.raises(ConfigError, match="positive number"):
        LearnedScalesConfig(lr=0)
    with pytest.raises(ConfigError, match="Unknown learned_scales field.*'lrate'.*mode, lr"):
        LearnedScalesConfig.resolve_spec({"mode": "post", "lrate": 1e-4})


def test_calibration_choices_are_checked():
    with pytest.raises(ConfigError, match="weight_scale='msq'.*did you mean 'mse'"):
        CalibrationConfig(weight_scale="msq")
    with pytest.raises(ConfigError, match="act_scale"):
        CalibrationConfig(act_scale="percentile")
    assert CalibrationConfig(weight_scale="search").block_scale_search is True
    if uses_list_config():
        with pytest.raises(ConfigError, match="both set NVFP4 weight block scales"):
            CalibrationConfig(weight_scale="mse", block_scale_search=True)


@needs_047
def test_combinations_that_cannot_run_are_refused_by_name():
    with pytest.raises(ConfigError, match="act_scale='max', or learned_scales=None"):
        QATConfig(calibration={"act_scale": "act_headroom"}, learned_scales="post")
    with pytest.raises(ConfigError, match="schedule='direct'"):
        QATConfig(schedule="progressive", calibration={"weight_scale": "mse"})
    with pytest.raises(ConfigError, match="schedule='direct'"):
        QATConfig(schedule="progressive", learned_scales="post")
    QATConfig(learned_scales={"mode": "scale_only", "lr": 1e-4}, calibration={"weight_scale": "local_hessian"})


def test_an_older_modelopt_is_refused_naming_the_version(monkeypatch):
    from packaging.version import Version

    monkeypatch.setattr("nemo_fp4qat.qat.modelopt_compat.modelopt_version", lambda: Version("0.37.0"))
    with pytest.raises(ConfigError, match=r"needs modelopt >= 0\.46.*0\.37"):
        QATConfig(learned_scales="post")
    with pytest.raises(ConfigError, match=r"weight_scale='mse' needs modelopt >= 0\.46"):
        CalibrationConfig(weight_scale="mse")
    assert scale_levers.LEVERS_MODELOPT == "0.46"


def test_static_weights_only_for_nvfp4_w4a4_layers():
    nv = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
    fp8 = {"num_bits": (4, 3), "axis": None}
    cfg = [{"quantizer_name": "*", "enable": False},
           {"quantizer_name": "a.weight_quantizer", "cfg": nv}, {"quantizer_name": "a.input_quantizer", "cfg": nv},
           {"quantizer_name": "b.weight_quantizer", "cfg": nv}, {"quantizer_name": "b.input_quantizer", "cfg": fp8},
           {"quantizer_name": "c.weight_quantizer", "cfg": fp8}]  # fmt: skip
    out = make_weights_static(cfg, four_over_six=True)
    assert out[1]["cfg"]["block_sizes"] == {-1: 16, "type": "static", "scale_bits": (4, 3), "four_over_six": True}
    assert out[2] == cfg[2] and out[3] == cfg[3] and out[5] == cfg[5]  # inputs, W4A8 and FP8 layers unchanged
    assert cfg[1]["cfg"]["block_sizes"]["type"] == "dynamic"  # the given config is not modified
