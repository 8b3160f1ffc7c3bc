"""One configuration object, one set of defaults, whichever entry point a user starts from."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from nemo_fp4qat import FP4QATCallback, QATConfig, QATController
from nemo_fp4qat.nemo.recipes import with_fp4_qat

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")

FIELDS = [f.name for f in dataclasses.fields(QATConfig)]


def _defaults(fn) -> dict:
    return {
        k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty
    }


@pytest.mark.parametrize("entry", [FP4QATCallback, QATController, with_fp4_qat], ids=lambda e: e.__name__)
def test_entry_points_take_their_defaults_from_qatconfig(entry):
    defaults = _defaults(entry)
    shared = [f for f in FIELDS if f in defaults]
    assert {"policy", "schedule", "calibration"} <= set(shared)
    assert {f: defaults[f] for f in shared} == {f: getattr(QATConfig(), f) for f in shared}


@pytest.mark.parametrize("entry", [FP4QATCallback, with_fp4_qat], ids=lambda e: e.__name__)
def test_entry_points_accept_every_field(entry):
    assert set(FIELDS) <= set(inspect.signature(entry).parameters)


def test_the_controller_is_built_from_the_config():
    cfg = QATConfig(policy="aggressive_mlp", schedule="progressive", calibration=32, share_fused_amax=False)
    ctl = QATController.from_config(cfg)
    assert (ctl.policy.name, ctl.schedule.name, ctl.calibration.num_samples, ctl.share_fused_amax) == (
        "aggressive_mlp", "progressive", 32, False)  # fmt: skip
    assert FP4QATCallback.from_config(cfg).controller.policy.name == "aggressive_mlp"


def test_nemo_run_factory_defaults_are_qatconfig():
    pytest.importorskip("nemo_run")
    from nemo_fp4qat.nemo.run_factories import fp4qat

    defaults = _defaults(fp4qat.__wrapped__ if hasattr(fp4qat, "__wrapped__") else fp4qat)
    shared = [f for f in FIELDS if f in defaults]
    assert {f: defaults[f] for f in shared} == {f: getattr(QATConfig(), f) for f in shared}
    assert set(FIELDS) - {"export"} <= set(defaults) and {"export_kind", "export_tensor_parallel"} <= set(defaults)


def test_callback_builds_the_config_and_from_config_round_trips():
    cb = FP4QATCallback(policy="aggressive_mlp", schedule="progressive", calibration=256, log_every_n_steps=5)
    assert cb.config == QATConfig(policy="aggressive_mlp", schedule="progressive", calibration=256, log_every_n_steps=5)
    again = FP4QATCallback.from_config(cb.config)
    assert again.config == cb.config
    assert again.controller.policy.name == "aggressive_mlp" and again.controller.calibration.num_samples == 256
    assert FP4QATCallback().config == QATConfig()


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"policy": "nope"}, ["nope", "default"]),
        ({"schedule": "fast"}, ["fast", "progressive"]),
        ({"log_every_n_steps": 0}, ["log_every_n_steps", "positive"]),
        ({"share_fused_amax": "yes"}, ["share_fused_amax"]),
        ({"distillation": 3}, ["distillation", "True"]),
    ],
)
def test_bad_config_fails_at_construction(kwargs, words):
    with pytest.raises(ValueError) as e:
        QATConfig(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_with_fp4_qat_rejects_a_bad_recipe_argument_before_the_job():
    class Trainer:
        callbacks = None

    class Recipe:
        trainer = Trainer()

    pytest.importorskip("nemo_run")
    with pytest.raises(ValueError, match="unknown_policy"):
        with_fp4_qat(Recipe(), policy="unknown_policy")
    assert Recipe.trainer.callbacks is None  # nothing appended
