"""Run by test_ddp.py: 2-process CPU DDP (gloo) QAT; each rank dumps its amax and stage."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from nemo_fp4qat import FP4QATCallback

from tiny_models import VOCAB, LitLM, tiny_llama


def _amaxes(module: torch.nn.Module) -> dict[str, list[float]]:
    return {n: m._amax.flatten().tolist() for n, m in module.named_modules() if getattr(m, "_amax", None) is not None}


class Dump(pl.Callback):
    def __init__(self, out: Path, cb: FP4QATCallback) -> None:
        self.out, self.cb = out, cb

    def on_train_start(self, trainer, pl_module):  # runs after FP4QATCallback.on_train_start
        self.after_calib = _amaxes(pl_module)
        self.calib_first = [int(b[0, 0]) for b in self.cb.controller.calib_batches]

    def on_train_end(self, trainer, pl_module):
        amax = {
            n: m._amax.flatten().tolist() for n, m in pl_module.named_modules() if getattr(m, "_amax", None) is not None
        }
        rec = {
            "rank": trainer.global_rank,
            "amax": amax,
            "current": self.cb.controller.current,
            "history": self.cb.controller.history,
            "calib_rows": sum(b.shape[0] for b in self.cb.controller.calib_batches),
            "after_calib": self.after_calib,
            "calib_first": self.calib_first,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(rec))


def main(out: str) -> None:
    out_p = Path(out)
    cb = FP4QATCallback(
        policy="default",
        schedule={"stages": [{"start": 0, "format": "fp8"}, {"start": 4, "format": "target"}]},
        calibration=32,
    )
    # shuffle=False + DistributedSampler: each rank calibrates on different rows
    # distinct random rows: each rank's calibration samples differ, so unsynced amax would differ
    rows = torch.randint(0, VOCAB, (128, 33), generator=torch.Generator().manual_seed(1))
    data = DataLoader(rows, batch_size=8)
    trainer = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb, Dump(out_p, cb)],
    )
    torch.manual_seed(0)
    trainer.fit(LitLM(tiny_llama(seed=4)), data)


if __name__ == "__main__":
    main(sys.argv[1])
