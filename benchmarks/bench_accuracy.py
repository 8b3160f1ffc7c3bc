"""Accuracy side by side (#9): PTQ, modelopt's plain QAT, our QAT variants, policy presets, and
PTQ repair, on the demo model and corpus with the same data and step budget per training run.

SmolLM2-135M (fp32 on the CPU), fine-tuning data: Emma; validation: Persuasion (perplexity,
8 x 256 tokens). Every training run: 20 steps of 4 x 128 tokens, AdamW lr 1e-4, same batches in
the same order (seeded). ``recovery = (ppl_PTQ - ppl_QAT) / (ppl_PTQ - ppl_BF16_finetuned)`` with
the PTQ of the same layer policy. One seed (each run takes minutes on 2 cores).

Run: ``.venv-core/bin/python benchmarks/bench_accuracy.py`` (about 35 minutes on 2 cores).
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from pathlib import Path

from accuracy_data import load_accuracy_data
from common import RESULTS_DIR, machine

from nemo_fp4qat import FP4QATCallback
from nemo_fp4qat.demo.pipeline import DemoConfig
from nemo_fp4qat.demo.training import train_lm
from nemo_fp4qat.eval.gate import recovery

PRESETS = ["fp_embeddings", "aggressive_mlp", "conservative_attention", "trtllm_mixed"]


def main() -> None:
    import lightning.pytorch as pl
    import modelopt.torch.quantization as mtq

    warnings.filterwarnings("ignore")
    cfg = DemoConfig()
    pl.seed_everything(cfg.seed)
    out = Path("runs/bench_accuracy")
    data = load_accuracy_data(cfg)
    base, train, calib, ppl, ptq = data.base, data.train, data.calib, data.ppl, data.ptq
    rows: dict[str, dict] = {}

    def record(name: str, model, t0: float, **info) -> None:
        rows[name] = {"ppl": ppl(model), "train_s": time.time() - t0, **info}
        print(f"{name}: {rows[name]}", flush=True)

    def ours(name: str, start, policy="default", schedule="direct", distill=None, teacher_note="") -> None:
        m = copy.deepcopy(start)
        cb = FP4QATCallback(policy=policy, schedule=schedule, calibration=cfg.calib_samples, calibration_data=calib,
                            forward_fn=lambda x, b: x.net(b), distillation=distill)  # fmt: skip
        t0 = time.time()
        train_lm(m, train, cfg, out, [cb], name)
        record(name, m, t0, policy=policy, schedule=schedule, distillation=distill, note=teacher_note)

    t0 = time.time()
    rows["bf16 original"] = {"ppl": ppl(base), "train_s": 0.0}
    ft = copy.deepcopy(base)
    train_lm(ft, train, cfg, out, [], "finetune")
    record("bf16 fine-tuned (baseline)", ft, t0)
    for policy in ["default", *PRESETS]:
        t0 = time.time()
        record(f"PTQ {policy}", ptq(ft, policy), t0, policy=policy)
    mo = copy.deepcopy(base)
    t0 = time.time()
    mtq.quantize(mo, mtq.NVFP4_DEFAULT_CFG, forward_loop=lambda m: [m(b) for b in calib])
    train_lm(mo, train, cfg, out, [], "modelopt_qat")
    record("modelopt plain QAT (NVFP4_DEFAULT_CFG)", mo, t0, policy="modelopt NVFP4_DEFAULT_CFG")
    mo_ptq = copy.deepcopy(ft)
    mtq.quantize(mo_ptq, mtq.NVFP4_DEFAULT_CFG, forward_loop=lambda m: [m(b) for b in calib])
    record("PTQ modelopt NVFP4_DEFAULT_CFG", mo_ptq, time.time())
    ours("ours direct", base)
    ours("ours progressive", base, schedule="progressive")
    ours("ours progressive + QAD (alpha 0.5, teacher original)", base, schedule="progressive", distill={"alpha": 0.5})
    for policy in PRESETS:
        ours(f"ours direct, policy {policy}", base, policy=policy)
    # PTQ repair: start from the fine-tuned model (PTQ'd by the callback's calibration), 20 more steps
    ours("repair: QAT from fine-tuned (LM loss)", ft, teacher_note="20 extra steps after the fine-tune")
    ours("repair: QAD from fine-tuned (teacher = fine-tuned BF16)", ft, distill={"alpha": 1.0},
         teacher_note="20 extra steps after the fine-tune")  # fmt: skip

    ref = rows["bf16 fine-tuned (baseline)"]["ppl"]
    for name, r in rows.items():
        pol = r.get("policy")
        key = "PTQ modelopt NVFP4_DEFAULT_CFG" if pol == "modelopt NVFP4_DEFAULT_CFG" else f"PTQ {pol}"
        if pol and not name.startswith("PTQ") and key in rows:
            r["recovery"] = recovery(rows[key]["ppl"], r["ppl"], ref)
    lines = ["## Accuracy side by side (SmolLM2-135M, Emma -> Persuasion)", "",
             f"Machine: {machine()}. {cfg.steps} steps x {cfg.batch_size} x {cfg.seq_len} tokens per training run, "
             f"AdamW lr {cfg.lr}, calibration {cfg.calib_samples} samples, one seed. Recovery against the PTQ of the "
             "same policy and the BF16 fine-tune. `benchmarks/bench_accuracy.py`.", "",
             "| variant | perplexity | recovery | wall s |", "|---|---|---|---|"]  # fmt: skip
    for name, r in rows.items():
        rec = f"{r['recovery']:.3f}" if "recovery" in r else "-"
        lines.append(f"| {name} | {r['ppl']:.3f} | {rec} | {r['train_s']:.0f} |")
    peers = "torchao's NVFP4 QAT and repeated seeds: `benchmarks/bench_accuracy_seeds.py` (`make bench-accuracy`)."
    lines += ["", peers, ""]
    (RESULTS_DIR / "accuracy.md").write_text("\n".join(lines))
    (RESULTS_DIR / "accuracy.json").write_text(json.dumps(rows, indent=2, default=str))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
