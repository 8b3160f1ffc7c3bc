"""FP4 QAT of a Hugging Face Llama in plain Lightning: the callback is the only QAT-specific line.

Run: python examples/lightning_hf_qat.py   (a tiny randomly initialised Llama; swap in your model)
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from nemo_fp4qat import FP4QATCallback, QuantizationMonitor


class CausalLM(pl.LightningModule):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens).logits

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    torch.manual_seed(0)
    net = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    data = DataLoader(torch.randint(0, 256, (256, 65)), batch_size=16)
    trainer = pl.Trainer(
        max_steps=40,
        accelerator="auto",
        callbacks=[
            FP4QATCallback(policy="default", schedule="progressive", calibration=128),  # <- the QAT line
            QuantizationMonitor(every_n_steps=10),
        ],
    )
    trainer.fit(CausalLM(net), data)


if __name__ == "__main__":
    main()
