"""Plain Lightning + Hugging Face Llama: NVFP4 QAT through the callback trains on the CPU."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from nemo_fp4qat import FP4QATCallback

from tiny_models import LitLM, loader, tiny_llama

pytestmark = pytest.mark.twice("the Lightning front end over modelopt 0.37's quantizers and transformers 4.57's models")


def _trainer(cb, steps, **kw):
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
        **kw,
    )


def test_nvfp4_qat_trains_with_decreasing_loss_and_finite_grads():
    lit = LitLM(tiny_llama())
    cb = FP4QATCallback(policy="fp_embeddings", schedule="direct", calibration=32)
    grads_finite = []

    class GradCheck(pl.Callback):
        def on_after_backward(self, trainer, pl_module):
            grads_finite.append(all(torch.isfinite(p.grad).all() for p in pl_module.parameters() if p.grad is not None))

    trainer = _trainer(cb, 16)
    trainer.callbacks.append(GradCheck())
    trainer.fit(lit, loader())
    q = lit.net.model.layers[0].mlp.down_proj
    assert q.weight_quantizer.is_enabled and q.weight_quantizer.num_bits == (2, 1)
    assert q.weight_quantizer.block_sizes[-1] == 16
    assert not lit.net.lm_head.weight_quantizer.is_enabled
    assert len(grads_finite) == 16 and all(grads_finite)
    first, last = sum(lit.losses[:3]) / 3, sum(lit.losses[-3:]) / 3
    assert last < first - 0.5, lit.losses
