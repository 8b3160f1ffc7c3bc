"""``make demo``: a short end-to-end FP4 QAT run (to be replaced by the full SmolLM2 pipeline).

Trains a small Llama (Hugging Face ``LlamaForCausalLM``, built from a config) on a learnable token
stream with :class:`FP4QATCallback` (default policy, progressive schedule), and prints the policy
table, the precision switches and the loss curve.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["run_demo"]


def run_demo(out_dir: str = "runs/demo", quick: bool = False) -> int:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    from transformers import LlamaConfig, LlamaForCausalLM

    from .callback import FP4QATCallback

    torch.manual_seed(0)
    vocab, seq = 128, 64
    phrases = torch.randint(0, vocab, (16, seq + 1))
    data = phrases[torch.randint(0, 16, (512,))]
    net = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    )

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, tokens):
            return self.net(tokens).logits

        def training_step(self, batch, _):
            logits = self(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=2e-3)

    steps = 8 if quick else 60
    cb = FP4QATCallback(policy="default", schedule="progressive", calibration=128)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        default_root_dir=out_dir,
        log_every_n_steps=5,
        enable_checkpointing=False,
        callbacks=[cb],
    )
    trainer.fit(Lit(), DataLoader(data, batch_size=16))
    print("precision switches:", *cb.controller.history, sep="\n  ")
    print(f"final loss {float(trainer.callback_metrics['loss']):.3f}; logs under {out_dir}")
    return 0
