"""FP4QATCallback / FP4QATMixin in real Lightning runs: schedule, resume, fused siblings, YAML."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from nemo_fp4qat import FP4QATCallback, FP4QATMixin
from nemo_fp4qat.numerics.formats import get_format
from nemo_fp4qat.qat.modelopt_compat import quantizer_format_signature

from paths import CONF
from reference_numerics import nvfp4_ref, round_ref
from tiny_models import LitLM, MegatronStyleGPT, loader, tiny_llama

pytestmark = pytest.mark.twice("the Lightning front end over modelopt 0.37's quantizers and transformers 4.57's models")

SCHED = {
    "stages": [
        {"start": 0, "format": "bf16"},
        {"start": 3, "format": "fp8"},
        {"start": 7, "format": "fp6"},
        {"start": 11, "format": "target"},
    ]
}


def _trainer(callbacks, steps, tmp_path=None, **kw):
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        **kw,
    )


def _expected_sig(fmt_name: str, kind: str) -> dict:
    cfg = get_format(fmt_name).quantizer_cfg(kind)
    if not cfg.get("enable", True):
        return {"enable": False, "num_bits": None, "axis": None, "block_sizes": None}
    return {"enable": True, "num_bits": cfg["num_bits"], "axis": cfg["axis"], "block_sizes": cfg["block_sizes"]}


class FormatProbe(pl.Callback):
    """Records the quantizer configuration of two layers at each step (after the QAT callback)."""

    def __init__(self, modules):
        self.modules = modules
        self.seen: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        mods = dict(pl_module.named_modules())
        self.seen.append(
            {
                m: (
                    quantizer_format_signature(mods[f"{m}.weight_quantizer"]),
                    quantizer_format_signature(mods[f"{m}.input_quantizer"]),
                )
                for m in self.modules
            }
        )


def test_formats_follow_the_schedule_and_end_like_a_fresh_fp4_quantization():
    mlp, attn = "net.decoder.layers.0.mlp.linear_fc1", "net.decoder.layers.0.self_attention.linear_qkv"
    lit = LitLM(MegatronStyleGPT())
    cb = FP4QATCallback(policy="conservative_attention", schedule=SCHED, calibration=16)
    probe = FormatProbe([mlp, attn])
    _trainer([cb, probe], 14).fit(lit, loader())
    expected_mlp = ["bf16"] * 3 + ["fp8"] * 4 + ["mxfp6_e2m3"] * 4 + ["nvfp4"] * 3
    expected_attn = ["bf16"] * 3 + ["mxfp8"] * 11  # attention's target (mxfp8) is above fp8/fp6
    for step, rec in enumerate(probe.seen):
        assert rec[mlp] == (_expected_sig(expected_mlp[step], "weight"), _expected_sig(expected_mlp[step], "input")), (
            step
        )
        assert rec[attn][0] == _expected_sig(expected_attn[step], "weight"), step
    assert all(torch.isfinite(torch.tensor(lit.losses)))
    assert [(e["step"], e["group"], e["to"]) for e in cb.controller.history] == [
        (3, "attention", "mxfp8"),
        (3, "mlp", "fp8"),
        (7, "mlp", "mxfp6_e2m3"),
        (11, "mlp", "nvfp4"),
    ]
    # FP8 -> FP6 -> FP4 leaves the same quantizers as quantizing straight to the policy formats
    fresh = LitLM(MegatronStyleGPT())
    _trainer([FP4QATCallback(policy="conservative_attention", schedule="direct", calibration=16)], 1).fit(
        fresh, loader()
    )
    sig = lambda m: {n: quantizer_format_signature(q) for n, q in m.named_modules() if n.endswith("_quantizer")}  # noqa: E731
    assert sig(lit) == sig(fresh)


def _fp8_ref(x: torch.Tensor, amax: float) -> torch.Tensor:
    """Per-tensor FP8 (E4M3) fake quant from the float64 rounding reference (scale amax / 448)."""
    scale = np.float32(amax) / np.float32(448.0)
    v = x.detach().numpy().astype(np.float32) / scale
    q = np.sign(v) * round_ref(np.abs(v).astype(np.float64), 4, 3)
    return torch.from_numpy((q.astype(np.float32) * scale).astype(np.float32))


def test_ramp_blends_old_and_new_format():
    """During a 3-step ramp from FP8 to NVFP4 the weight quantizer outputs (1 - a) * FP8(w) + a * NVFP4(w)
    with a = 1/4, 2/4, 3/4, both formats at the amax recalibrated at the switch; both sides come from the
    float64 references, not from the controller's objects."""
    lit = LitLM(MegatronStyleGPT())
    sched = {"stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "target"}], "ramp_steps": 3}
    cb = FP4QATCallback(policy="fp_embeddings", schedule=sched, calibration=16)
    alphas, checked = [], []
    q = "net.decoder.layers.0.mlp.linear_fc1.weight_quantizer"

    class AlphaProbe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            mods = dict(pl_module.named_modules())
            alphas.append(cb.controller.ramp_alpha(q) if q in cb.controller.ramps else None)
            if 2 <= trainer.global_step <= 4:
                a = (trainer.global_step - 2 + 1) / 4
                x = mods["net.decoder.layers.0.mlp.linear_fc1"].weight.detach()
                new = mods[q](x)
                amax = float(mods[q].amax)
                nv = torch.from_numpy(nvfp4_ref(x.numpy(), amax, 16))
                expect = a * nv + (1 - a) * _fp8_ref(x, amax)
                assert torch.allclose(new, expect, atol=1e-6), f"step {trainer.global_step}"
                checked.append(trainer.global_step)

    _trainer([cb, AlphaProbe()], 7).fit(lit, loader())
    assert checked == [2, 3, 4]
    assert alphas == [None, None, 0.25, 0.5, 0.75, None, None]
    assert not cb.controller.ramps


def _resume_run(tmp_path, make_module, make_callbacks, steps=16, ckpt_every=8):
    torch.manual_seed(0)
    full = make_module()
    # One batch per epoch: Lightning 2.4 resumes a plain (non-stateful) dataloader with a fresh iterator
    # and an off-by-one batch index, so batch order after a resume is Lightning's, not ours, to fix.
    # With one batch per epoch every step sees the same data and the test isolates restored state.
    ck = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=ckpt_every, save_top_k=-1)
    _trainer([*make_callbacks(), ck], steps, tmp_path).fit(full, loader(n=8, batch_size=8))
    ckpt = sorted((tmp_path / "ckpt").glob(f"*step={ckpt_every}.ckpt"))[0]
    torch.manual_seed(123)  # a different RNG state: the resumed run must not depend on it
    resumed = make_module()
    cbs = make_callbacks()
    _trainer(cbs, steps, tmp_path).fit(resumed, loader(n=8, batch_size=8), ckpt_path=str(ckpt))
    return full, resumed, cbs


