"""Accuracy side by side over repeated seeds (#9): the peers and our main variants, perplexity and
multiple-choice accuracy, mean and spread over seeds.

Rows (same data, steps and optimizer as ``bench_accuracy.py``; the seed sets the order of the Emma
training batches and Lightning's seed): the BF16 fine-tune; modelopt's plain QAT (``NVFP4_DEFAULT_CFG``,
no policy, no schedule); torchao's NVFP4 QAT (``peer_torchao``: its own quantize-dequantize and
backward, FP4 GEMM emulated on the CPU); ours direct and progressive (default policy), and ours
with the MLP activations in FP8 (``nvfp4_w4a8``: NVFP4 weights). Each QAT row's recovery is against
the PTQ of the same configuration (the fine-tune quantized the same way, no training).

Run: ``.venv-core/bin/python benchmarks/bench_accuracy_seeds.py [--seeds 0 1 2] [--quick]``
(about 25 minutes per seed on 2 cores, plus 20 for the multiple-choice scores of the first seed;
``--quick``: a 4-step smoke run of the whole script).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings
from dataclasses import replace
from pathlib import Path

from accuracy_data import load_accuracy_data
from common import RESULTS_DIR, machine, pyplot, save_figure
from peer_torchao import TORCHAO_VERSION, prepare_torchao_nvfp4_qat, torchao_available

from nemo_fp4qat import FP4QATCallback
from nemo_fp4qat.demo.pipeline import DemoConfig
from nemo_fp4qat.demo.training import train_lm
from nemo_fp4qat.eval.evaluation import multiple_choice_accuracy
from nemo_fp4qat.eval.gate import recovery
from nemo_fp4qat.eval.tasks import next_sentence_tasks

MC_TASKS = 100
FT = "bf16 fine-tuned (baseline)"
# QAT row -> the PTQ row it is measured against
PTQ_OF = {
    "modelopt plain QAT (NVFP4_DEFAULT_CFG)": "PTQ modelopt NVFP4_DEFAULT_CFG",
    f"torchao {TORCHAO_VERSION} NVFP4 QAT": "PTQ torchao NVFP4",
    "ours direct (default policy)": "PTQ default",
    "ours progressive (default policy)": "PTQ default",
    "ours progressive, nvfp4_w4a8": "PTQ nvfp4_w4a8",
}


# Multiple choice costs about 3.5 minutes per model on 2 cores (100 tasks x 4 choices): scored for these
# rows on the first seed only (--mc-seeds); with 100 tasks its standard error (~0.05) is larger than the
# differences seeds would resolve.
MC_ROWS = {FT, "PTQ default", "modelopt plain QAT (NVFP4_DEFAULT_CFG)", f"torchao {TORCHAO_VERSION} NVFP4 QAT",
           "ours progressive (default policy)", "ours progressive, nvfp4_w4a8"}  # fmt: skip


def run_seed(seed: int, base_cfg: DemoConfig, out: Path, mc_tasks: int) -> dict[str, dict]:
    import lightning.pytorch as pl
    import modelopt.torch.quantization as mtq

    cfg = replace(base_cfg, seed=seed)
    pl.seed_everything(seed)
    data = load_accuracy_data(cfg)
    base, train, calib, ptq = data.base, data.train, data.calib, data.ptq
    tasks = next_sentence_tasks(data.book, n=mc_tasks, seed=0) if mc_tasks else []  # same tasks for every seed
    rows: dict[str, dict] = {}

    def record(name: str, model, t0: float) -> None:
        wall = time.time() - t0
        rows[name] = {"ppl": data.ppl(model), "wall_s": wall}
        if mc_tasks and name in MC_ROWS:
            rows[name].update(multiple_choice_accuracy(model, data.tok, tasks))
        print(f"seed {seed} | {name}: {rows[name]}", flush=True)

    def ours(name: str, policy: str, schedule: str) -> None:
        m, t0 = copy.deepcopy(base), time.time()
        cb = FP4QATCallback(policy=policy, schedule=schedule, calibration=cfg.calib_samples, calibration_data=calib,
                            forward_fn=lambda x, b: x.net(b))  # fmt: skip
        train_lm(m, train, cfg, out, [cb], f"s{seed}_{name}")
        record(name, m, t0)

    calib_loop = lambda m: [m(b) for b in calib]  # noqa: E731
    t0 = time.time()
    ft = copy.deepcopy(base)
    train_lm(ft, train, cfg, out, [], f"s{seed}_finetune")
    record(FT, ft, t0)
    for policy in ("default", "nvfp4_w4a8"):
        t0 = time.time()
        record(f"PTQ {policy}", ptq(ft, policy), t0)
    t0 = time.time()
    record("PTQ modelopt NVFP4_DEFAULT_CFG", mtq.quantize(copy.deepcopy(ft), mtq.NVFP4_DEFAULT_CFG, calib_loop), t0)
    t0 = time.time()
    mo = mtq.quantize(copy.deepcopy(base), mtq.NVFP4_DEFAULT_CFG, calib_loop)
    train_lm(mo, train, cfg, out, [], f"s{seed}_modelopt")
    record("modelopt plain QAT (NVFP4_DEFAULT_CFG)", mo, t0)
    if torchao_available() is None:
        t0 = time.time()
        record("PTQ torchao NVFP4", prepare_torchao_nvfp4_qat(copy.deepcopy(ft)), t0)
        t0 = time.time()
        tao = prepare_torchao_nvfp4_qat(copy.deepcopy(base))
        train_lm(tao, train, cfg, out, [], f"s{seed}_torchao")
        record(f"torchao {TORCHAO_VERSION} NVFP4 QAT", tao, t0)
    ours("ours direct (default policy)", "default", "direct")
    ours("ours progressive (default policy)", "default", "progressive")
    ours("ours progressive, nvfp4_w4a8", "nvfp4_w4a8", "progressive")
    for name, ref in PTQ_OF.items():
        if name in rows:
            rows[name]["recovery"] = recovery(rows[ref]["ppl"], rows[name]["ppl"], rows[FT]["ppl"])
    return rows


def _mean_sd(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def summarize(per_seed: dict[int, dict[str, dict]], cfg: DemoConfig, mc_tasks: int, mc_seeds: list[int]) -> str:
    seeds = sorted(per_seed)
    names = list(per_seed[seeds[0]])
    lines = [
        "## Accuracy over seeds: peers and our main variants (SmolLM2-135M, Emma -> Persuasion)",
        "",
        f"Machine: {machine()}. Seeds {', '.join(map(str, seeds))} (batch order + Lightning seed); per seed every "
        f"training run: {cfg.steps} steps x {cfg.batch_size} x {cfg.seq_len} tokens, AdamW lr {cfg.lr}, calibration "
        f"{cfg.calib_samples} samples. Mean ± standard deviation over seeds. Perplexity on Persuasion "
        f"({cfg.eval_windows} x {cfg.eval_window} tokens); multiple choice (MC): {mc_tasks} next-sentence tasks "
        f"from Persuasion (4 choices, chance 0.25; standard error ~{(0.25 / max(mc_tasks, 1)) ** 0.5:.2f}), seed "
        f"{', '.join(map(str, mc_seeds))} only, main rows only. Recovery against the PTQ of the same configuration. "
        "`benchmarks/bench_accuracy_seeds.py`.",
        "",
        "| variant | perplexity | recovery | MC acc | MC acc_norm |",
        "|---|---|---|---|---|",
    ]
    for n in names:
        vals = [per_seed[s][n] for s in seeds if n in per_seed[s]]
        rec = _mean_sd([v["recovery"] for v in vals]) if "recovery" in vals[0] else "-"
        mc = [v for v in vals if "acc" in v]
        acc = _mean_sd([v["acc"] for v in mc]) if mc else "-"
        acc_norm = _mean_sd([v["acc_norm"] for v in mc]) if mc else "-"
        lines.append(f"| {n} | {_mean_sd([v['ppl'] for v in vals])} | {rec} | {acc} | {acc_norm} |")
    reason = torchao_available()
    if reason:
        lines += ["", f"torchao rows not run: {reason}."]
    lines += ["", "![perplexity by variant](results/accuracy_seeds.png)", ""]
    return "\n".join(lines)


def plot(per_seed: dict[int, dict[str, dict]], path: Path) -> None:
    plt = pyplot()

    seeds = sorted(per_seed)
    names = list(per_seed[seeds[0]])
    means = [statistics.mean(per_seed[s][n]["ppl"] for s in seeds) for n in names]
    sds = [statistics.stdev([per_seed[s][n]["ppl"] for s in seeds]) if len(seeds) > 1 else 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.2))
    colors = ["tab:green" if n.startswith("ours") else "tab:gray" if n.startswith(("PTQ", "bf16")) else "tab:orange"
              for n in names]  # fmt: skip
    ax.barh(range(len(names)), means, xerr=sds, color=colors)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"perplexity on Persuasion (lower is better), mean ± sd over {len(seeds)} seed(s)")
    ax.set_xlim(min(means) * 0.9, max(means) * 1.05)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--mc-seeds", type=int, nargs="*", default=None, help="seeds scored on multiple choice "
                    "(default: the first)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="4-step smoke run; writes to runs/, not results/")
    args = ap.parse_args()
    mc_seeds = args.seeds[:1] if args.mc_seeds is None else args.mc_seeds
    warnings.filterwarnings("ignore")
    cfg = DemoConfig.quick() if args.quick else DemoConfig()
    mc_tasks = 8 if args.quick else MC_TASKS
    out = Path("runs/bench_accuracy_seeds")
    dest = out if args.quick else RESULTS_DIR
    dest.mkdir(parents=True, exist_ok=True)
    per_seed: dict[int, dict[str, dict]] = {}
    for seed in args.seeds:
        per_seed[seed] = run_seed(seed, cfg, out, mc_tasks if seed in mc_seeds else 0)
        # written after every seed: a stopped run keeps what it measured
        (dest / "accuracy_seeds.json").write_text(json.dumps({str(s): r for s, r in per_seed.items()}, indent=1))
        (dest / "accuracy_seeds.md").write_text(summarize(per_seed, cfg, mc_tasks, mc_seeds))
        plot(per_seed, dest / "accuracy_seeds.png")
    print((dest / "accuracy_seeds.md").read_text())


if __name__ == "__main__":
    main()
