"""A policy modelopt's AutoQuantize chose (``nemo_fp4qat.qat.policy.auto``) against the hand presets, at the same
bits per linear weight, PTQ and QAD (#36).

The demo's setting (SmolLM2-135M, BF16 fine-tune on Emma, the levers bench's recipe): each row quantizes a copy of
the fine-tune by a policy, PTQ (calibrated, no training) and QAD (KL to the fine-tune, direct schedule, exported
and measured as served, ``bench_levers.qad_row``). The auto policies are searched on the calibration batches with
modelopt's gradient sensitivity, under the budget the matching preset spends by modelopt's own count (NVFP4 4.5
bits, FP8 8, NVFP4 weights with FP8 activations 4). Each chosen policy is written to
``benchmarks/results/auto_policy_<name>.yaml``. Storage bits per decoder-linear weight (scales included) are
reported for every row, as on the Pareto plot.

Run: ``.venv-core/bin/python benchmarks/bench_auto_policy.py [--quick] [--seed 0]`` (about 20 minutes per seed on
2 cores). Writes ``benchmarks/results/auto_policy.{json,md}``. ``--seed N --only default auto_default`` measures
those rows for one more seed and merges them into ``benchmarks/results/auto_policy_seeds.{json,md}`` (seed 0 taken
from ``auto_policy.json``): mean and spread over the seeds measured.
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
from bench_pareto import linear_bits
from common import RESULTS_DIR, machine, rerender, write_result

from nemo_fp4qat import LayerPolicy
from nemo_fp4qat.demo.pipeline import DemoConfig
from nemo_fp4qat.eval.gate import recovery
from nemo_fp4qat.qat.policy.auto import auto_policy

# modelopt's effective bits of each (weight, input) format pair (QuantRecipe.compression x 16)
MODELOPT_BITS = {("nvfp4", "nvfp4"): 4.5, ("fp8", "fp8"): 8.0, ("nvfp4", "fp8"): 4.0, ("bf16", "bf16"): 16.0}
# row -> (preset, None) or (None, (formats, the preset whose modelopt bits are the budget))
ROWS: dict[str, tuple[str | None, tuple[tuple[str, ...], str] | None]] = {
    "preset default (FP8 attention, NVFP4 MLP)": ("default", None),
    "auto NVFP4/FP8 at default's bits": (None, (("nvfp4", "fp8"), "default")),
    "preset nvfp4_w4a8 (FP8 attention, NVFP4 W / FP8 A MLP)": ("nvfp4_w4a8", None),
    "auto NVFP4/FP8/W4A8 at nvfp4_w4a8's bits": (None, (("nvfp4", "fp8", "nvfp4_w4a8"), "nvfp4_w4a8")),
}
KEYS = dict(zip(("default", "auto_default", "w4a8", "auto_w4a8"), ROWS))  # --only's short names


def modelopt_bits(model, policy) -> float:
    """Effective bits over every linear layer as modelopt's AutoQuantize counts them (``lm_head``, kept in 16 bits
    by every policy here, included)."""
    mods = dict(model.named_modules())
    rows = [r for r in LayerPolicy.resolve_spec(policy).resolve(model).rows if r.quantizable]
    n = {r.module: mods[r.module].weight.numel() for r in rows}
    return sum(MODELOPT_BITS[(r.weight, r.input)] * n[r.module] for r in rows) / sum(n.values())


def main() -> None:
    import lightning.pytorch as pl

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a smoke run of the whole script")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="+", choices=list(KEYS), help="measure these rows and merge them into "
                    "auto_policy_seeds.{json,md} under --seed (auto_policy.json keeps its seed)")  # fmt: skip
    ap.add_argument("--render", action="store_true", help="only rewrite the markdown from the committed JSON")
    args = ap.parse_args()
    if args.render:
        rerender("auto_policy", render)
        if (RESULTS_DIR / "auto_policy_seeds.json").exists():
            rerender("auto_policy_seeds", render_seeds)
        return
    selected = {KEYS[k]: ROWS[KEYS[k]] for k in args.only} if args.only else ROWS
    cfg = replace(DemoConfig.quick() if args.quick else DemoConfig(), seed=args.seed)
    out = Path("runs/bench_auto_policy")
    pl.seed_everything(cfg.seed)
    data = load_accuracy_data(cfg)
    ft = data.finetune(out)
    ft_ppl = data.ppl(ft)
    print(f"fine-tune {ft_ppl:.3f}", flush=True)
    rows: dict[str, dict] = {}
    for name, (preset, auto) in selected.items():
        t0 = time.time()
        if auto is None:
            policy: LayerPolicy | str = preset
        else:
            formats, like = auto
            budget = modelopt_bits(ft, like)
            policy = auto_policy(ft, data.calib, budget, formats=formats, forward_fn=lambda m, b: m(b, labels=b),
                                 name=f"auto_{'_'.join(formats)}")  # fmt: skip
            path = RESULTS_DIR / f"auto_policy_{policy.name}{f'_seed{args.seed}' if args.only else ''}.yaml"
            policy.to_yaml(path, header=f"written by benchmarks/bench_auto_policy.py: modelopt auto_quantize on "
                           f"SmolLM2-135M (the demo's fine-tune), formats {', '.join(formats)}, budget {budget:.3f} "
                           f"effective bits ({like}'s)")  # fmt: skip
        search_s = time.time() - t0
        m = data.ptq(ft, policy)
        row = {"policy": policy if isinstance(policy, str) else policy.to_dict(), "search_s": search_s,
               "modelopt_bits": modelopt_bits(ft, policy), "storage_bits": linear_bits(ft, policy),
               "ptq": data.ppl(m)}  # fmt: skip
        del m
        row.update(qad_row(ft, data, out, policy, None, False))
        row["ptq_gap"], row["qad_gap"] = row["ptq"] / ft_ppl - 1, row["qad"] / ft_ppl - 1
        rows[name] = row
        print(f"{name}: {row['storage_bits']:.3f} bits, PTQ {row['ptq']:.3f}, QAD {row['qad']:.3f}", flush=True)
    base_ptq = rows[next(iter(ROWS))]["ptq"] if next(iter(ROWS)) in rows else None
    for r in rows.values():
        r["recovery_vs_default_ptq"] = recovery(base_ptq, r["qad"], ft_ppl) if base_ptq else None
    data_out = {"machine": machine(), "config": vars(cfg), "bf16_finetuned": ft_ppl, "rows": rows}
    if not args.only:
        write_result("auto_policy", render(data_out), data_out)
        return
    seeds_path = RESULTS_DIR / "auto_policy_seeds.json"
    seeds = json.loads(seeds_path.read_text()) if seeds_path.exists() else {"machine": machine(), "seeds": {}}
    if "0" not in seeds["seeds"]:  # seed 0: the rows auto_policy.json measured
        first = json.loads((RESULTS_DIR / "auto_policy.json").read_text())
        seeds["seeds"]["0"] = {"bf16_finetuned": first["bf16_finetuned"], "rows": first["rows"]}
    seeds["seeds"][str(args.seed)] = {"bf16_finetuned": ft_ppl, "rows": rows}
    seeds["config"] = vars(cfg)
    write_result("auto_policy_seeds", render_seeds(seeds), seeds)


def render_seeds(d: dict) -> str:
    """Mean and sample standard deviation over the seeds that measured a row."""
    names = [n for n in ROWS if all(n in s["rows"] for s in d["seeds"].values())]
    seeds = sorted(d["seeds"], key=int)
    lines = [
        "## AutoQuantize policy vs the default preset over seeds (`benchmarks/bench_auto_policy.py --only`)",
        "",
        f"Machine: {d['machine']}. The setting of `auto_policy.md` (SmolLM2-135M, BF16 fine-tune on Emma, PTQ and "
        f"QAD of it by each policy, the auto policy searched under the preset's budget), seeds {', '.join(seeds)}: "
        "the seed orders the training windows and seeds the run. Gap: perplexity over the seed's own fine-tune.",
        "",
        "| policy | seed | BF16 fine-tune | PTQ ppl | PTQ gap | QAD ppl | QAD gap |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    gaps: dict[str, dict[str, list[float]]] = {n: {"ptq": [], "qad": []} for n in names}
    for n in names:
        for s in seeds:
            ft, r = d["seeds"][s]["bf16_finetuned"], d["seeds"][s]["rows"][n]
            gaps[n]["ptq"].append(r["ptq"] / ft - 1)
            gaps[n]["qad"].append(r["qad"] / ft - 1)
            lines.append(f"| {n} | {s} | {ft:.3f} | {r['ptq']:.3f} | {100 * gaps[n]['ptq'][-1]:.1f}% | "
                         f"{r['qad']:.3f} | {100 * gaps[n]['qad'][-1]:.1f}% |")  # fmt: skip
    lines += ["", "| policy | seeds | PTQ gap, mean +- sd | QAD gap, mean +- sd |", "|---|---:|---:|---:|"]
    for n in names:
        ptq, qad = gaps[n]["ptq"], gaps[n]["qad"]
        sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0  # noqa: E731
        lines.append(f"| {n} | {len(seeds)} | {100 * statistics.mean(ptq):.1f}% +- {100 * sd(ptq):.1f} | "
                     f"{100 * statistics.mean(qad):.1f}% +- {100 * sd(qad):.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _layers(policy) -> str:
    if isinstance(policy, str):
        return "preset"
    counts = {r["group"]: len(r["patterns"]) // 2 for r in policy["rules"] if r["group"].startswith("auto_")}
    return ", ".join(f"{g[5:]} {n}" for g, n in counts.items())


def render(d: dict) -> str:
    cfg, ft = d["config"], d["bf16_finetuned"]
    lines = [
        "## AutoQuantize policy vs the hand presets at equal bits (`benchmarks/bench_auto_policy.py`)",
        "",
        f"Machine: {d['machine']}. SmolLM2-135M, BF16 fine-tune on Emma ({cfg['steps']} steps, seed {cfg['seed']}): "
        f"perplexity on Persuasion **{ft:.3f}**. Each row quantizes a copy of it: PTQ ({cfg['calib_samples']} "
        f"calibration samples) and QAD ({cfg['steps']} steps, KL to the fine-tune, lr {cfg['qad_lr']}; exported, "
        "validated and measured as served). Auto rows: `auto_policy` (modelopt `auto_quantize`, gradient scores on "
        "the calibration batches) under the preset's budget in modelopt's effective bits. One seed.",
        "",
        "| policy | linear layers chosen | bits/weight (storage) | modelopt bits | PTQ ppl | PTQ gap | QAD ppl | "
        "QAD gap | recovery vs default PTQ | search (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in d["rows"].items():
        lines.append(
            f"| {name} | {_layers(r['policy'])} | {r['storage_bits']:.3f} | {r['modelopt_bits']:.3f} | "
            f"{r['ptq']:.3f} | {100 * r['ptq_gap']:.1f}% | {r['qad']:.3f} | {100 * r['qad_gap']:.1f}% | "
            f"{r['recovery_vs_default_ptq']:.3f} | {r['search_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
