"""The GPU acceptance run rehearsed on the CPU (``benchmarks/gpu_check.py --cpu``), so it cannot rot while no GPU
is available: every section runs end to end at tiny sizes, and its JSON renders."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from paths import ROOT

# core environment only: the exact CUDA kernel's interpreter runs need triton, installed in the core environment


def test_gpu_check_runs_end_to_end_on_the_cpu_and_renders(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads((tmp_path / "gpu_check.json").read_text())
    assert d["errors"] == []

    # parity: the exact path equals the CPU kernel on every NVFP4 case; modelopt's CUDA kernels are not run here
    nvfp4 = [p for p in d["parity"] if p["format"] == "nvfp4"]
    assert len(nvfp4) == 18 and all(p["exact"] == {"mismatches": 0, "max_abs_diff": 0.0} for p in nvfp4)
    assert {p["format"] for p in d["parity"]} == {"nvfp4", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8", "fp8"}
    assert all("skipped" in p["modelopt"] for p in d["parity"])

    # QAD -> both exports validated code for code, and the deployed export scores what the trained model scores
    q = d["qad"]
    assert set(q["exports"]) == {"trtllm", "hf"}
    for kind, e in q["exports"].items():
        assert e.get("validated") is True, (kind, e)
        assert e["fp4_codes_compared"] > 0 and e["fp4_codes_different_exact"] == 0
        assert abs(e["ppl_cpu"] / q["trained_ppl"] - 1) < 1e-3, (kind, e["ppl_cpu"], q["trained_ppl"])

    for key in ("step", "step_1b", "step_accum"):
        st = d[key]
        assert st["bf16"]["step_s"] > 0 and st["qat_exact"]["step_s"] > 0 and "skipped" in st["qat_modelopt"]
    # 4 micro-batches per step: each weight quantized once per step, reused by the other 3
    fq = d["step_accum"]["qat_exact"]["weight_fake_quant"]
    assert fq["computed"] > 0 and fq["reused"] == 3 * fq["computed"]
    pr = d["profile"]
    assert pr["bf16"]["ms_by_category"]["matrix products"] > 0 and pr["qat_exact"]["operators"] > 0
    alone = pr["qat_exact"]["fake_quant_alone"]
    assert alone["weights_elements"] > 0 and alone["inputs_ms"] > 0
    assert "skipped" in d["nemo"]
    assert "skipped" in d["megatron"]  # no megatron-core in this environment (the nemo one runs the section)

    # qad_budget: at each budget a fine-tune, both starts and QAD at every learning rate, exported and served
    qb = d["qad_budget"]
    plan = qb["plan"]
    assert qb["skipped"] == [] and not [r for r in qb["rows"] if "error" in r]
    qad_rows = [r for r in qb["rows"] if r["run"].startswith("qad ")]
    assert {(r["tokens"], r["start"], r["lr"]) for r in qad_rows} == {
        (t, s, lr) for t in plan["budgets"] for s in plan["starts"] for lr in plan["qad_lrs"]
    }
    assert all(r["export"] == "validated" and r["ppl"] > 0 for r in qad_rows)
    # what is served computes what trained (its unquantized weights trained at the export's dtype): the export's
    # perplexity is the model's in memory
    assert all(abs(r["ppl"] / r["in_memory"] - 1) < 1e-6 for r in qad_rows)  # fmt: skip
    finetunes = {r["tokens"]: r for r in qb["rows"] if r["run"] == "finetune"}
    assert set(finetunes) == set(plan["budgets"]) and "mc" in finetunes[plan["budgets"][0]]

    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render_gpu.py"), "--src",
                           str(tmp_path / "gpu_check.json"), "--dst", str(tmp_path / "gpu_check.md")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| nvfp4 | 62400 | not run | 0 |" in md
    assert "| trtllm | True |" in md and "| hf | True |" in md
    assert "4 micro-batches per step" in md and "One step under torch's profiler" in md
    assert "QAD at a real token budget" in md and "| 256 | qad gptq | 5e-05 |" in md


def test_a_spent_time_budget_skips_the_remaining_sections_by_name(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--budget-s", "0",
                           "--only", "step", "megatron", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "--only step" in d["step"]["skipped"] and "--only megatron" in d["megatron"]["skipped"]
    assert "qad" not in d and "parity" not in d
    d["qad"] = {"skipped": "the run's time budget (0 s) was spent; run it with --only qad"}  # as a cut-short run writes
    (tmp_path / "gpu_check.json").write_text(json.dumps(d))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render_gpu.py"), "--src",
                           str(tmp_path / "gpu_check.json"), "--dst", str(tmp_path / "gpu_check.md")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "gpu_check.md").read_text()
    assert "--only step" in md and "--only qad" in md
