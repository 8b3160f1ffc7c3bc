"""Comparison of pipeline variants and the quality gate that can stop a CI/CD pipeline.

Variants (same data): ``bf16`` (original), ``bf16_finetuned`` (same data and step budget as QAT:
the fair baseline), ``ptq`` (PTQ of the fine-tuned baseline, max calibration), optionally ``ptq_recipe``
(the same with the recipe's deployable levers: the QAT stage's start) and ``qat``.
``recovery = (ppl_PTQ - ppl_QAT) / (ppl_PTQ - ppl_BF16_finetuned)``: 1.0 means QAT closes the whole
gap PTQ opens, 0 means no better than PTQ.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["GateResult", "QualityGate", "compare_to_finetune", "recovery", "versus_finetune_cells", "write_report"]

REFERENCE = "bf16_finetuned"


def recovery(ppl_ptq: float, ppl_qat: float, ppl_baseline: float) -> float:
    gap = ppl_ptq - ppl_baseline
    if gap <= 0:
        return float("nan")  # PTQ lost nothing: recovery is undefined
    return (ppl_ptq - ppl_qat) / gap


@dataclass
class GateResult:
    passed: bool
    failures: list[str]
    checks: dict[str, dict[str, float]]


@dataclass
class QualityGate:
    """Pass/fail criteria for a quantized model against its full-precision baseline.

    Attributes:
        max_ppl_increase_pct: allowed perplexity increase over the baseline, in percent.
        max_acc_drop: allowed accuracy drop in points (0-100 scale), if accuracy was measured.
        candidate / baseline: variant names in the report.
    """

    max_ppl_increase_pct: float = 0.5
    max_acc_drop: float = 1.0
    candidate: str = "qat"
    baseline: str = "bf16_finetuned"

    def check(self, variants: dict[str, dict[str, Any]]) -> GateResult:
        for name in (self.candidate, self.baseline):
            if name not in variants:
                raise ValueError(f"Quality gate needs variant {name!r}; report has {sorted(variants)}.")
        cand, base = variants[self.candidate], variants[self.baseline]
        failures, checks = [], {}
        inc = 100.0 * (cand["ppl"] / base["ppl"] - 1.0)
        checks["ppl_increase_pct"] = {"value": inc, "limit": self.max_ppl_increase_pct}
        if inc > self.max_ppl_increase_pct:
            failures.append(
                f"perplexity: {self.candidate} {cand['ppl']:.3f} is {inc:.2f}% above {self.baseline} "
                f"{base['ppl']:.3f} (allowed {self.max_ppl_increase_pct}%)"
            )
        if cand.get("acc") is not None and base.get("acc") is not None:
            drop = 100.0 * (base["acc"] - cand["acc"])
            checks["acc_drop_points"] = {"value": drop, "limit": self.max_acc_drop}
            if drop > self.max_acc_drop:
                failures.append(
                    f"accuracy: {self.candidate} {100 * cand['acc']:.1f}% is {drop:.1f} points below "
                    f"{self.baseline} {100 * base['acc']:.1f}% (allowed {self.max_acc_drop})"
                )
        return GateResult(passed=not failures, failures=failures, checks=checks)

    def check_lm_eval(self, candidate: dict[str, Any], baseline: dict[str, Any]) -> GateResult:
        """The gate on two lm-evaluation-harness results dicts (or their JSON): the largest accuracy drop in points
        over the tasks and accuracy metrics both hold (``acc``, ``acc_norm``, ``exact_match``), and the largest
        perplexity increase in percent (``word_perplexity``, ``byte_perplexity``)."""
        cand, base = candidate.get("results", {}), baseline.get("results", {})
        shared = sorted(set(cand) & set(base))
        if not shared:
            raise ValueError(f"no task in both lm-eval results (candidate {sorted(cand)}, baseline {sorted(base)}).")
        failures, checks = [], {}
        drops, increases = {}, {}
        for task in shared:
            for key, b in base[task].items():
                c = cand[task].get(key)
                if not isinstance(b, float | int) or not isinstance(c, float | int) or "_stderr" in key:
                    continue
                metric = key.split(",")[0]
                if metric in ("acc", "acc_norm", "exact_match"):
                    drops[f"{task}/{key}"] = 100.0 * (b - c)
                elif metric in ("word_perplexity", "byte_perplexity"):
                    increases[f"{task}/{key}"] = 100.0 * (c / b - 1.0)
        for check, values, limit, failure in (
            ("acc_drop_points", drops, self.max_acc_drop, "accuracy: {} is {:.1f} points below the baseline "
             "(allowed {})"),
            ("ppl_increase_pct", increases, self.max_ppl_increase_pct, "perplexity: {} is {:.2f}% above the "
             "baseline (allowed {}%)"),
        ):  # fmt: skip
            if values:  # the worst task metric of its kind decides
                worst = max(values, key=values.get)
                checks[check] = {"value": values[worst], "limit": limit}
                if values[worst] > limit:
                    failures.append(failure.format(worst, values[worst], limit))
        if not checks:
            raise ValueError(f"the lm-eval results share tasks {shared} but no accuracy or perplexity metric.")
        return GateResult(passed=not failures, failures=failures, checks=checks)


def compare_to_finetune(variants: dict[str, dict[str, Any]], reference: str = REFERENCE) -> None:
    """Add to every other variant ``vs_finetuned``: its perplexity against ``reference``'s on the same windows
    (``ppl``: the ratio - 1 with its 95% t interval, :func:`~.paired.paired_perplexity_gap`) and its accuracy on the
    same documents (``acc``: :func:`~.paired.paired_difference`), where both were measured per window / document
    (``window_nll``, ``acc_outcomes``)."""
    from .paired import paired_difference, paired_perplexity_gap

    ref = variants.get(reference)
    if ref is None:
        return
    for name, v in variants.items():
        if name == reference:
            continue
        vs: dict[str, Any] = {}
        if v.get("window_nll") and ref.get("window_nll") and len(v["window_nll"]) > 1:
            vs["ppl"] = paired_perplexity_gap(v["window_nll"], ref["window_nll"]).as_dict()
        if v.get("acc_outcomes") and ref.get("acc_outcomes"):
            vs["acc"] = paired_difference(v["acc_outcomes"], ref["acc_outcomes"]).as_dict()
        if vs:
            v["vs_finetuned"] = vs


def versus_finetune_cells(v: dict[str, Any]) -> tuple[str, str]:
    """The two table cells of :func:`compare_to_finetune`'s comparison: ``+10.7% [+6.1, +15.5]`` (perplexity) and
    ``-7.5 pts, p 0.45`` (accuracy); ``-`` where it was not measured."""
    vs = v.get("vs_finetuned") or {}
    ppl = acc = "-"
    if "ppl" in vs:
        g = vs["ppl"]
        ppl = f"{100 * g['gap']:+.1f}% [{100 * g['low']:+.1f}, {100 * g['high']:+.1f}]"
    if "acc" in vs:
        a = vs["acc"]
        acc = f"{100 * a['diff']:+.1f} pts, p {a['p_value']:.2g}"
    return ppl, acc


def _table(variants: dict[str, dict[str, Any]]) -> list[str]:
    rows = [
        "| variant | perplexity | vs fine-tune (95% CI) | accuracy | vs fine-tune (paired) | tokens/s | bits/weight | "
        "weights vs bf16 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in variants.items():
        acc = "-" if v.get("acc") is None else f"{100 * v['acc']:.1f}%"
        ppl_vs, acc_vs = versus_finetune_cells(v)
        rows.append(
            f"| {name} | {v['ppl']:.3f} | {ppl_vs} | {acc} | {acc_vs} | {v['tokens_per_s']:.0f} | "
            f"{v['bits_per_weight']:.2f} | {v['weight_ratio_vs_bf16']:.3f} |"
        )
    return rows


def write_report(
    out_dir: str | Path,
    variants: dict[str, dict[str, Any]],
    extra: dict[str, Any] | None = None,
    loss_curves: dict[str, list[float]] | None = None,
    switches: list[dict[str, Any]] | None = None,
    gate: QualityGate | None = None,
) -> dict[str, Any]:
    """``report.json``, ``report.md`` and PNG plots (perplexity by variant, loss curves by stage)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rec = gap = None
    if {"ptq", "qat", "bf16_finetuned"} <= set(variants):
        rec = recovery(variants["ptq"]["ppl"], variants["qat"]["ppl"], variants["bf16_finetuned"]["ppl"])
    if {"qat", "bf16_finetuned"} <= set(variants):
        # the headline: no choice of PTQ baseline can inflate it
        gap = variants["qat"]["ppl"] / variants["bf16_finetuned"]["ppl"] - 1.0
    gate_res = (gate or QualityGate()).check(variants) if {"qat", "bf16_finetuned"} <= set(variants) else None
    own = None
    if {"ptq_recipe", "qat", "bf16_finetuned"} <= set(variants):  # the QAT stage's own start (PTQ with levers)
        own = recovery(variants["ptq_recipe"]["ppl"], variants["qat"]["ppl"], variants["bf16_finetuned"]["ppl"])
    report = {
        "variants": variants,
        "recovery": rec,
        **({"recovery_vs_recipe_ptq": own} if own is not None else {}),
        "gap_to_bf16": gap,
        "gate": asdict(gate_res) if gate_res else None,
        "gate_config": asdict(gate or QualityGate()),
        "switches": switches or [],
        **(extra or {}),
    }
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=float))
    tmp.replace(out / "report.json")
    md = ["# nemo-fp4qat report", "", *_table(variants), ""]
    for kind, path in ((extra or {}).get("exports") or {}).items():
        md.append(f"Export ({'TensorRT-LLM checkpoint' if kind == 'trtllm' else 'unified HF checkpoint'}): `{path}`  ")
    if gap is not None:
        md.append(f"Gap to the BF16 fine-tune (ppl_QAT / ppl_BF16_finetuned - 1): **{100 * gap:.1f}%**  ")
    if rec is not None:
        md.append(f"Recovery (PTQ -> QAT gap closed vs the fine-tuned baseline): **{rec:.3f}**  ")
    if own is not None:
        md.append(f"Recovery against the recipe's own PTQ (`ptq_recipe`): **{own:.3f}**  ")
    if gate_res is not None:
        md.append(f"Quality gate: **{'PASS' if gate_res.passed else 'FAIL'}** " + "; ".join(gate_res.failures))
    (out / "report.md").write_text("\n".join(md) + "\n")
    _plots(out, variants, loss_curves or {}, switches or [])
    return report


def _plots(out: Path, variants: dict[str, dict[str, Any]], curves: dict[str, list[float]], switches) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(variants)
    ax.bar(names, [variants[n]["ppl"] for n in names], color=["#777", "#4a7", "#c55", "#36c"][: len(names)])
    ax.set_ylabel("perplexity (validation)")
    ax.set_title("Perplexity by variant")
    for i, n in enumerate(names):
        ax.text(i, variants[n]["ppl"], f"{variants[n]['ppl']:.2f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "perplexity_by_variant.png", dpi=120)
    plt.close(fig)
    if curves:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, ys in curves.items():
            ax.plot(range(len(ys)), ys, label=name)
        for s in switches:
            ax.axvline(s["step"], color="#999", ls="--", lw=0.8)
            ax.text(s["step"], ax.get_ylim()[1], f" {s['group']}->{s['to']}", rotation=90, va="top", fontsize=6)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title("Loss curves (dashed: precision switches)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "loss_curves.png", dpi=120)
        plt.close(fig)
