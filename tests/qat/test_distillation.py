"""Quantization-aware distillation: the loss is the KD term against the unquantized teacher, and
distilling pulls the quantized student toward the teacher faster than the LM loss alone."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from nemo_fp4qat import DistillationConfig, FP4QATCallback
from nemo_fp4qat.qat.distillation.distiller import Distiller, kd_loss, kd_per_token

from tiny_models import LitLM, MegatronStyleGPT, PatternTokens, loader

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")


def _fit(cb, steps=12, lr=3e-3):
    lit = LitLM(MegatronStyleGPT(seed=7), lr=lr)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])  # fmt: skip
    trainer.fit(lit, loader())
    return lit


def test_kd_loss_is_the_temperature_scaled_kl():
    s, t = torch.randn(2, 3, 11), torch.randn(2, 3, 11)
    ps, pt = torch.softmax(s.double() / 2, -1), torch.softmax(t.double() / 2, -1)
    ref = (pt * (pt.log() - ps.log())).sum(-1).mean() * 4
    assert float(kd_loss(s, t, 2.0)) == pytest.approx(float(ref), rel=1e-5)
    assert float(kd_loss(t, t)) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="alpha"):
        DistillationConfig(alpha=1.5)


def test_kd_per_token_is_the_kl_of_teacher_to_student_at_each_position():
    """What the NeMo path puts in place of the per-token cross entropy: KL(teacher || student) per position
    (not the reverse, which differs on distinct distributions), whose mean is kd_loss."""
    g = torch.Generator().manual_seed(3)
    s, t = torch.randn(2, 5, 13, generator=g) * 3, torch.randn(2, 5, 13, generator=g) * 3
    ps, pt = torch.softmax(s.double() / 1.5, -1), torch.softmax(t.double() / 1.5, -1)
    ref = (pt * (pt.log() - ps.log())).sum(-1) * 1.5**2
    reverse = (ps * (ps.log() - pt.log())).sum(-1) * 1.5**2
    got = kd_per_token(s, t, 1.5)
    assert got.shape == (2, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got.double(), reverse, rtol=1e-2)
    assert float(got.mean()) == pytest.approx(float(kd_loss(s, t, 1.5)), rel=1e-5)


def test_a_nemo_checkpoint_teacher_is_refused_outside_the_nemo_path(tmp_path):
    (tmp_path / "weights").mkdir()  # what a NeMo 2 checkpoint holds beside context/
    cfg = DistillationConfig(teacher=str(tmp_path))  # accepted: the NeMo callback loads it
    with pytest.raises(ValueError, match="NeMo checkpoint, which only the NeMo path loads"):
        Distiller(torch.nn.Linear(2, 2), cfg)


def test_training_loss_is_kd_against_the_unquantized_teacher():
    cb = FP4QATCallback(policy="fp_embeddings", calibration=16, distillation={"alpha": 1.0, "temperature": 1.0})
    seen = []

    class Check(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((float(outputs["loss"]), cb.distiller.last["kd"]))

    lit = LitLM(MegatronStyleGPT(seed=7))
    teacher_before = {k: v.clone() for k, v in lit.net.state_dict().items()}
    pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[cb, Check()]).fit(lit, loader())  # fmt: skip
    assert all(loss == pytest.approx(kd) for loss, kd in seen) and seen[0][0] > 0
    # the teacher is frozen and unquantized: its weights are the model's initial ones
    tsd = cb.distiller.teacher.net.state_dict()
    assert all(torch.equal(tsd[k], v) for k, v in teacher_before.items())
    assert not any("quantizer" in n for n, _ in cb.distiller.teacher.named_modules())


def test_distillation_tracks_the_teacher_better_than_plain_qat():
    held = PatternTokens(32, 32, seed=9).data[:, :-1]

    def kl_to_teacher(cb, lit):
        teacher = cb.distiller.teacher if cb.distiller else None
        with torch.no_grad():
            lit.eval()
            ref = teacher(held) if teacher is not None else LitLM(MegatronStyleGPT(seed=7))(held)
            return float(kd_loss(lit(held), ref))

    qad = FP4QATCallback(policy="fp_embeddings", calibration=16, distillation=True)
    lit_qad = _fit(qad)
    plain = FP4QATCallback(policy="fp_embeddings", calibration=16)
    lit_plain = _fit(plain)
    assert kl_to_teacher(qad, lit_qad) < 0.5 * kl_to_teacher(plain, lit_plain)


def test_jsd_is_the_temperature_scaled_jensen_shannon_divergence():
    """Against the textbook formula (float64): symmetric, zero on equal distributions, at most ln 2 (times T^2)."""
    g = torch.Generator().manual_seed(5)
    s, t = torch.randn(2, 4, 17, generator=g) * 3, torch.randn(2, 4, 17, generator=g) * 3
    ps, pt = torch.softmax(s.double() / 2, -1), torch.softmax(t.double() / 2, -1)
    m = (ps + pt) / 2
    ref = 0.5 * ((pt * (pt / m).log()).sum(-1) + (ps * (ps / m).log()).sum(-1)).mean() * 4
    got = kd_loss(s, t, 2.0, "jsd")
    assert float(got) == pytest.approx(float(ref), rel=1e-5)
    assert float(kd_loss(t, s, 2.0, "jsd")) == pytest.approx(float(got), rel=1e-5)  # symmetric, unlike KL
    assert float(kd_loss(t, t, 1.0, "jsd")) == pytest.approx(0.0, abs=1e-6)
    assert float(got) <= math.log(2) * 4
    assert float(got) != pytest.approx(float(kd_loss(s, t, 2.0)), rel=1e-2)


def test_kl_mse_adds_the_last_hidden_states_relative_error_to_the_kl():
    """``kl_mse`` on a Hugging Face Llama: the step's loss is KL + hidden_weight * ||h_s - h_t||^2 / ||h_t||^2 with
    ``h`` the last hidden state (the output layer's input: ``hidden_states[-1]``, after the final norm)."""
    from tiny_models import VOCAB, tiny_llama

    teacher = tiny_llama(seed=0)
    student = tiny_llama(seed=0)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    d = Distiller(student, DistillationConfig(teacher=teacher, loss="kl_mse", hidden_weight=0.5))
    batch = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    student.train()
    out = student(batch, labels=batch)
    loss = d.mix(out.loss)
    with torch.no_grad():
        hs = student(batch, output_hidden_states=True)
        ht = teacher(batch, output_hidden_states=True)
    mse = (hs.hidden_states[-1] - ht.hidden_states[-1]).pow(2).mean() / ht.hidden_states[-1].pow(2).mean()
    kl = kd_loss(hs.logits, ht.logits)
    assert d.last["hidden_mse"] == pytest.approx(float(mse), rel=1e-4) and float(mse) > 1e-3
    assert float(loss) == pytest.approx(float(kl + 0.5 * mse), rel=1e-4)
    loss.backward()  # the hidden term reaches the student's weights
    assert student.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0
    d.remove()


def test_distillation_losses_the_front_end_cannot_run_are_refused_by_name():
    from nemo_fp4qat.qat.distillation.megatron import require_megatron_loss
    from nemo_fp4qat.specs import ConfigError

    with pytest.raises(ConfigError, match=r"distillation loss='ce' is not one of \['kl', 'jsd', 'kl_mse'\]"):
        DistillationConfig(loss="ce")
    with pytest.raises(ConfigError, match="hidden_weight"):
        DistillationConfig(loss="kl_mse", hidden_weight=-1)
    with pytest.raises(ConfigError, match="megatron front ends .* use loss 'kl'"):
        require_megatron_loss(DistillationConfig(loss="jsd"))
    require_megatron_loss(DistillationConfig())
    with pytest.raises(ConfigError, match="kl_mse' needs the student's output layer"):
        Distiller(MegatronStyleGPT(seed=1), DistillationConfig(loss="kl_mse"))


@pytest.mark.parametrize("loss", ["jsd", "kl_mse"])
def test_qad_with_each_loss_tracks_the_teacher_better_than_plain_qat(tmp_path, loss):
    """QAD with JSD / KL + hidden MSE through ``FP4QATCallback`` on the demo's training loop (a LightningModule
    wrapping a Hugging Face Llama) ends nearer the teacher (KL on held-out tokens) than plain QAT on the same
    batches, and logs the hidden-state term where it is one."""
    import copy
    from types import SimpleNamespace

    from nemo_fp4qat.demo.training import train_lm

    from tiny_models import VOCAB, tiny_llama

    data = torch.randint(0, VOCAB, (64, 33), generator=torch.Generator().manual_seed(2))
    held = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(9))
    teacher = tiny_llama(seed=3)
    cfg = SimpleNamespace(steps=8, batch_size=8, lr=3e-3, seed=0)
    kl = {}
    for name, distill in (("qad", {"loss": loss}), ("plain", None)):
        model = copy.deepcopy(teacher)
        cb = FP4QATCallback(policy="fp_embeddings", calibration=16, distillation=distill,
                            calibration_data=[data[:16, :-1]], forward_fn=lambda m, b: m.net(b))  # fmt: skip
        train_lm(model, data, cfg, tmp_path, [cb], name)
        if distill:
            assert ("hidden_mse" in cb.distiller.last) == (loss == "kl_mse")
        with torch.no_grad():
            kl[name] = float(kd_loss(model.eval()(held).logits, teacher.eval()(held).logits))
    assert kl["qad"] < 0.5 * kl["plain"], kl