@pytest.mark.parametrize("policy", ["default", "nvfp4_w4a8"])  # W4A8: weight amax held at 6x while training
def test_kill_and_resume_matches_uninterrupted_run(tmp_path, policy):
    sched = {**SCHED, "ramp_steps": 2}  # a ramp is active across the checkpoint at step 8
    sched["stages"] = [*SCHED["stages"][:2], {"start": 7, "format": "fp6"}, {"start": 11, "format": "target"}]
    full, resumed, cbs = _resume_run(
        tmp_path,
        lambda: LitLM(tiny_llama(seed=1)),
        lambda: [FP4QATCallback(policy=policy, schedule=sched, calibration=16)],
    )
    assert len(full.losses) == 16 and len(resumed.losses) == 8
    assert resumed.losses == pytest.approx(full.losses[8:], rel=0, abs=0)
    ctl = cbs[0].controller
    assert [e["step"] for e in ctl.history] == [3, 3, 7, 11]
    for (n, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), n


class MixinLM(FP4QATMixin, LitLM):
    def __init__(self):
        super().__init__(net=torch.nn.Identity())

    def configure_model(self):
        if isinstance(self.net, torch.nn.Identity):
            self.net = tiny_llama(seed=2)
            self.fp4qat_quantize(policy="fp_embeddings", schedule=SCHED, calibration=16)


def test_mixin_quantizes_in_configure_model_and_resumes(tmp_path):
    full, resumed, _ = _resume_run(tmp_path, MixinLM, lambda: [])
    assert type(full.net.model.layers[0].mlp.up_proj).__name__.startswith("Quant")
    assert full.fp4qat.controller.current["net.model.layers.0.mlp.up_proj"] == ("nvfp4", "nvfp4")
    assert resumed.losses == pytest.approx(full.losses[8:], rel=0, abs=0)


