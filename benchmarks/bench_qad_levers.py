"""The accuracy levers side by side on the demo's policy, over seeds: a GPTQ start and the distillation losses.

The demo's setting (SmolLM2-135M, ``smollm2_auto`` policy, one BF16 fine-tune on Emma per seed, the demo's step
budget and QAD learning rate), scored so that it can decide: perplexity on 32,768 held-out tokens of Persuasion
(128 windows of 256) and multiple choice on 200 next-sentence tasks per seed through lm-evaluation-harness, a
different 200 for each seed (600 distinct tasks over 3 seeds). Rows:

* PTQ: max calibration (the recovery's reference), the demo's recipe (gate/up smoothing: where the demo's QAD
  starts), the recipe + modelopt's GPTQ (``CalibrationConfig.gptq``);
* QAD (each exported, validated and scored as served): the demo's (KL, from the recipe's PTQ), from the GPTQ
  start, with the JSD loss, with KL + last-hidden-state MSE.

Multiple choice is compared task by task against the BF16 fine-tune and against max PTQ
(:func:`nemo_fp4qat.eval.paired.paired_difference`), each seed's tasks pooled over the seeds measured.

Run: ``.venv-core/bin/python benchmarks/bench_qad_levers.py --seed 0 [--rows ...] [--mc ...] [--quick]``; each
seed's rows are merged into ``benchmarks/results/qad_levers.{json,md}`` as they finish (kept when the seed's
fine-tune reproduces). On 2 cores: about 7 minutes per multiple-choice row, 2 per perplexity, 2 per QAD and per
GPTQ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import modelopt.torch.quantization as mtq
from accuracy_data import load_accuracy_data
from bench_levers import qad_served
from common import RESULTS_DIR, machine, rerender, write_result

from nemo_fp4qat.demo.pipeline import DemoConfig
from nemo_fp4qat.eval.gate import recovery
from nemo_fp4qat.eval.harness import document_scores, run_lm_eval, write_local_tasks
from nemo_fp4qat.eval.paired import paired_difference

FT = "BF16 fine-tune"
PTQ_MAX = "PTQ, max"
TASKS_PER_SEED = 200
EVAL_WINDOWS = 128  # x 256 tokens: 32,768 held-out tokens
_R = DemoConfig().smoothing
# row -> (stage, calibration fields beyond the sample count, distillation, the PTQ row it starts from)
ROWS: dict[str, tuple[str, dict, object, str | None]] = {
    PTQ_MAX: ("ptq", {}, None, None),
    "PTQ, recipe": ("ptq", {"smoothing": _R}, None, None),
    "PTQ, recipe + GPTQ": ("ptq", {"smoothing": _R, "gptq": True}, None, None),
    "QAD, demo (KL)": ("qad", {"smoothing": _R}, "qad", "PTQ, recipe"),
    "QAD, GPTQ start (KL)": ("qad", {"smoothing": _R, "gptq": True}, "qad", "PTQ, recipe + GPTQ"),
    # a GPTQ-rounded start moved less: the same QAD at lower learning rates
    "QAD, GPTQ start (KL), lr 2e-5": (
        "qad",
        {"smoothing": _R, "gptq": True, "qad_lr": 2e-5},
        "qad",
        "PTQ, recipe + GPTQ",
    ),
    "QAD, GPTQ start (KL), lr 1e-5": (
        "qad",
        {"smoothing": _R, "gptq": True, "qad_lr": 1e-5},
        "qad",
        "PTQ, recipe + GPTQ",
    ),
    "QAD, JSD": ("qad", {"smoothing": _R}, {"loss": "jsd"}, "PTQ, recipe"),
    "QAD, KL + hidden MSE": ("qad", {"smoothing": _R}, {"loss": "kl_mse"}, "PTQ, recipe"),
}
# multiple choice (about 4 minutes a row on 2 cores) on the rows the issue's questions need: does QAD lose tasks
# against PTQ or the fine-tune, and does a GPTQ start change that
MC_ROWS = (FT, PTQ_MAX, "QAD, demo (KL)", "QAD, GPTQ start (KL)")


def _saved() -> dict:
    path = RESULTS_DIR / "qad_levers.json"
    return json.loads(path.read_text()) if path.is_file() else {"seeds": {}}


def _tasks(out: Path, book: str, seed: int, n: int) -> Path:
    """This seed's slice of the next-sentence tasks (seed s: tasks s*n .. s*n + n - 1 of Persuasion's)."""
    d = write_local_tasks(out / f"lm_eval_tasks_seed{seed}", book, n_mc=n * (seed + 1))
    f = d / "fp4qat_next_sentence.jsonl"
    lines = f.read_text().splitlines(keepends=True)
    if len(lines) < n * (seed + 1):
        raise SystemExit(f"Persuasion yields {len(lines)} tasks; seed {seed} needs {n * (seed + 1)}")
    f.write_text("".join(lines[n * seed : n * (seed + 1)]))
    return d


def main() -> None:
    import lightning.pytorch as pl

    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), help="only these rows (the fine-tune always)")
    ap.add_argument("--mc", nargs="+", choices=[FT, *ROWS], help=f"score multiple choice on these rows only "
                    f"(default: {', '.join(MC_ROWS)})")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a smoke run of the whole script")
    ap.add_argument("--render", action="store_true", help="only rewrite qad_levers.md from qad_levers.json")
    args = ap.parse_args()
    if args.render:
        rerender("qad_levers", render)
        return
    base = DemoConfig.quick() if args.quick else DemoConfig(eval_windows=EVAL_WINDOWS)
    cfg = replace(base, seed=args.seed)
    n_tasks = 8 if args.quick else TASKS_PER_SEED
    policy = cfg.layer_policy()
    out = Path("runs/bench_qad_levers")
    pl.seed_everything(cfg.seed)
    data = load_accuracy_data(cfg)
    tasks_dir = _tasks(out, data.book, args.seed, n_tasks)
    ft = data.finetune(out)
    ft_ppl = data.ppl(ft)
    result = _saved()
    result.update(machine=machine(), config={**vars(cfg), "seed": None}, tasks_per_seed=n_tasks)
    run = result["seeds"].get(str(cfg.seed))
    if run is None or abs(run["rows"][FT]["ppl"] - ft_ppl) > 1e-6 * ft_ppl:
        run = {"rows": {}}
    result["seeds"][str(cfg.seed)] = run

    mc_rows = args.mc or MC_ROWS

    def score(name: str, model, row: dict) -> None:
        old = run["rows"].get(name, {})
        if name not in mc_rows and "outcomes" in old and abs(old["ppl"] - row["ppl"]) <= 1e-6 * row["ppl"]:
            row.update({k: old[k] for k in ("acc", "outcomes", "mc_s") if k in old})  # the same model, scored before
        if name in mc_rows:
            t0 = time.time()
            slug = "".join(c if c.isalnum() else "_" for c in name.lower())
            res = run_lm_eval(model, data.tok, ["fp4qat_next_sentence"], include_path=tasks_dir, batch_size=8,
                              output=out / f"seed{args.seed}" / f"{slug}.json", log_samples=True)  # fmt: skip
            outcomes = [int(s > 0) for s in document_scores(res, "fp4qat_next_sentence", "acc")]
            assert len(outcomes) == n_tasks, (len(outcomes), n_tasks)
            row.update(acc=sum(outcomes) / n_tasks, outcomes=outcomes, mc_s=time.time() - t0)
        run["rows"][name] = row
        print(name, {k: round(v, 4) for k, v in row.items() if isinstance(v, float)}, flush=True)
        write_result("qad_levers", render(result), result)

    score(FT, ft, {"ppl": ft_ppl})
    for name, (stage, fields, distillation, start) in ROWS.items():
        if args.rows and name not in args.rows:
            continue
        t0 = time.time()
        pl.seed_everything(cfg.seed)
        if stage == "ptq":
            m = data.ptq(ft, policy, **fields)
            row = {"ppl": data.ppl(m), "build_s": time.time() - t0}
            mtq.fold_weight(m)  # the same function, each weight fake-quantized once instead of every forward
        else:
            smoothing = fields.get("smoothing")
            extra = {k: v for k, v in fields.items() if k not in ("smoothing", "qad_lr")}
            qrow, m = qad_served(ft, data, out, policy, smoothing, False, distillation=distillation,
                                 lr=fields.get("qad_lr"), **extra)  # fmt: skip
            row = {"ppl": qrow["qad"], "ppl_in_memory": qrow["qad_in_memory"], "build_s": qrow["qad_s"],
                   "export": qrow["export"], "start": start, "qad_lr": fields.get("qad_lr", cfg.qad_lr)}  # fmt: skip
        score(name, m, row)
        del m


def _pooled(d: dict, a: str, b: str) -> dict | None:
    """``a`` against ``b`` task by task over every seed that scored both."""
    xa, xb = [], []
    for run in d["seeds"].values():
        ra, rb = run["rows"].get(a), run["rows"].get(b)
        if ra and rb and "outcomes" in ra and "outcomes" in rb:
            xa += ra["outcomes"]
            xb += rb["outcomes"]
    return paired_difference(xa, xb).as_dict() if xa else None


def render(d: dict) -> str:
    cfg = d["config"]
    seeds = sorted(d["seeds"], key=int)
    tokens = cfg["eval_window"] * cfg["eval_windows"]
    lines = [
        "## Accuracy levers side by side on the demo's policy (`benchmarks/bench_qad_levers.py`)",
        "",
        f"Machine: {d['machine']}. SmolLM2-135M, policy `{cfg['policy']}`; per seed a BF16 fine-tune ({cfg['steps']} "
        f"steps of {cfg['batch_size']} x {cfg['seq_len']} tokens of Emma, the seed orders the windows); PTQ of it "
        f"with {cfg['calib_samples']} calibration samples; QAD {cfg['qad_steps'] or cfg['steps']} steps at lr "
        f"{cfg['qad_lr']} from the named PTQ, exported, validated and scored as served. Perplexity on {tokens:,} "
        f"held-out tokens of Persuasion; multiple choice on {d['tasks_per_seed']} next-sentence tasks per seed "
        "(lm-evaluation-harness, 4 choices; a different slice of Persuasion's tasks for each seed). Gap = ppl / "
        "fine-tune - 1; recovery = (PTQ - row) / (PTQ - fine-tune) against max PTQ and against the row's own start.",
        "",
        "| seed | row | perplexity | gap | recovery (max PTQ) | recovery (own PTQ) | MC acc |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    stats: dict[str, dict[str, list[float]]] = {}
    for s in seeds:
        rows = d["seeds"][s]["rows"]
        ft = rows[FT]["ppl"]
        ptq = rows.get(PTQ_MAX, {}).get("ppl")
        for name, r in rows.items():
            gap = r["ppl"] / ft - 1
            rec = recovery(ptq, r["ppl"], ft) if ptq and name != FT else None
            own = rows.get(r.get("start") or "", {}).get("ppl")
            rec_own = recovery(own, r["ppl"], ft) if own else None
            st = stats.setdefault(name, {"gap": [], "rec": [], "rec_own": []})
            st["gap"].append(gap)
            if rec is not None and name != PTQ_MAX:
                st["rec"].append(rec)
            if rec_own is not None:
                st["rec_own"].append(rec_own)
            acc = f"{r['acc']:.3f}" if "acc" in r else "-"
            lines.append(
                f"| {s} | {name} | {r['ppl']:.3f} | {100 * gap:.1f}% | {'-' if rec is None else f'{rec:.3f}'} | "
                f"{'-' if rec_own is None else f'{rec_own:.3f}'} | {acc} |"
            )
    if len(seeds) > 1:
        lines += ["", f"Over {len(seeds)} seeds (mean +- sd; a row measured on fewer seeds shows its values):", "",
                  "| row | gap | recovery (max PTQ) | recovery (own PTQ) |", "|---|---:|---:|---:|"]  # fmt: skip

        def ms(v: list[float], pct: bool = False) -> str:
            if not v:
                return "-"
            k, unit, digits = (100, "%", 1) if pct else (1, "", 3)
            if len(v) < len(seeds):  # a row measured on fewer seeds: its value(s), not a spread
                return ", ".join(f"{k * x:.{digits}f}{unit}" for x in v) + f" ({len(v)} of {len(seeds)} seeds)"
            return f"{k * statistics.mean(v):.{digits}f}{unit} +- {k * statistics.stdev(v):.{digits}f}"

        for name, st in stats.items():
            if name == FT:
                continue
            lines.append(f"| {name} | {ms(st['gap'], True)} | {ms(st['rec'])} | {ms(st['rec_own'])} |")
    names = [n for n in MC_ROWS if any(n in d["seeds"][s]["rows"] for s in seeds)]
    pairs = [(n, FT) for n in names if n != FT] + [(n, PTQ_MAX) for n in names if n.startswith("QAD")]
    table = [(a, b, _pooled(d, a, b)) for a, b in pairs]
    table = [(a, b, p) for a, b, p in table if p]
    if table:
        lines += [
            "",
            "Multiple choice, task by task, pooled over the seeds (acc a - b, paired standard error, tasks only a / "
            "only b answered right, McNemar's exact p; apart = p < 0.05):",
            "",
            "| a | b | tasks | acc a | acc b | a - b | paired SE | only a / only b | p | apart |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for a, b, p in table:
            lines.append(
                f"| {a} | {b} | {p['n']} | {p['acc_a']:.3f} | {p['acc_b']:.3f} | {p['diff']:+.3f} | {p['se']:.3f} | "
                f"{p['only_a']} / {p['only_b']} | {p['p_value']:.3g} | {'yes' if p['p_value'] < 0.05 else 'no'} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
