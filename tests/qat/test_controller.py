"""QATController on its own (no trainer): what a precision switch recalibrates and keeps, the history it
records, its ramps, rollbacks and the state a resume restores. The callbacks' tests run the controller
through a training loop; these pin the decisions themselves (mutation testing found them unpinned)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from nemo_fp4qat import QATController
from nemo_fp4qat.qat.calibration.calibrate import run_calibration

from tiny_models import VOCAB, tiny_llama

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")

# progressive: FP8, then MXFP6, then NVFP4 (the policies keep attention at FP8 throughout)
PROGRESSIVE = {"stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "mxfp6"},
                          {"start": 4, "format": "nvfp4"}]}  # fmt: skip


def FWD(m, b):
    return m(b)


def _batches(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(4)]


def _amax(model, part: str) -> dict[str, torch.Tensor]:
    quantizers = ((n, q) for n, q in model.named_modules() if part in n and n.endswith("_quantizer"))
    return {n: q._amax.detach().clone() for n, q in quantizers if isinstance(getattr(q, "_amax", None), torch.Tensor)}


def _controller(policy="default", schedule=None, **kw) -> tuple[QATController, torch.nn.Module]:
    model = tiny_llama(seed=1)
    ctl = QATController(policy=policy, schedule=schedule or PROGRESSIVE, forward_fn=FWD, **kw)
    ctl.prepare(model)
    ctl.calibrate(model, _batches())
    return ctl, model


@pytest.mark.parametrize("recalibrate", [True, False])
def test_a_switch_recalibrates_the_switched_layers_only(recalibrate):
    """At the MLP's switch to NVFP4 the MLP quantizers get the amax a fresh max calibration of the model as it
    now stands gives; attention, which does not switch, keeps its amax although its weights moved since
    (training) and a fresh calibration would change it. With recalibrate_on_switch off nothing is recalibrated."""
    ctl, model = _controller(calibration={"num_samples": 8, "recalibrate_on_switch": recalibrate})
    for s in range(4):
        ctl.step(model, s)
    with torch.no_grad():  # "training" between calibration and the switch
        for n, p in model.named_parameters():
            if n.endswith("proj.weight"):
                p.mul_(1.5)
    attn_before, mlp_before = _amax(model, "self_attn"), _amax(model, ".mlp.")
    events = ctl.step(model, 4)
    assert [(e["group"], e["to"]) for e in events] == [("mlp", "nvfp4")]

    fresh = copy.deepcopy(model)  # the reference: every quantizer max-calibrated on the same batches
    run_calibration(fresh, ctl.calib_batches, "max", FWD)
    attn_fresh, mlp_fresh = _amax(fresh, "self_attn"), _amax(fresh, ".mlp.")
    for i in range(2):  # deployment fuses gate/up: the controller gives the two weights one amax, their max
        gate, up = (f"model.layers.{i}.mlp.{p}_proj.weight_quantizer" for p in ("gate", "up"))
        mlp_fresh[gate] = mlp_fresh[up] = torch.maximum(mlp_fresh[gate], mlp_fresh[up])
    assert any(not torch.equal(attn_fresh[n], a) for n, a in attn_before.items())  # the test can tell

    attn_after, mlp_after = _amax(model, "self_attn"), _amax(model, ".mlp.")
    assert attn_after.keys() == attn_before.keys()
    assert all(torch.equal(attn_after[n], a) for n, a in attn_before.items())
    assert mlp_after.keys() == mlp_fresh.keys() and mlp_after
    expected = mlp_fresh if recalibrate else mlp_before
    assert all(torch.equal(mlp_after[n], expected[n]) for n in mlp_after)


def test_history_counts_modules_and_names_the_weight_format_they_left():
    """W4A8 MLP (NVFP4 weights, FP8 inputs) on the progressive schedule: the weight format moves FP8 -> MXFP6
    -> NVFP4 while the input stays FP8; each history event names the group, the *weight* format before and
    after, and how many modules moved; only the quantizers whose format changed get a ramp."""
    ctl, model = _controller("nvfp4_w4a8", {**PROGRESSIVE, "ramp_steps": 1})
    events, ramps_at_4 = [], {}
    for s in range(6):
        events += ctl.step(model, s)
        if s == 4:
            ramps_at_4 = dict(ctl.ramps)
    assert events == [
        {"step": 2, "group": "mlp", "from": "fp8", "to": "mxfp6_e2m3", "modules": 6},
        {"step": 4, "group": "mlp", "from": "mxfp6_e2m3", "to": "nvfp4", "modules": 6},
    ]
    assert ctl.history == events
    mlp = [f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")]
    assert ramps_at_4 == {f"{m}.weight_quantizer": {"start": 4, "old": "mxfp6_e2m3"} for m in mlp}
    ctl.step(model, 6)  # past the ramp
    assert ctl.ramps == {}


def test_ramps_blend_for_ramp_steps_then_expire():
    """ramp_steps=2: both quantizers of every switched module ramp, alpha 1/3 then 2/3, and the ramp (and
    its hook) is gone at the step where alpha would reach 1."""
    ctl, model = _controller(schedule={**PROGRESSIVE, "ramp_steps": 2})
    ctl.step(model, 0)
    ctl.step(model, 2)
    switched = [f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")]
    names = {f"{m}.{k}_quantizer" for m in switched for k in ("weight", "input")}
    assert set(ctl.ramps) == names and set(ctl._hooks) == names
    assert all(ctl.ramp_alpha(q) == pytest.approx(1 / 3) for q in names)
    ctl.step(model, 3)
    assert all(ctl.ramp_alpha(q) == pytest.approx(2 / 3) for q in names)
    ctl.step(model, 4)  # the next switch starts new ramps: the old ones (start 2) are gone
    assert {r["start"] for r in ctl.ramps.values()} == {4}
    ctl.step(model, 6)
    assert ctl.ramps == {} and ctl._hooks == {}


def test_roll_back_moves_a_group_one_stage_down_each_time():
    ctl, model = _controller()
    for s in range(5):
        ctl.step(model, s)
    assert ctl.stage_summary() == {"attention": 8, "mlp": 4, "embedding_output_norm": 16}
    assert ctl.roll_back_group("mlp") == 1  # from NVFP4 (stage 2) to MXFP6
    ctl.step(model, 5)
    assert {f for m, f in ctl.formats_at(5).items() if ".mlp." in m} == {("mxfp6_e2m3", "mxfp6_e2m3")}
    assert ctl.stage_summary() == {"attention": 8, "mlp": 6, "embedding_output_norm": 16}
    assert ctl.roll_back_group("mlp") == 0  # from where the first roll-back left it
    assert ctl.roll_back_group("mlp") == 0
    assert ctl.roll_back_group("attention") == 1  # other groups are untouched by the mlp pins
    assert ctl.pins == {"mlp": 0, "attention": 1}


def test_state_dict_restores_step_pins_ramps_and_history(caplog):
    ctl, model = _controller(schedule={**PROGRESSIVE, "ramp_steps": 2})
    ctl.total_steps = 10
    for s in range(4):
        ctl.step(model, s)
    ctl.roll_back_group("attention")
    state = ctl.state_dict()
    fresh = QATController(policy="default", schedule={**PROGRESSIVE, "ramp_steps": 2}, forward_fn=FWD)
    fresh.load_state_dict(copy.deepcopy(state))
    assert (fresh._step, fresh.pins, fresh.total_steps, fresh.calibrated) == (3, {"attention": 0}, 10, True)
    assert fresh.ramps == ctl.ramps and fresh.history == ctl.history and fresh.current == ctl.current
    assert fresh.state_dict() == state
    assert state["policy"] == ctl.policy.to_dict() and state["schedule"] == ctl.schedule.to_dict()

    older = {k: v for k, v in state.items() if k not in ("step", "pins")}  # a state written before both existed
    fresh.load_state_dict(older)
    assert (fresh._step, fresh.pins) == (0, {})

    other = QATController(policy="default", schedule=PROGRESSIVE, forward_fn=FWD)
    with caplog.at_level(logging.WARNING, logger="nemo_fp4qat"):
        other.load_state_dict(copy.deepcopy(state))
    assert "different schedule" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nemo_fp4qat"):
        fresh.load_state_dict(copy.deepcopy(state))
    assert "different schedule" not in caplog.text

    with pytest.raises(ValueError, match=r"state version 0 != 1"):
        fresh.load_state_dict({**state, "version": 0})


def test_prepare_inserts_the_formats_of_step_0():
    schedule = {"stages": [{"start": 0, "format": "fp8"}, {"start": 1, "format": "nvfp4"}]}
    ctl = QATController(policy="default", schedule=schedule, forward_fn=FWD)
    model = tiny_llama(seed=1)
    ctl.prepare(model)
    assert {f for m, f in ctl.current.items() if ".mlp." in m} == {("fp8", "fp8")}
    q = model.model.layers[0].mlp.up_proj.weight_quantizer
    assert q.is_enabled and tuple(q.num_bits) == (4, 3) and not q.block_sizes  # FP8 per tensor, not NVFP4


def test_a_w4a8_layer_that_does_not_switch_keeps_its_training_amax():
    """W4A8 layers hold 6x their weight amax while training (w4a8_scaling). When another group switches, the
    recalibration scales the recalibrated W4A8 layers only: a kept one must not be multiplied by 6 again."""
    w4a8 = {"weight": "nvfp4", "input": "fp8"}
    policy = {"rules": [{"patterns": ["*layers.0.mlp*"], "group": "mlp0", **w4a8},
                        {"patterns": ["*layers.1.mlp*"], "group": "mlp1", **w4a8},
                        {"patterns": ["*lm_head*", "*embed*", "*norm*"], "weight": "bf16", "group": "full"}],
              "default": "fp8"}  # fmt: skip
    schedule = {"stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "nvfp4"}],
                "group_offsets": {"mlp1": 2}}  # fmt: skip
    ctl, model = _controller(policy, schedule)
    for s in range(3):
        ctl.step(model, s)  # mlp0 is W4A8 now
    kept = _amax(model, "layers.0.mlp")
    assert [(e["step"], e["group"]) for e in ctl.step(model, 3) + ctl.step(model, 4)] == [(4, "mlp1")]
    after = _amax(model, "layers.0.mlp")
    assert after.keys() == kept.keys() and all(torch.equal(after[n], a) for n, a in kept.items())


def test_group_offsets_and_fractions_of_the_run_reach_the_controller():
    """Stages at fractions of total_steps, the MLP delayed by a tenth of the run: the controller reads both."""
    schedule = {"stages": [{"start": 0.0, "format": "fp8"}, {"start": 0.2, "format": "mxfp6"},
                           {"start": 0.4, "format": "nvfp4"}], "group_offsets": {"mlp": 0.1}}  # fmt: skip
    ctl = QATController(policy="default", schedule=schedule, forward_fn=FWD)
    ctl.prepare(tiny_llama(seed=1))
    with pytest.raises(ValueError, match="total number of steps is unknown"):  # the callbacks set it (max_steps)
        ctl.formats_at(3)
    ctl.total_steps = 10
    mlp = {s: {f for m, f in ctl.formats_at(s).items() if ".mlp." in m} for s in (2, 3, 4, 5)}
    assert mlp == {2: {("fp8", "fp8")}, 3: {("mxfp6_e2m3", "mxfp6_e2m3")}, 4: {("mxfp6_e2m3", "mxfp6_e2m3")},
                   5: {("nvfp4", "nvfp4")}}  # fmt: skip
    ctl._step = 4
    assert ctl.roll_back_group("mlp") == 0  # from the mlp's own stage at step 4 (1), not the undelayed one (2)


def test_sync_to_checkpoint_rebuilds_the_quantizers_under_a_wrapper_module():
    """Resume where the quantized model is a submodule of what the checkpoint saved (a LightningModule's
    ``net``, NeMo's ``module``): a fresh run's step-0 quantizers are reconfigured to the checkpoint's formats
    and buffers, the checkpoint then loads strictly, and the resumed model computes what the saved one did,
    here in the middle of a ramp that started inside the previous switch's ramp (which once blended with the
    format before the previous one until a resume)."""

    class Wrapper(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

    schedule = {**PROGRESSIVE, "ramp_steps": 2}
    ctl, model = _controller(schedule=schedule)
    saved = Wrapper(model)
    for s in range(5):
        ctl.step(model, s)
    state, weights = ctl.state_dict(), saved.state_dict()

    resumed = Wrapper(tiny_llama(seed=2))
    ctl2 = QATController(policy="default", schedule=schedule, forward_fn=FWD)
    ctl2.prepare(resumed.net)
    ctl2.sync_to_checkpoint(resumed, copy.deepcopy(state), weights)
    resumed.load_state_dict(weights, strict=True)
    assert ctl2.current == ctl.current and set(ctl2._hooks) == set(ctl.ramps)
    batch = _batches(seed=3)[0]
    with torch.no_grad():
        assert torch.equal(resumed.net(batch).logits, saved.net(batch).logits)
    hooks = {n: len(q._forward_hooks) for n, q in resumed.named_modules() if n.endswith("_quantizer")}
    ctl2.attach(resumed.net)  # attaching again (another restore hook) adds no second blend
    assert {n: len(q._forward_hooks) for n, q in resumed.named_modules() if n.endswith("_quantizer")} == hooks


def test_an_offset_for_a_group_the_policy_lacks_is_refused_with_or_without_a_near_name():
    sched = {"stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "nvfp4"}]}
    with pytest.raises(ValueError, match=r"names group 'mpl'.*'other'.*\]\)\. Did you mean 'mlp'\?$"):
        QATController(policy="default", schedule={**sched, "group_offsets": {"mpl": 1}})
    with pytest.raises(ValueError, match=r"names group 'zzz', which policy 'default' does not have.*\]\)\.$") as e:
        QATController(policy="default", schedule={**sched, "group_offsets": {"zzz": 1}})
    assert "Did you mean" not in str(e.value)