def test_fused_siblings_share_amax_by_default():
    def run(share):
        lit = LitLM(tiny_llama(seed=3))
        _trainer([FP4QATCallback(policy="fp_embeddings", calibration=16, share_fused_amax=share)], 1).fit(lit, loader())
        attn = lit.net.model.layers[0].self_attn
        mlp = lit.net.model.layers[0].mlp
        return [float(getattr(attn, p).weight_quantizer.amax) for p in ("q_proj", "k_proj", "v_proj")], [
            float(getattr(mlp, p).weight_quantizer.amax) for p in ("gate_proj", "up_proj")
        ]

    qkv, gate_up = run(True)
    assert len(set(qkv)) == 1 and len(set(gate_up)) == 1
    qkv_sep, gate_up_sep = run(False)
    assert len(set(qkv_sep)) == 3 and max(qkv_sep) == pytest.approx(qkv[0])
    assert len(set(gate_up_sep)) == 2


def test_callback_from_yaml_trainer_entry(monkeypatch):
    from nemo_fp4qat.qat.config_io import instantiate_yaml

    monkeypatch.setenv("NEMO_FP4QAT_CONF", str(CONF))
    cb = instantiate_yaml(CONF / "callback" / "fp4qat.yaml")
    assert isinstance(cb, FP4QATCallback)
    assert cb.controller.policy.name == "default" and cb.controller.schedule.name == "progressive"
    assert cb.controller.calibration.num_samples == 256 and cb.controller.calibration.seq_len == 512


def test_schedule_not_ending_in_target_is_refused_before_training():
    with pytest.raises(ValueError, match="ends in 'mxfp6_e2m3'"):
        FP4QATCallback(policy="default", schedule={"stages": [{"start": 0, "format": "fp6"}]})


def test_warns_when_training_ends_before_the_target_formats():
    lit = LitLM(MegatronStyleGPT())
    cb = FP4QATCallback(policy="fp_embeddings", schedule=SCHED, calibration=16)
    with pytest.warns(UserWarning, match="ended before the schedule reached the target formats"):
        _trainer([cb], 5).fit(lit, loader())


def test_wrapped_methods_are_restored_at_teardown_and_wrapped_once_per_fit(tmp_path):
    """The callback wraps training_step (QAD) and on_load_checkpoint; after fit the module's own
    methods are back, and a second fit wraps the originals (not the wrappers) once."""
    lit = LitLM(tiny_llama())
    cb = FP4QATCallback(policy="fp_embeddings", calibration=16, distillation=True)
    for run in range(2):
        trainer = _trainer([cb], 2, tmp_path)
        calls = []
        original_mix = cb.distiller.mix if cb.distiller else None
        if original_mix is not None:
            cb.distiller.mix = lambda lm, _m=original_mix, _c=calls: _c.append(1) or _m(lm)
        trainer.fit(lit, loader(n=32))
        assert "training_step" not in vars(lit) and "on_load_checkpoint" not in vars(lit), f"fit {run}"
        assert lit.training_step.__func__ is LitLM.training_step
        if original_mix is not None:
            assert len(calls) == 2, "the QAD loss mixes once per step, not once per wrapper"
    assert not cb.patches.is_patched(lit, "training_step")


def test_the_cuda_nvfp4_kernel_is_the_configs_during_fit_and_put_back_after(monkeypatch):
    """``cuda_nvfp4_kernel`` is in force from setup to teardown (what a CUDA tensor's NVFP4 fake quant uses), then
    the setting before the run is back; without it the environment decides."""
    from nemo_fp4qat.numerics import cpu_backend, kernel_choice

    monkeypatch.setattr(kernel_choice, "_CUDA_NVFP4_KERNEL", None)
    monkeypatch.setenv("NEMO_FP4QAT_CUDA_NVFP4", "exact")
    seen = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(cpu_backend.cuda_nvfp4_kernel())

    cb = FP4QATCallback(policy="fp_embeddings", calibration=16, cuda_nvfp4_kernel="modelopt")
    _trainer([cb, Probe()], 2).fit(LitLM(MegatronStyleGPT()), loader())
    assert seen == ["modelopt", "modelopt"] and cpu_backend.cuda_nvfp4_kernel() == "exact"
    seen.clear()
    _trainer([FP4QATCallback(policy="fp_embeddings", calibration=16), Probe()], 1).fit(
        LitLM(MegatronStyleGPT()), loader()
    )
    assert seen == ["exact"]
