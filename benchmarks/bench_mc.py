"""The multiple-choice column (#17), with enough tasks and a paired test to separate the rows the tables claim apart.

The accuracy tables scored 100 next-sentence tasks (standard error ~0.05 per row), which cannot tell apart
rows a few points apart. Here the demo's rows are rebuilt on one seed (BF16 fine-tune; PTQ with max
calibration and with the demo's recipe; QAD without and with the recipe, and with FP8 MLP activations +
block scale search; every QAD model exported and scored as served) and each is scored on ``--tasks``
next-sentence tasks from Persuasion (4 choices, chance 0.25) through lm-evaluation-harness (the shipped
``fp4qat_next_sentence`` task, its per-document records). Pairs of rows are compared task by task
(:func:`nemo_fp4qat.eval.paired.paired_difference`: paired standard error and McNemar's exact test), which
separates differences that independent standard errors cannot.

Run: ``.venv-core/bin/python benchmarks/bench_mc.py [--tasks 600] [--quick]`` (about 50 minutes on 2 cores),
part of ``make bench-accuracy``. Writes ``benchmarks/results/mc.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import modelopt.torch.quantization as mtq
from accuracy_data import load_accuracy_data
from bench_levers import qad_served
from common import RESULTS_DIR, machine, pyplot, rerender, save_figure, write_result

from nemo_fp4qat.demo.pipeline import DemoConfig
from nemo_fp4qat.eval.harness import document_scores, run_lm_eval, write_local_tasks
from nemo_fp4qat.eval.paired import paired_difference

FT = "BF16 fine-tune"
# row -> (stage, policy, smoothing, block scale search); the recipe is the demo's default (DemoConfig)
_D = DemoConfig()
ROWS: dict[str, tuple[str, str, dict | None, bool | float]] = {
    "PTQ, max calibration": ("ptq", "default", None, False),
    "PTQ, demo recipe": ("ptq", "default", _D.smoothing, _D.block_scale_search),
    "QAD, no lever": ("qad", "default", None, False),
    "QAD, demo recipe (default)": ("qad", "default", _D.smoothing, _D.block_scale_search),
    "QAD, FP8 MLP activations + search": ("qad", "nvfp4_w4a8", None, True),
}
# (a, b): pairs of rows the README and the lever table claim apart
PAIRS = [
    (FT, "PTQ, max calibration"),
    ("PTQ, demo recipe", "PTQ, max calibration"),
    ("QAD, demo recipe (default)", "PTQ, max calibration"),
    ("QAD, demo recipe (default)", "QAD, no lever"),
    (FT, "QAD, demo recipe (default)"),
    ("QAD, FP8 MLP activations + search", "QAD, demo recipe (default)"),
]


def main() -> None:
    import lightning.pytorch as pl

    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=600, help="next-sentence tasks per row")
    ap.add_argument("--quick", action="store_true", help="4-step smoke run with 16 tasks")
    ap.add_argument("--render", action="store_true", help="only rewrite mc.md / .png from mc.json")
    args = ap.parse_args()
    if args.render:
        rerender("mc", render, plot)
        return
    cfg = DemoConfig.quick() if args.quick else DemoConfig()
    n_tasks = 16 if args.quick else args.tasks
    out = Path("runs/bench_mc")
    pl.seed_everything(cfg.seed)
    data = load_accuracy_data(cfg)
    task = "fp4qat_next_sentence"
    tasks_dir = write_local_tasks(out / "lm_eval_tasks", data.book, n_mc=n_tasks)
    rows: dict[str, dict] = {}
    outcomes: dict[str, list[tuple[bool, bool]]] = {}

    def score(name: str, model, ppl: float, seconds: float, **extra) -> None:
        t0 = time.time()
        slug = "".join(c if c.isalnum() else "_" for c in name.lower())
        results = run_lm_eval(model, data.tok, [task], include_path=tasks_dir, batch_size=8,
                              output=out / "lm_eval" / f"{slug}.json", log_samples=True)  # fmt: skip
        res = list(zip((s > 0 for s in document_scores(results, task, "acc")),
                       (s > 0 for s in document_scores(results, task, "acc_norm")), strict=True))  # fmt: skip
        assert len(res) == n_tasks, (len(res), n_tasks)
        outcomes[name] = res
        acc, acc_norm = (sum(r[i] for r in res) / len(res) for i in (0, 1))
        rows[name] = {"ppl": ppl, "acc": acc, "acc_norm": acc_norm, "build_s": seconds, "mc_s": time.time() - t0,
                      **extra}  # fmt: skip
        print(f"{name}: ppl {ppl:.3f}, MC acc {acc:.3f} (norm {acc_norm:.3f})", flush=True)

    t0 = time.time()
    ft = data.finetune(out)
    score(FT, ft, data.ppl(ft), time.time() - t0)
    for name, (stage, policy, smoothing, search) in ROWS.items():
        t0 = time.time()
        if stage == "ptq":
            m = data.ptq(ft, policy, smoothing, search)
            ppl = data.ppl(m)
            # the same function, faster: each weight replaced by its fake-quantized value once (modelopt's
            # fold_weight) instead of fake-quantized again in every forward
            mtq.fold_weight(m)
            score(name, m, ppl, time.time() - t0)
        else:
            row, m = qad_served(ft, data, out, policy, smoothing, search)
            score(name, m, row["qad"], time.time() - t0, export=row["export"])
        del m
    pairs = []
    for a, b in PAIRS:
        p = paired_difference([r[0] for r in outcomes[a]], [r[0] for r in outcomes[b]])
        pairs.append({"a": a, "b": b, **p.as_dict()})
    import lm_eval  # only where rows are measured: rendering runs in environments without it

    d = {"machine": machine(), "config": vars(cfg), "tasks": n_tasks, "lm_eval": lm_eval.__version__, "rows": rows,
         "pairs": pairs,
         "outcomes": {n: [[int(x), int(y)] for x, y in o] for n, o in outcomes.items()}}  # fmt: skip
    write_result("mc", render(d), d)
    plot(d, RESULTS_DIR / "mc.png")


def render(d: dict) -> str:
    cfg, n = d["config"], d["tasks"]
    indep = (0.25 / n) ** 0.5
    lines = [
        "## Multiple choice with a paired test (`benchmarks/bench_mc.py`)",
        "",
        f"Machine: {d['machine']}. SmolLM2-135M, seed {cfg['seed']}: the demo's rows rebuilt (fine-tune on Emma, "
        f"{cfg['steps']} steps; PTQ with {cfg['calib_samples']} calibration samples; QAD {cfg['steps']} steps at lr "
        f"{cfg['qad_lr']}, exported and scored as served). MC: {n} next-sentence tasks from Persuasion (4 choices, "
        f"chance 0.25; one row's standard error at most {indep:.3f}){_scorer(d)}",
        "",
        "| row | perplexity | MC acc | MC acc_norm |",
        "|---|---:|---:|---:|",
    ]
    for name, r in d["rows"].items():
        lines.append(f"| {name} | {r['ppl']:.3f} | {r['acc']:.3f} | {r['acc_norm']:.3f} |")
    lines += [
        "",
        "Pairs the tables claim apart, compared task by task on acc (difference a - b, paired standard error, "
        "tasks only a / only b answered right, McNemar's exact p; apart = p < 0.05):",
        "",
        "| a | b | acc a - b | paired SE | only a / only b | p | apart | tasks needed |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for p in d["pairs"]:
        apart = "yes" if p["p_value"] < 0.05 else "no"
        lines.append(f"| {p['a']} | {p['b']} | {p['diff']:+.3f} | {p['se']:.3f} | {p['only_a']} / {p['only_b']} | "
                     f"{p['p_value']:.3g} | {apart} | {_tasks_needed(p)} |")  # fmt: skip
    apart = [p for p in d["pairs"] if p["p_value"] < 0.05]
    lines += [
        "",
        "Tasks needed: how many tasks the same difference and disagreement rate would need to be apart (two-sided "
        f"z at 1.96 on the paired standard error); Persuasion yields {_usable_sentences()} usable sentences.",
        "",
        f"- {len(apart)} of {len(d['pairs'])} pairs apart on multiple choice at p < 0.05.",
        "",
        "![multiple choice](results/mc.png)",
        "",
    ]
    return "\n".join(lines) + "\n"


def _scorer(d: dict) -> str:
    """How the rows were scored: lm-evaluation-harness (results with its version), or the plugin's own scorer
    (results measured before the bench went through lm-eval)."""
    if "lm_eval" not in d:
        return "; acc picks the choice of highest total log-likelihood, acc_norm per token. Perplexity on Persuasion."
    return (
        f", scored by lm-evaluation-harness {d['lm_eval']} (`fp4qat_next_sentence`; its results JSON per row under "
        "runs/bench_mc/lm_eval/): acc picks the choice of highest total log-likelihood, acc_norm per byte of the "
        "choice (lm-eval's). Perplexity on Persuasion."
    )


def _usable_sentences() -> int:
    from nemo_fp4qat.demo.model import load_corpus
    from nemo_fp4qat.eval.tasks import split_sentences

    return len(split_sentences(load_corpus("persuasion")))


def _tasks_needed(p: dict) -> str:
    """Tasks at which this pair's difference would be 1.96 paired standard errors (SE shrinks as 1/sqrt(n))."""
    if p["diff"] == 0:
        return "-"
    sd = p["se"] * p["n"] ** 0.5
    return str(math.ceil((1.96 * sd / abs(p["diff"])) ** 2))


def plot(d: dict, path: Path) -> None:
    plt = pyplot()

    names = list(d["rows"])
    n = d["tasks"]
    acc = [d["rows"][k]["acc"] for k in names]
    err = [1.96 * (a * (1 - a) / n) ** 0.5 for a in acc]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    y = list(range(len(names)))
    ax1.barh(y, [d["rows"][k]["ppl"] for k in names], color="tab:blue")
    ax1.set_xlim(min(d["rows"][k]["ppl"] for k in names) * 0.95, max(d["rows"][k]["ppl"] for k in names) * 1.02)
    ax1.set_xlabel("perplexity on Persuasion (lower is better)")
    ax1.set_yticks(y, names, fontsize=8)
    ax1.invert_yaxis()
    ax2.barh(y, acc, xerr=err, color="tab:green", capsize=3)
    ax2.axvline(0.25, color="k", ls=":", label="chance")
    ax2.set_xlabel(f"MC accuracy, {n} tasks (95% interval of one row)")
    ax2.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
