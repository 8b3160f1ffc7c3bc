"""The data and helpers both accuracy benchmarks share: the demo model, Emma training windows in a
seeded order, Persuasion validation tokens, calibration batches, perplexity and PTQ by policy."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_fp4qat import QATController
from nemo_fp4qat.demo.model import load_corpus, load_smollm2
from nemo_fp4qat.demo.pipeline import DemoConfig
from nemo_fp4qat.demo.training import token_windows, train_lm
from nemo_fp4qat.eval.evaluation import evaluate


@dataclass
class AccuracyData:
    cfg: DemoConfig
    base: Any  # the original SmolLM2 (fp32)
    tok: Any
    book: str  # Persuasion, the held-out text
    train: torch.Tensor  # steps * batch_size windows of Emma, seeded order: every run sees the same batches
    val: torch.Tensor
    calib: list[torch.Tensor]

    def ppl(self, model: Any) -> float:
        return evaluate(model, self.val, window=self.cfg.eval_window).as_dict()["ppl"]

    def finetune(self, out: Path, name: str = "finetune") -> Any:
        """The BF16 fine-tune of a copy of ``base`` on ``train`` (the demo's stage 2); its logs go under ``out``."""
        ft = copy.deepcopy(self.base)
        train_lm(ft, self.train, self.cfg, out, [], name)
        return ft

    def ptq(self, model: Any, policy: Any, smoothing: Any = None, block_scale_search: bool | float = False,
            **calibration_fields: Any) -> Any:  # fmt: skip
        """A calibrated copy of ``model`` quantized by ``policy`` (the original is left as it was); further
        ``CalibrationConfig`` fields (``weight_scale``, ``act_scale``) as keywords."""
        m = copy.deepcopy(model)
        calibration = {"num_samples": self.cfg.calib_samples, "smoothing": smoothing,
                       "block_scale_search": block_scale_search, **calibration_fields}  # fmt: skip
        ctl = QATController(policy=policy, calibration=calibration, forward_fn=lambda x, b: x(b))
        ctl.prepare(m)
        ctl.calibrate(m, self.calib)
        return m


def load_accuracy_data(cfg: DemoConfig | None = None) -> AccuracyData:
    cfg = cfg or DemoConfig()
    base, tok = load_smollm2()
    train_ids = tok(load_corpus("emma"))["input_ids"]
    book = load_corpus("persuasion")
    val = torch.tensor(tok(book)["input_ids"][: cfg.eval_window * cfg.eval_windows])
    train = token_windows(train_ids, 0, cfg.seq_len)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed))
    train = train[order][: cfg.steps * cfg.batch_size]
    calib = list(token_windows(train_ids[len(train_ids) // 2 :], cfg.calib_samples, cfg.seq_len)[:, :-1].split(8))
    return AccuracyData(cfg, base, tok, book, train, val, calib)
