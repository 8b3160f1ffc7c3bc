"""QAD's recovery against distinct training tokens: is the demo's shortfall its budget or the format's floor?

The demo's setting (SmolLM2-135M, Emma windows in the demo's seeded order, Persuasion held out) at several token
budgets. At each point the BF16 fine-tune and the QAD stage see the same distinct tokens (the first ``steps *
batch_size`` windows of the seeded order, each once), so the curve measures quantization recovery, not more domain
adaptation. Rows per point: the BF16 fine-tune; max-calibrated PTQ of it by the ``default`` preset (the recovery's
reference); QAD by the demo's recipe (``default`` policy, smoothing, block scale search; ``bench_levers.qad_row``:
exported, validated and measured as served); and QAD with NVFP4 weights only (W4A16: every decoder linear's weights
in NVFP4, activations in 16 bits), which shows how much of the gap the activations hold. The smallest point is the
demo's own budget (20 steps of 4 x 128 tokens).

Run: ``.venv-core/bin/python benchmarks/bench_qad_tokens.py [--tokens 10240 40960 163840] [--weights-only-max
40960] [--quick]``; each point is written as it finishes (``benchmarks/results/qad_tokens.{json,md}``), so a run cut
short keeps the points it measured. About 2 x 6 s per QAD step and 3 s per fine-tune step on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import replace
from pathlib import Path

from accuracy_data import load_accuracy_data
from bench_levers import qad_row
from bench_pareto import linear_bits
from common import RESULTS_DIR, machine, rerender, write_result

from nemo_fp4qat.demo.pipeline import DemoConfig
from nemo_fp4qat.demo.training import train_lm
from nemo_fp4qat.eval.gate import recovery
from nemo_fp4qat.qat.policy.rules import _ATTENTION, _EMBED_OUT_NORM, _MLP

# NVFP4 weights on every decoder linear, activations left in 16 bits: no TensorRT-LLM kernel (it runs NVFP4 weights
# with NVFP4 or FP8 inputs only), so it exports for this plugin's own server
W4A16 = {
    "rules": [_EMBED_OUT_NORM, {"patterns": _ATTENTION + _MLP, "weight": "nvfp4", "input": None, "group": "w4a16"}],
    "default": None,
    "name": "nvfp4_w4a16",
    "runtime": "pytorch",
}


def main() -> None:
    import lightning.pytorch as pl

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[10240, 40960, 163840],
                    help="distinct training tokens per point (multiples of batch_size x seq_len)")  # fmt: skip
    ap.add_argument("--weights-only-max", type=int, default=40960,
                    help="measure the W4A16 row up to this many tokens (its QAD costs as the recipe's)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a smoke run of the whole script")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--render", action="store_true", help="only rewrite qad_tokens.md from qad_tokens.json")
    ap.add_argument("--w4a16-only", action="store_true",
                    help="re-measure only the W4A16 rows of the points in qad_tokens.json (the fine-tune is "
                         "retrained and must reproduce its recorded perplexity)")  # fmt: skip
    args = ap.parse_args()
    if args.render:
        rerender("qad_tokens", render)
        return
    base_cfg = replace(DemoConfig.quick() if args.quick else DemoConfig(), seed=args.seed)
    per_step = base_cfg.batch_size * base_cfg.seq_len
    points = sorted({max(1, t // per_step) for t in args.tokens})
    out = Path("runs/bench_qad_tokens")
    pl.seed_everything(base_cfg.seed)
    data = load_accuracy_data(replace(base_cfg, steps=points[-1]))
    if len(data.train) < points[-1] * base_cfg.batch_size:
        raise SystemExit(f"Emma holds {len(data.train)} windows of {base_cfg.seq_len}: fewer than the largest point")
    if args.w4a16_only:
        result = json.loads((RESULTS_DIR / "qad_tokens.json").read_text())
        rows = result["rows"]
    else:
        rows = []
    for steps in points:
        t0 = time.time()
        cfg = replace(base_cfg, steps=steps)
        d = replace(data, cfg=cfg, train=data.train[: steps * cfg.batch_size])
        pl.seed_everything(cfg.seed)
        ft = copy.deepcopy(d.base)
        train_lm(ft, d.train, cfg, out, [], "finetune")
        ft_ppl = d.ppl(ft)
        if args.w4a16_only:
            row = next((r for r in rows if r["steps"] == steps), None)
            if row is None or abs(row["bf16_finetuned"] - ft_ppl) > 1e-6 * ft_ppl:
                raise SystemExit(f"{steps} steps: no recorded point, or its fine-tune did not reproduce ({ft_ppl})")
            row.update(w4a16_row(ft, d, out, cfg))
        else:
            row = {"steps": steps, "tokens": steps * per_step, "bf16_finetuned": ft_ppl}
            m = d.ptq(ft, "default")
            row["ptq"] = d.ppl(m)
            del m
            recipe = qad_row(ft, d, out, "default", cfg.smoothing, cfg.block_scale_search)
            row["qad"], row["qad_export"], row["qad_s"] = recipe["qad"], recipe["export"], recipe["qad_s"]
            if row["tokens"] <= args.weights_only_max:
                row.update(w4a16_row(ft, d, out, cfg))
            rows.append(row)
        row["gap"] = row["qad"] / ft_ppl - 1
        row["recovery"] = recovery(row["ptq"], row["qad"], ft_ppl)
        if "w4a16_qad" in row:
            row["w4a16_gap"] = row["w4a16_qad"] / ft_ppl - 1
        row["w4a16_wall_s" if args.w4a16_only else "wall_s"] = time.time() - t0
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        result = {"machine": machine(), "config": vars(base_cfg), "bits": {"default": linear_bits(data.base, "default"),
                  "w4a16": linear_bits(data.base, W4A16)}, "rows": rows}  # fmt: skip
        write_result("qad_tokens", render(result), result)


def w4a16_row(ft, d, out: Path, cfg: DemoConfig) -> dict:
    """PTQ and QAD of the fine-tune with NVFP4 weights only; the QAD is exported, validated and served."""
    m = d.ptq(ft, W4A16)
    ptq = d.ppl(m)
    del m
    wo = qad_row(ft, d, out, W4A16, None, cfg.block_scale_search)
    return {"w4a16_ptq": ptq, "w4a16_qad": wo["qad"], "w4a16_export": wo["export"]}


def render(d: dict) -> str:
    cfg = d["config"]
    lines = [
        "## QAD recovery against distinct training tokens (`benchmarks/bench_qad_tokens.py`)",
        "",
        f"Machine: {d['machine']}. SmolLM2-135M; Emma windows of {cfg['seq_len']} tokens in the demo's seeded order "
        f"(seed {cfg['seed']}), each seen once; perplexity on Persuasion. At each point the BF16 fine-tune and QAD "
        f"see the same tokens. PTQ: `default` preset, max calibration ({cfg['calib_samples']} samples). QAD: the "
        f"demo's recipe (`default`, {d['bits']['default']:.3f} bits/weight; smoothing, block scale search; KL to "
        f"the fine-tune, lr {cfg['qad_lr']}), exported, validated and measured as served. W4A16: NVFP4 weights "
        f"on every decoder linear ({d['bits']['w4a16']:.3f} bits/weight), activations in 16 bits. One seed.",
        "",
        "| tokens | steps | BF16 fine-tune | PTQ | QAD (recipe) | gap | recovery | W4A16 PTQ | W4A16 QAD | W4A16 gap |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    served = {r.get("w4a16_export") for r in d["rows"]} - {None, "validated"}
    for r in d["rows"]:
        wo = (
            f"{r['w4a16_ptq']:.3f} | {r['w4a16_qad']:.3f} | {100 * r['w4a16_gap']:.1f}%"
            if "w4a16_qad" in r
            else "- | - | -"
        )
        lines.append(
            f"| {r['tokens']:,} | {r['steps']} | {r['bf16_finetuned']:.3f} | {r['ptq']:.3f} | {r['qad']:.3f} | "
            f"{100 * r['gap']:.1f}% | {r['recovery']:.3f} | {wo} |"
        )
    if served:
        lines += ["", "W4A16 rows measured on the trained model in memory: its export was not validated "
                  f"({', '.join(sorted(x.strip() for x in served))})."]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
