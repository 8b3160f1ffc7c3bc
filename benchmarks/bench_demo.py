"""The demo as a benchmark: wall time of `make demo`'s pipeline, its gap to BF16 and its recovery.

gap to BF16 = ppl_QAT / ppl_BF16_finetuned - 1 (the headline: no PTQ baseline can inflate it; target
< 10%); recovery = (ppl_PTQ - ppl_QAT) / (ppl_PTQ - ppl_BF16_finetuned) against plain max-calibrated PTQ (at
least 0.4, target 0.64, modelopt's published figure) and against the recipe's own PTQ (its levers on),
with every variant measured in the same run on the same data; the QAT
row is the exported checkpoint as deployed. Pass ``--report runs/demo/report.json`` to record a demo
that already ran instead of running it again.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent


def _acc(variant: dict) -> str:
    return "-" if variant.get("acc") is None else f"{100 * variant['acc']:.1f}%"


def main(report_path: str | None = None) -> dict:
    from common import machine, write_result

    from nemo_fp4qat.eval.gate import versus_finetune_cells

    if report_path is None:
        from nemo_fp4qat.demo.pipeline import run_demo

        out = Path(tempfile.mkdtemp(prefix="nemo_fp4qat_demo_"))
        t = time.time()
        run_demo(out_dir=str(out))
        wall = time.time() - t
        report = json.loads((out / "report.json").read_text())
    else:
        report = json.loads(Path(report_path).read_text())
        wall = report["wall_time_s"]
    v, rec, cfg = report["variants"], report["recovery"], report["config"]
    gap = report.get("gap_to_bf16")
    mon = report.get("monitor_measure_s")
    finetuned = v["bf16_finetuned"]["ppl"] if "bf16_finetuned" in v else None
    method = report.get("qat_method", f"plain QAT ({cfg.get('schedule')})")
    md = "\n".join([
        "## Demo (`make demo`): wall time, gap to BF16 and recovery",
        "",
        f"Machine: {machine()}. SmolLM2-135M (fp32 on CPU), train on *Emma*, validate on *Persuasion* "
        f"({cfg['eval_windows']} x {cfg['eval_window']} tokens); {cfg['steps']} steps of "
        f"{cfg['batch_size']} x {cfg['seq_len']} tokens, AdamW lr {cfg['lr']} (fine-tune), policy `{cfg['policy']}`, "
        f"calibration {cfg['calib_samples']} samples. QAT row: {method}, measured on the exported "
        "(validated) checkpoint as served.",
        "",
        "| variant | perplexity | vs fine-tune (95% CI) | lm-eval acc | vs fine-tune (paired) | bits/weight "
        "| weights vs bf16 |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *[f"| {k} | {x['ppl']:.3f} | {versus_finetune_cells(x)[0]} | {_acc(x)} | {versus_finetune_cells(x)[1]} | "
          f"{x['bits_per_weight']:.2f} | {x['weight_ratio_vs_bf16']:.3f} |" for k, x in v.items()],
        *([f"lm-eval acc: lm-evaluation-harness, task `{report['lm_eval']['task']}` (next sentence of the held-out "
           f"book, {report['lm_eval']['limit']} documents, offline). vs fine-tune: the perplexity ratio - 1 with its "
           f"95% t interval over the {cfg['eval_windows']} validation windows; the accuracy difference with "
           "McNemar's exact p over the documents. The demo's evaluation is small: `qad_levers.md` scores 32,768 "
           "tokens and 600 tasks."] if report.get("lm_eval") else []),
        "",
        *([f"- gap to BF16 fine-tune: **{100 * gap:.1f}%** (target < 10%: {'met' if gap < 0.10 else 'NOT met'})"]
          if gap is not None else []),
        f"- recovery against max-calibrated PTQ (`ptq`): **{rec:.3f}** (at least 0.4: "
        f"{'met' if rec >= 0.4 else 'NOT met'}; target 0.64: {'met' if rec >= 0.64 else 'NOT met'})",
        *([f"- recovery against the recipe's own PTQ (`ptq_recipe`, the QAT stage's start): "
           f"**{report['recovery_vs_recipe_ptq']:.3f}**"] if "recovery_vs_recipe_ptq" in report else []),
        *([f"- the trained weights read in float32 (in memory, before export): perplexity "
           f"{report['qat_in_memory_ppl']:.3f}, gap {100 * (report['qat_in_memory_ppl'] / finetuned - 1):.1f}%. "
           f"The served checkpoint (runtime `{report.get('export_runtime')}`) holds the unquantized tensors "
           "(embeddings, norms, lm_head) in float16, as the engines run them; their rounding flips NVFP4 activation "
           "codes. "
           + (f"The QAT stage trained them rounded to {cfg['deploy_dtype']} (`deploy_dtype`), so the served row is "
              "what trained" if cfg.get("deploy_dtype") else "The QAT stage trained them in float32")]
          if report.get("qat_in_memory_ppl") and "bf16_finetuned" in v else []),
        *([f"- monitor measurement at each switch and at the end (all {len(mon)}): max **{max(mon):.1f} s** "
           f"(target < 5 s: {'met' if max(mon) < 5 else 'NOT met'})"] if mon else []),
        f"- wall time: **{wall:.0f} s** (budget 600 s: {'met' if wall <= 600 else 'NOT met'}; includes the one-time "
        "GGUF conversion only on a first run)",
        "",
    ])  # fmt: skip
    write_result("demo", md, {"report": report, "wall_s": wall})
    print(md)
    return report


if __name__ == "__main__":
    main(sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "--report" else None)
