"""``deploy_dtype``: a float32 run trains its unquantized weights rounded to the dtype its checkpoint holds them in,
so the served checkpoint computes what trained; without it the served model is the trained one with its norms and
embeddings rounded afterwards."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch

from nemo_fp4qat import FP4QATCallback, QATConfig
from nemo_fp4qat.export.deployed_model import load_deployed_model
from nemo_fp4qat.qat.deploy_precision import DeployPrecision

from tiny_models import VOCAB, LitLM, loader, tiny_llama

pytestmark = pytest.mark.twice("the Lightning front end over modelopt 0.37's quantizers and transformers 4.57's models")


class _SeenNorm(pl.Callback):
    """What the final norm's forward reads as its weight during a training step."""

    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        norm = pl_module.net.model.norm
        self.handle = norm.register_forward_pre_hook(
            lambda m, a: self.seen.append((m.weight.detach().clone(), m._parameters["weight"].detach().clone()))
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.handle.remove()


def _train(tmp_path, deploy_dtype):
    lit = LitLM(tiny_llama(hidden=64), lr=1e-3)
    seen = _SeenNorm()
    cb = FP4QATCallback(policy="default", schedule="direct", calibration=16, distillation="qad",
                        export_dir=str(tmp_path / "export"), export={"kind": "hf"}, deploy_dtype=deploy_dtype,
                        module_getter=lambda m: m.net, forward_fn=lambda m, b: m(b[:, :-1]))  # fmt: skip
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, seen])  # fmt: skip
    trainer.fit(lit, loader(n=32))
    return lit.net, load_deployed_model(tmp_path / "export").model, seen.seen


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def test_the_served_checkpoint_computes_what_trained_with_the_deploy_dtype(tmp_path):
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    trained, served, seen = _train(tmp_path / "on", "float16")
    # every training forward read the norm's weight rounded to float16 (its parameter stays float32 and moves)
    assert len(seen) >= 4 and seen[0][1].dtype == torch.float32 and not torch.equal(seen[0][1], seen[-1][1])
    for used, _param in seen:
        assert torch.equal(used, used.half().float())
    # the float32 weights trained on: their forward in the run is the rounded one, which the checkpoint holds
    assert trained.model.norm.weight.dtype == torch.float32
    hooks = DeployPrecision("float16")
    assert hooks.install(trained) > 0
    assert torch.equal(_logits(trained, tokens), _logits(served, tokens))
    hooks.remove()
    assert not torch.equal(_logits(trained, tokens), _logits(served, tokens))  # the float32 weights are not those
    # without it the checkpoint rounds weights the run never saw
    trained_off, served_off, seen_off = _train(tmp_path / "off", None)
    assert all(torch.equal(used, param) for used, param in seen_off)
    assert any(not torch.equal(used, used.half().float()) for used, _ in seen_off)
    assert not torch.equal(_logits(trained_off, tokens), _logits(served_off, tokens))


def test_rounded_weights_pass_gradients_straight_through_and_come_back_as_parameters():
    model = tiny_llama(hidden=64)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    hooks = DeployPrecision("bfloat16")
    # per layer 2 norms and 7 linears; the final norm, the embedding, lm_head
    assert hooks.install(model) == 2 * (2 + 7) + 3
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    out, ref = model(tokens).logits, reference(tokens).logits
    assert torch.equal(out, ref)
    out.square().mean().backward()
    ref.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert type(p) is torch.nn.Parameter and p.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)  # straight through: the same gradient
    hooks.remove()
    assert not model._forward_pre_hooks and torch.equal(model(tokens).logits, model(tokens).logits)


def test_by_default_a_float32_run_trains_in_the_dtype_its_engine_export_holds_and_a_float32_export_needs_none(tmp_path):
    """``deploy_dtype="auto"`` (the default): an engine's checkpoint of a float32 model holds float16 unquantized
    tensors, so the run trains them in float16 and the served model computes what trained; a float32 export (this
    plugin's server) rounds nothing, so nothing is rounded in training."""
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    trained, served, seen = _train(tmp_path / "engine", "auto")
    assert seen and all(torch.equal(used, used.half().float()) for used, _ in seen)
    hooks = DeployPrecision("float16")
    hooks.install(trained)
    assert torch.equal(_logits(trained, tokens), _logits(served, tokens))
    hooks.remove()
    lit = LitLM(tiny_llama(hidden=64), lr=1e-3)
    cb = FP4QATCallback(policy="default", schedule="direct", calibration=8, export_dir=str(tmp_path / "fp32"),
                        export={"kind": "hf", "runtime": "pytorch"}, module_getter=lambda m: m.net,
                        forward_fn=lambda m, b: m(b[:, :-1]))  # fmt: skip
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])  # fmt: skip
    trainer.fit(lit, loader(n=8))
    assert cb.deploy_precision is None
    assert torch.equal(_logits(lit.net, tokens), _logits(load_deployed_model(tmp_path / "fp32").model, tokens))


def test_an_unknown_deploy_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match=r"deploy_dtype='float8'.*float16"):
        QATConfig(deploy_dtype="float8")
