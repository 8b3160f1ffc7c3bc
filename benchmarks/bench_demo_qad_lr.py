"""The demo's QAD stage on its own policy against its learning rate: does QAD do more than the levers' PTQ?

On the demo's policy (``smollm2_auto``, AutoQuantize's choice at the ``default`` preset's bits) the recipe's PTQ
(gate/up smoothing, block scale search) already lands close to QAD at the demo's learning rate (43.200 vs
43.136 in ``demo.md``). This measures the demo's setting (SmolLM2-135M, one BF16 fine-tune on Emma per seed,
Persuasion held out, the demo's step budget) with the QAD stage at several learning rates: each QAD row is
exported, validated and measured as served (``bench_levers.qad_row``); the PTQ rows (max calibration, and the
recipe's levers: where QAD starts) are measured once per seed. The seed orders the training windows and seeds
the run, as in ``recipe_seeds``.

Run: ``.venv-core/bin/python benchmarks/bench_demo_qad_lr.py [--seed 0] [--lr 2e-5 5e-5 1e-4] [--quick]``; rows
are merged into ``benchmarks/results/demo_qad_lr.{json,md}`` as they finish (a seed's earlier rows are kept when
its fine-tune reproduces). About 4 minutes per learning rate and 3 per seed's fine-tune and PTQ on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from accuracy_data import load_accuracy_data
from bench_levers import qad_row
from common import RESULTS_DIR, machine, rerender, write_result

from nemo_fp4qat.demo.pipeline import DemoConfig
from nemo_fp4qat.eval.gate import recovery


def _saved() -> dict:
    path = RESULTS_DIR / "demo_qad_lr.json"
    if not path.is_file():
        return {"seeds": {}}
    return json.loads(path.read_text())


def main() -> None:
    import lightning.pytorch as pl

    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, nargs="+", default=[2e-5, 5e-5, 1e-4], help="QAD learning rates")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smoke run of the whole script")
    ap.add_argument("--render", action="store_true", help="only rewrite demo_qad_lr.md from demo_qad_lr.json")
    args = ap.parse_args()
    if args.render:
        rerender("demo_qad_lr", render)
        return
    cfg = replace(DemoConfig.quick() if args.quick else DemoConfig(), seed=args.seed)
    policy = cfg.layer_policy()
    out = Path("runs/bench_demo_qad_lr")
    pl.seed_everything(cfg.seed)
    data = load_accuracy_data(cfg)
    ft = data.finetune(out)
    ft_ppl = data.ppl(ft)
    result = _saved()
    result.update(machine=machine(), config={**vars(cfg), "seed": None})
    run = result["seeds"].get(str(cfg.seed))
    if run is None or abs(run["bf16_finetuned"] - ft_ppl) > 1e-6 * ft_ppl:
        run = {"bf16_finetuned": ft_ppl, "rows": []}
        ptq_rows = {"ptq": (None, False), "ptq_recipe": (cfg.smoothing, cfg.block_scale_search)}
        for name, (smoothing, search) in ptq_rows.items():
            m = data.ptq(ft, policy, smoothing, search)
            run[name] = data.ppl(m)
            del m
    result["seeds"][str(cfg.seed)] = run
    for lr in args.lr:
        t0 = time.time()
        pl.seed_everything(cfg.seed)
        d = replace(data, cfg=replace(cfg, qad_lr=lr))
        row = {"qad_lr": lr, **qad_row(ft, d, out, policy, cfg.smoothing, cfg.block_scale_search)}
        row["gap"] = row["qad"] / ft_ppl - 1
        row["recovery"] = recovery(run["ptq"], row["qad"], ft_ppl)
        row["recovery_vs_recipe_ptq"] = recovery(run["ptq_recipe"], row["qad"], ft_ppl)
        row["wall_s"] = time.time() - t0
        run["rows"] = sorted([r for r in run["rows"] if r["qad_lr"] != lr] + [row], key=lambda r: r["qad_lr"])
        print({k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        write_result("demo_qad_lr", render(result), result)


def render(d: dict) -> str:
    cfg = d["config"]
    lines = [
        "## The demo's QAD against its learning rate, on the demo's policy (`benchmarks/bench_demo_qad_lr.py`)",
        "",
        f"Machine: {d['machine']}. The demo's setting: SmolLM2-135M, policy `{cfg['policy']}`, a BF16 fine-tune per "
        f"seed ({cfg['steps']} steps of {cfg['batch_size']} x {cfg['seq_len']} tokens on Emma; the seed orders the "
        "windows and seeds the run); PTQ of it with max calibration and with the recipe's levers (where QAD "
        f"starts); QAD: {cfg['qad_steps'] or cfg['steps']} steps, KL to the fine-tune, direct schedule, exported, "
        "validated and measured as served. Perplexity on Persuasion; gap = QAD / fine-tune - 1.",
        "",
        "| seed | BF16 fine-tune | PTQ | PTQ (recipe) | QAD lr | QAD | gap to BF16 | recovery (max-calibrated PTQ) "
        "| recovery (recipe PTQ) | export |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    by_lr: dict[float, list[float]] = {}
    for seed, run in sorted(d["seeds"].items()):
        for r in run["rows"]:
            by_lr.setdefault(r["qad_lr"], []).append(r["gap"])
            lines.append(
                f"| {seed} | {run['bf16_finetuned']:.3f} | {run['ptq']:.3f} | {run['ptq_recipe']:.3f} | "
                f"{r['qad_lr']:g} | {r['qad']:.3f} | {100 * r['gap']:.1f}% | {r['recovery']:.3f} | "
                f"{r['recovery_vs_recipe_ptq']:.3f} | {r['export']} |"
            )
    n = len(d["seeds"])
    full = {lr: g for lr, g in by_lr.items() if len(g) == n}
    if n > 1 and full:
        lines += ["", "| QAD lr | seeds | gap to BF16, mean +- sd |", "|---:|---:|---:|"]
        lines += [f"| {lr:g} | {n} | {100 * statistics.mean(g):.1f}% +- {100 * statistics.stdev(g):.1f} |"
                  for lr, g in sorted(full.items())]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
