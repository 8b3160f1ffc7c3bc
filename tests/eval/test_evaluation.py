"""Evaluation metrics against hand-computed values; the quality gate passes and fails as configured."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

from nemo_fp4qat.eval.evaluation import multiple_choice_accuracy, perplexity, quantized_weight_memory
from nemo_fp4qat.eval.gate import QualityGate, recovery, write_report

# core environment only: evaluation reads models through the plugin's own code, tested once


class Bigram(nn.Module):
    """logits[t] = table[token[t]]: next-token probabilities known in closed form."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table.clone())

    def forward(self, ids):
        return self.table[ids]


def test_perplexity_of_uniform_model_is_vocab_size():
    v = 37
    ppl = perplexity(Bigram(torch.zeros(v, v)), torch.randint(0, v, (1000,)), window=100)
    assert ppl["ppl"] == pytest.approx(v, rel=1e-5)  # float32 logits
    assert ppl["tokens"] == 10 * 99  # 10 windows, first token of each not scored


def test_perplexity_matches_hand_computed_bigram_nll():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(5, 5, generator=g)
    ids = torch.randint(0, 5, (23,), generator=g)
    res = perplexity(Bigram(table), ids, window=4, max_windows=5, batch_size=2)
    logp = torch.log_softmax(table.double(), -1).numpy()
    w = ids[:20].view(5, 4).numpy()
    nll = -np.mean([logp[r[i], r[i + 1]] for r in w for i in range(3)])
    assert res["nll"] == pytest.approx(nll, rel=1e-6) and res["ppl"] == pytest.approx(math.exp(nll), rel=1e-6)
    with pytest.raises(ValueError, match="at least 50 tokens"):
        perplexity(Bigram(table), ids, window=50)


class CharTok:
    """Character-level tokenizer over 'abcde' (the tokenizer interface `evaluation` uses)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": ["abcde".index(c) for c in text]}


def test_multiple_choice_picks_the_likeliest_continuation():
    table = torch.full((5, 5), -5.0)
    table[0, 1] = 5.0  # after 'a' comes 'b'
    table[1] = 0.0
    table[1, 2] = 0.3  # after 'b', 'c' is only a little likelier than the rest
    table[0, 3] = 4.0  # 'd' is second best after 'a'
    tasks = [
        {"input": "a", "choices": ["d", "b"], "answer": 1},
        {"input": "ab", "choices": ["c", "e"], "answer": 0},
        {"input": "a", "choices": ["bc", "d"], "answer": 1},  # total ll prefers 'd'; per-token prefers 'bc'
    ]
    res = multiple_choice_accuracy(Bigram(table), CharTok(), tasks)
    assert res["acc"] == pytest.approx(1.0) and res["acc_norm"] == pytest.approx(2 / 3)


def test_weight_memory_counts_scales_and_full_precision_parts():
    mtq = pytest.importorskip("modelopt.torch.quantization")
    m = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
    mtq.quantize(m, mtq.NVFP4_DEFAULT_CFG, lambda mm: mm(torch.randn(2, 64)))
    m[1].weight_quantizer.disable()
    mem = quantized_weight_memory(m)
    expect = 64 * 32 * 4.5 / 8 + (32 + 32 * 8 + 8) * 2
    assert mem["bytes"] == pytest.approx(expect)
    assert mem["ratio_vs_bf16"] == pytest.approx(expect / ((64 * 32 + 32 + 32 * 8 + 8) * 2))


VARIANTS = {
    "bf16": {"ppl": 30.0, "acc": 0.50},
    "bf16_finetuned": {"ppl": 20.0, "acc": 0.60},
    "ptq": {"ppl": 24.0, "acc": 0.55},
    "qat": {"ppl": 20.08, "acc": 0.595},
}


def test_recovery_and_gate():
    assert recovery(24.0, 20.08, 20.0) == pytest.approx(0.98)
    assert QualityGate(max_ppl_increase_pct=0.5).check(VARIANTS).passed  # +0.4%, -0.5 points
    res = QualityGate(max_ppl_increase_pct=0.3).check(VARIANTS)
    assert not res.passed and res.failures[0].startswith("perplexity") and "0.40% above" in res.failures[0]
    res = QualityGate(max_acc_drop=0.2).check(VARIANTS)
    assert not res.passed and res.failures[0].startswith("accuracy")
    with pytest.raises(ValueError, match="needs variant 'qat'"):
        QualityGate().check({"bf16_finetuned": VARIANTS["bf16_finetuned"]})


def test_report_files_and_gate_cli_exit_codes(tmp_path):
    full = {
        k: {**v, "tokens_per_s": 100.0, "bits_per_weight": 4.5, "weight_ratio_vs_bf16": 0.3}
        for k, v in VARIANTS.items()
    }
    rep = write_report(
        tmp_path, full, loss_curves={"qat": [3.0, 2.5, 2.2]}, switches=[{"step": 1, "group": "mlp", "to": "nvfp4"}]
    )
    assert rep["recovery"] == pytest.approx(0.98)
    assert json.loads((tmp_path / "report.json").read_text())["recovery"] == pytest.approx(0.98)
    assert "| qat | 20.080 |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "perplexity_by_variant.png").stat().st_size > 1000 and (tmp_path / "loss_curves.png").exists()
    cli = [sys.executable, "-m", "nemo_fp4qat.cli", "eval", "--report", str(tmp_path / "report.json"), "--gate"]
    ok = subprocess.run(cli, capture_output=True, text=True)
    assert ok.returncode == 0 and "PASSED" in ok.stdout
    bad = subprocess.run([*cli, "--max-ppl-increase", "0.1"], capture_output=True, text=True)
    assert bad.returncode == 1 and "quality gate FAILED: perplexity" in bad.stderr
