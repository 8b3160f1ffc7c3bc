"""Training a Hugging Face causal LM on token windows with Lightning: what the demo and the accuracy benchmarks
run (the same batches in the same order for every variant of a comparison)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["token_windows", "train_lm"]


def token_windows(ids: Any, n: int, seq: int) -> Any:
    """Consecutive windows of ``seq + 1`` tokens (inputs and the next-token targets) as a [windows, seq + 1] tensor;
    the first ``n`` (all when ``n`` is 0)."""
    import torch

    usable = (len(ids) // (seq + 1)) * (seq + 1)
    t = torch.tensor(ids[:usable]).view(-1, seq + 1)
    return t[:n] if n else t


def train_lm(
    model: Any, data: Any, cfg: Any, out: Path, callbacks: list, name: str, lr: float | None = None, steps: int = 0
) -> list[float]:
    """Train ``model`` (a causal LM) on the token windows ``data`` with a Lightning ``Trainer`` on the CPU and
    ``callbacks``; ``cfg`` gives ``steps``, ``batch_size``, ``lr`` and ``seed`` (a :class:`DemoConfig`; ``lr`` /
    ``steps`` override). Returns the per-step losses. The batches are shuffled with ``cfg.seed``, so runs that
    share it see the same batches in the same order."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    losses: list[float] = []

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, tokens):
            return self.net(tokens).logits

        def training_step(self, batch, _):
            logits = self(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            losses.append(float(loss.detach()))
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr or cfg.lr)

    g = torch.Generator().manual_seed(cfg.seed)  # both runs see the same batches in the same order
    loader = DataLoader(data, batch_size=cfg.batch_size, shuffle=True, generator=g)
    trainer = pl.Trainer(max_steps=steps or cfg.steps, accelerator="cpu", default_root_dir=str(out / name),
                         enable_checkpointing=False, log_every_n_steps=1, callbacks=callbacks,
                         enable_model_summary=False)  # fmt: skip
    trainer.fit(LM(), loader)
    return losses
