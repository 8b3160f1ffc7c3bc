"""Perplexity against bits per linear weight, ours and the peers at equal formats (#17).

The peers' rows in ``accuracy_seeds.json`` (modelopt's plain NVFP4 QAT and torchao's NVFP4 QAT) put
NVFP4 on every linear but ``lm_head``; ours there keep attention at 8 bits, so they spend more
memory. This script runs ours at the peers' formats (policy ``fp_embeddings``: NVFP4 on every
decoder linear, embeddings / output / norms in full precision) on the same seeds, data, steps and
optimizer (``bench_accuracy_seeds.run_seed``'s recipe: plain QAT from the original model, direct
schedule), with its PTQ, and renders every row of both files against its bits per linear weight
(block scales included, weighted by SmolLM2's layer sizes; ``lm_head`` is tied to the embeddings
and stays in full precision in every row, so it is left out).

Run: ``.venv-core/bin/python benchmarks/bench_pareto.py [--seeds 0 1 2] [--merge] [--quick]`` (about 6 minutes per
seed on 2 cores), part of ``make bench-accuracy``; ``--render`` only redraws from the results files.
Writes ``benchmarks/results/pareto.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import warnings
from dataclasses import replace
from pathlib import Path

from accuracy_data import load_accuracy_data
from common import RESULTS_DIR, machine, pyplot, save_figure

from nemo_fp4qat import FP4QATCallback, LayerPolicy
from nemo_fp4qat.demo.pipeline import DemoConfig
from nemo_fp4qat.demo.training import train_lm
from nemo_fp4qat.eval.gate import recovery
from nemo_fp4qat.numerics.formats import get_format

OURS_EQUAL = "ours direct, NVFP4 everywhere (fp_embeddings)"
PTQ_EQUAL = "PTQ NVFP4 everywhere (fp_embeddings)"
FT = "bf16 fine-tuned (baseline)"
# accuracy_seeds.json rows -> the policy whose weight formats they ran (peers: NVFP4 on every linear
# but lm_head, which is what fp_embeddings resolves to; ours: measured when `default` was MXFP8
# attention, i.e. today's conservative_attention)
SEED_ROWS = {
    FT: None,
    "modelopt plain QAT (NVFP4_DEFAULT_CFG)": "fp_embeddings",
    "torchao 0.18.0 NVFP4 QAT": "fp_embeddings",
    "ours direct (default policy)": "conservative_attention",
    "ours progressive (default policy)": "conservative_attention",
    "ours progressive, nvfp4_w4a8": "nvfp4_w4a8",
}
LABELS = {
    "ours direct (default policy)": "ours direct, MXFP8 attention + NVFP4 MLP",
    "ours progressive (default policy)": "ours progressive, MXFP8 attention + NVFP4 MLP",
    "ours progressive, nvfp4_w4a8": "ours progressive, FP8 attention + NVFP4 W / FP8 A MLP",
}


def linear_bits(model, policy: str | None) -> float:
    """Storage bits per decoder-linear weight element under ``policy`` (None: 16-bit), scales included."""
    if policy is None:
        return 16.0
    table = LayerPolicy.resolve_spec(policy).resolve(model)
    total = bits = 0.0
    modules = dict(model.named_modules())
    for row in table.rows:
        mod = modules[row.module]
        if not hasattr(mod, "weight") or mod.weight.dim() != 2 or "lm_head" in row.module or "embed" in row.module:
            continue
        n = mod.weight.numel()
        total += n
        bits += n * (get_format(row.weight).bits_per_element if row.quantizable else 16.0)
    return bits / total


def run_seed(seed: int, base_cfg: DemoConfig, out: Path) -> dict[str, float]:
    import lightning.pytorch as pl

    cfg = replace(base_cfg, seed=seed)
    pl.seed_everything(seed)
    data = load_accuracy_data(cfg)
    ft = data.finetune(out, f"s{seed}_finetune")
    rows = {FT: data.ppl(ft), PTQ_EQUAL: data.ppl(data.ptq(ft, "fp_embeddings"))}
    m = copy.deepcopy(data.base)
    cb = FP4QATCallback(policy="fp_embeddings", schedule="direct", calibration=cfg.calib_samples,
                        calibration_data=data.calib, forward_fn=lambda x, b: x.net(b))  # fmt: skip
    train_lm(m, data.train, cfg, out, [cb], f"s{seed}_ours_equal")
    rows[OURS_EQUAL] = data.ppl(m)
    print(f"seed {seed}: {rows}", flush=True)
    return rows


def _stats(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def collect(pareto: dict, seeds_file: Path, bits: dict[str, float]) -> list[dict]:
    """One entry per row: name, bits, mean, sd, n seeds, source file."""
    entries = []
    per_seed = json.loads(seeds_file.read_text()) if seeds_file.is_file() else {}
    for name, policy in SEED_ROWS.items():
        vals = [r[name]["ppl"] for r in per_seed.values() if name in r]
        if vals:
            mean, sd = _stats(vals)
            entries.append({"name": LABELS.get(name, name), "bits": bits[policy or "bf16"], "mean": mean, "sd": sd,
                            "seeds": len(vals), "source": "accuracy_seeds.json"})  # fmt: skip
    auto_file = seeds_file.parent / "auto_policy_seeds.json"  # QAD from the fine-tune: auto policy vs preset
    auto = json.loads(auto_file.read_text())["seeds"] if auto_file.is_file() else {}
    for name in {n: None for s in auto.values() for n in s["rows"]}:
        runs = [s["rows"][name] for s in auto.values() if name in s["rows"]]
        mean, sd = _stats([r["qad"] for r in runs])
        entries.append({"name": f"QAD {name}", "bits": runs[0]["storage_bits"], "mean": mean, "sd": sd,
                        "seeds": len(runs), "source": "auto_policy_seeds.json"})  # fmt: skip
    for name in (PTQ_EQUAL, OURS_EQUAL):
        vals = [r[name] for r in pareto["seeds"].values()]
        mean, sd = _stats(vals)
        entries.append({"name": name, "bits": bits["fp_embeddings"], "mean": mean, "sd": sd, "seeds": len(vals),
                        "source": "pareto.json"})  # fmt: skip
    return entries


def render(pareto: dict, entries: list[dict]) -> str:
    cfg = pareto["config"]
    seeds = pareto["seeds"]
    own_ft = [r[FT] for r in seeds.values()]
    ours = [r[OURS_EQUAL] for r in seeds.values()]
    ptq = [r[PTQ_EQUAL] for r in seeds.values()]
    rec = [recovery(p, q, f) for p, q, f in zip(ptq, ours, own_ft)]
    lines = [
        "## Perplexity against bits per linear weight, at equal formats (`benchmarks/bench_pareto.py`)",
        "",
        f"Machine: {pareto['machine']}. SmolLM2-135M, Emma -> Persuasion, every QAT row {cfg['steps']} steps x "
        f"{cfg['batch_size']} x {cfg['seq_len']} tokens from the original model, AdamW lr {cfg['lr']}, seeds "
        f"{', '.join(seeds)}; mean ± sd over seeds. Bits per linear weight: storage of the decoder's linear weights "
        "with block scales (lm_head, tied to the embeddings, is full precision in every row). Rows from "
        "`accuracy_seeds.json` are that benchmark's (same data, steps and seeds); the fine-tune there and here agree "
        f"({_stats(own_ft)[0]:.3f} here). QAD rows are `auto_policy_seeds.json`'s: QAD from the BF16 fine-tune "
        "(20 steps), the `default` preset against modelopt AutoQuantize's policy at its bits.",
        "",
        "| row | bits / linear weight | perplexity | seeds | from |",
        "|---|---:|---|---:|---|",
    ]
    for e in sorted(entries, key=lambda e: (e["bits"], e["mean"])):
        ppl = f"{e['mean']:.3f} ± {e['sd']:.3f}" if e["seeds"] > 1 else f"{e['mean']:.3f}"
        lines.append(f"| {e['name']} | {e['bits']:.2f} | {ppl} | {e['seeds']} | "
                     f"{e['source']} |")  # fmt: skip
    by = {e["name"]: e for e in entries}
    peers = [e for e in entries if e["bits"] == by[OURS_EQUAL]["bits"] and not e["name"].startswith(("ours", "PTQ"))]
    best_peer = min(peers, key=lambda e: e["mean"]) if peers else None
    lines += ["", f"At {by[OURS_EQUAL]['bits']:.2f} bits (NVFP4 on every decoder linear): ours "
              f"{by[OURS_EQUAL]['mean']:.3f} ± {by[OURS_EQUAL]['sd']:.3f}"
              + (f" vs the best peer ({best_peer['name']}) {best_peer['mean']:.3f} ± {best_peer['sd']:.3f}"
                 if best_peer else "")
              + f"; recovery of ours against its own PTQ {statistics.mean(rec):.3f}.",
              "", "![perplexity vs bits](results/pareto.png)", ""]  # fmt: skip
    return "\n".join(lines)


def plot(entries: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 5))
    for e in entries:
        ours, ref = e["name"].startswith(("ours", "QAD")), e["name"].startswith(("PTQ", "bf16"))
        color = "tab:green" if ours else "tab:gray" if ref else "tab:orange"
        ax.errorbar(e["bits"], e["mean"], yerr=e["sd"], fmt="o", color=color, capsize=3)
        ax.annotate(e["name"], (e["bits"], e["mean"]), fontsize=7, xytext=(5, 2), textcoords="offset points")
    ax.set_xlabel("bits per linear weight (block scales included)")
    ax.set_ylabel("perplexity on Persuasion (lower is better)")
    ax.set_xlim(4, 17.5)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true", help="4-step smoke run; writes to runs/, not results/")
    ap.add_argument("--render", action="store_true", help="only redraw from the results files")
    ap.add_argument("--merge", action="store_true",
                    help="keep the seeds pareto.json holds (same config and machine); run only the others")  # fmt: skip
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    cfg = DemoConfig.quick() if args.quick else DemoConfig()
    out = Path("runs/bench_pareto")
    dest = out if args.quick else RESULTS_DIR
    dest.mkdir(parents=True, exist_ok=True)
    if args.render:
        pareto = json.loads((dest / "pareto.json").read_text())
    else:
        data = load_accuracy_data(cfg)
        bits = {p: linear_bits(data.base, p) for p in {"fp_embeddings", "conservative_attention", "nvfp4_w4a8"}}
        bits["bf16"] = 16.0
        pareto = {"machine": machine(), "config": vars(cfg), "bits": bits, "seeds": {}}
        old = json.loads((dest / "pareto.json").read_text()) if (dest / "pareto.json").is_file() else None
        if args.merge and old is not None:
            same = {k: old.get(k) == pareto[k] for k in ("machine", "config", "bits")}
            if not all(same.values()):
                differs = [k for k, v in same.items() if not v]
                raise SystemExit(f"--merge: pareto.json was measured with another {differs}; run without --merge "
                                 "to measure every seed afresh")  # fmt: skip
            pareto["seeds"] = old["seeds"]
        for seed in (s for s in args.seeds if str(s) not in pareto["seeds"]):
            pareto["seeds"][str(seed)] = run_seed(seed, cfg, out)
            (dest / "pareto.json").write_text(json.dumps(pareto, indent=1))  # a stopped run keeps its seeds
    entries = collect(pareto, RESULTS_DIR / "accuracy_seeds.json", pareto["bits"])
    (dest / "pareto.md").write_text(render(pareto, entries))
    plot(entries, dest / "pareto.png")
    print((dest / "pareto.md").read_text())


if __name__ == "__main__":
    main()
