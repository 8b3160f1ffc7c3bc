"""`nemo-fp4qat demo` as a user runs it (the embedded SmolLM2-135M, a few steps): the terminal tells the
story in five stage lines and one table; the details go to files; both checkpoints are written validated."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

# core environment only: `make demo`'s pipeline runs in the core environment only


@pytest.mark.slow
def test_demo_prints_five_stages_and_writes_the_details_to_files(tmp_path):
    out = tmp_path / "demo"
    res = subprocess.run(
        [sys.executable, "-m", "nemo_fp4qat.cli", "demo", "--quick", "--steps", "2", "--qad-steps", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    stages = [m.group(1) for m in re.finditer(r"^(\d)/5 ", res.stdout, re.M)]
    assert stages == ["1", "2", "3", "4", "5"], res.stdout
    assert "gap to BF16" in res.stdout and "BF16 vs PTQ vs QAT" in res.stdout
    assert "PTQ of the fine-tune (policy 'smollm2_auto')" in res.stdout
    # the per-module policy table, library prints, the libraries' warnings and Lightning's set-up notes are not on
    # the terminal (stdout or stderr) ...
    terminal = res.stdout + res.stderr
    for noise in ("self_attn.q_proj", "Inserted", "GPU available", "quantization quality at step", "UserWarning",
                  "Found tied weight", "tokenizer"):  # fmt: skip
        assert noise not in terminal, noise
    assert len(res.stdout.splitlines()) < 40 and len(res.stderr.splitlines()) < 3, terminal
    # ... but in the files
    assert "model.layers.0.self_attn.q_proj" in (out / "policy_table.txt").read_text()
    log = (out / "demo.log").read_text()
    assert "Inserted" in log and "quantization quality at step" in log
    report = json.loads((out / "report.json").read_text())
    assert {"bf16", "bf16_finetuned", "ptq", "ptq_recipe", "qat"} <= set(report["variants"])
    # the recipe's PTQ is the QAD stage's start, measured there once it is calibrated (not calibrated twice)
    assert "from the recipe's PTQ: " in res.stdout and report["recovery_vs_recipe_ptq"] is not None
    assert log.count("Inserted") == 2  # modelopt quantized two copies of the fine-tune: max PTQ and the QAD stage
    # every variant scored by lm-evaluation-harness too (the shipped next-sentence task), its results JSON written
    assert all(0 <= v["acc"] <= 1 for v in report["variants"].values()), report["variants"]  # QAT: as deployed
    assert report["lm_eval"]["task"] == "fp4qat_next_sentence"
    # each row against the fine-tune on the same windows and documents: the gap's interval brackets the table's gap,
    # the accuracy difference is the paired one over the scored documents
    qat, ft = report["variants"]["qat"], report["variants"]["bf16_finetuned"]
    vs = qat["vs_finetuned"]
    assert vs["ppl"]["low"] < vs["ppl"]["gap"] < vs["ppl"]["high"]
    assert vs["ppl"]["gap"] == pytest.approx(report["gap_to_bf16"], rel=1e-3)
    assert vs["acc"]["n"] == len(ft["acc_outcomes"]) and vs["acc"]["diff"] == pytest.approx(qat["acc"] - ft["acc"])
    assert "vs fine-tune" in res.stdout
    scored = [json.loads(p.read_text()) for p in (out / "lm_eval").glob("*.json")]
    assert len(scored) >= len(report["variants"]) and all("fp4qat_next_sentence" in r["results"] for r in scored)
    for export in ("export", "export_trtllm"):
        assert json.loads((out / export / "validation.json").read_text())["ok"] is True


def test_the_demo_runs_the_policy_autoquantize_chose_and_the_benchmarks_measured():
    """The demo's default policy is, rule for rule, the table `benchmarks/bench_auto_policy.py` wrote for
    SmolLM2-135M at the `default` preset's bits (the one `auto_policy_seeds.md` measured against the preset)."""
    from pathlib import Path

    from nemo_fp4qat.demo.pipeline import DemoConfig
    from nemo_fp4qat.qat.policy.rules import LayerPolicy

    root = Path(__file__).resolve().parents[2]
    shipped = DemoConfig().layer_policy()
    measured = LayerPolicy.from_yaml(root / "benchmarks" / "results" / "auto_policy_auto_nvfp4_fp8.yaml")
    assert DemoConfig().policy == "smollm2_auto" and shipped.to_dict() == measured.to_dict()
    assert shipped.runtime == "trtllm"
    assert DemoConfig(policy="default").layer_policy().name == "default"  # the hand preset stays one flag away


def test_a_demo_policy_that_does_not_exist_is_refused_naming_the_choices():
    from nemo_fp4qat.demo.pipeline import DemoConfig
    from nemo_fp4qat.specs import ConfigError

    with pytest.raises(ConfigError, match=r"neither a preset.*The demo also takes: smollm2_auto\."):
        DemoConfig(policy="smollm2_autp")
