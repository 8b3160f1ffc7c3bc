"""Weight fake quant reused across the micro-batches of an optimizer step (:mod:`nemo_fp4qat.numerics.weight_reuse`):
the run is the same bit for bit, each weight is quantized once per step, and every way a weight or its scale can
change between two forwards makes it quantize again."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import modelopt.torch.quantization as mtq
import pytest
import torch

from nemo_fp4qat import FP4QATCallback
from nemo_fp4qat.numerics import weight_reuse as wr

from tiny_models import LitLM, loader, tiny_llama

# the nemo environment trains every NeMo test with reuse on (its callbacks start it); the mechanism is tested here


@pytest.fixture
def reuse():
    wr.weight_reuse_stats(reset=True)
    wr.reuse_weight_fake_quant(True)
    yield
    wr.reuse_weight_fake_quant(False)


def _quantized_linear(cfg=mtq.NVFP4_DEFAULT_CFG) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 48))
    mtq.quantize(m, copy.deepcopy(cfg), lambda mm: mm(torch.randn(16, 64)))
    return m


def _fresh(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What ``m`` computes on ``x`` with nothing kept."""
    wr.clear_weight_reuse()
    return m(x)


@pytest.mark.parametrize("cfg", [mtq.NVFP4_DEFAULT_CFG, mtq.FP8_DEFAULT_CFG], ids=["nvfp4", "fp8"])
def test_a_weight_is_quantized_once_and_its_gradients_are_unchanged(reuse, cfg):
    m, ref = _quantized_linear(cfg), None
    ref = copy.deepcopy(m)
    xs = [torch.randn(4, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for x in xs:  # three micro-batches, gradients accumulated
        m(x).square().mean().backward()
    assert wr.weight_reuse_stats() == {"computed": 1, "reused": 2}  # the activations were quantized every time
    wr.reuse_weight_fake_quant(False)
    for x in xs:
        ref(x).square().mean().backward()
    wr.reuse_weight_fake_quant(True)
    assert torch.equal(m[0].weight.grad, ref[0].weight.grad) and torch.equal(m[0].bias.grad, ref[0].bias.grad)


def test_an_in_place_update_quantizes_again(reuse):
    m, x = _quantized_linear(), torch.randn(4, 64)
    m(x)
    with torch.no_grad():
        m[0].weight.mul_(1.5)  # bumps the version counter
    assert torch.equal(m(x), _fresh(m, x))


def test_a_step_of_any_optimizer_drops_what_was_kept(reuse):
    """megatron-core's pattern: its torch optimizer steps float32 main weights, which are then copied into the
    model's through ``.data`` (no version bump, same storage): only the step hook tells the weight changed."""
    m, x = _quantized_linear(), torch.randn(4, 64)
    main = m[0].weight.detach().clone().requires_grad_(True)
    opt = torch.optim.SGD([main], lr=1.0)
    before = m(x)
    main.grad = torch.randn_like(main)
    opt.step()
    m[0].weight.data.copy_(main.detach())
    after = m(x)
    assert not torch.equal(after, before) and torch.equal(after, _fresh(m, x))


def test_off_keeps_nothing():
    wr.weight_reuse_stats(reset=True)
    m, x = _quantized_linear(), torch.randn(4, 64)
    m(x), m(x)
    assert wr.weight_reuse_stats() == {"computed": 0, "reused": 0} and not wr.weight_reuse_active()


def _fit(accumulate: int) -> tuple[dict, list[float]]:
    torch.manual_seed(0)
    lit = LitLM(tiny_llama(hidden=64), lr=1e-3)
    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    # progressive: formats switch (and recalibrate) inside the run, on a step's first micro-batch
    cb = FP4QATCallback(policy="default", schedule="progressive", calibration=16, distillation="qad",
                        module_getter=lambda m: m.net, forward_fn=lambda m, b: m(b[:, :-1]))  # fmt: skip
    trainer = pl.Trainer(max_steps=4, accumulate_grad_batches=accumulate, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb, Losses()])  # fmt: skip
    trainer.fit(lit, loader(n=48, batch_size=4))
    assert not wr.weight_reuse_active()  # training ended: off, nothing kept
    return lit.net.state_dict(), losses


def test_lightning_accumulation_trains_bit_for_bit_with_one_quantization_per_step(monkeypatch):
    wr.weight_reuse_stats(reset=True)
    with_reuse, losses = _fit(accumulate=3)
    stats = wr.weight_reuse_stats(reset=True)
    assert stats["computed"] > 0 and stats["reused"] == 2 * stats["computed"]  # 3 micro-batches: 1 + 2 each step
    monkeypatch.setenv("NEMO_FP4QAT_WEIGHT_REUSE", "0")
    without, ref_losses = _fit(accumulate=3)
    assert wr.weight_reuse_stats() == {"computed": 0, "reused": 0}
    assert losses == ref_losses
    assert with_reuse.keys() == without.keys()
    assert all(torch.equal(with_reuse[k], without[k]) for k in with_reuse)
