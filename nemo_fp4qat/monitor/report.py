"""The monitor's output: a terminal table of the worst layers, ``quant_report.json`` and PNG plots."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .findings import Finding, MonitorThresholds

__all__ = ["summary_table", "write_plots", "write_report"]

log = logging.getLogger("nemo_fp4qat")


def summary_table(layers: dict[str, dict[str, Any]], title: str, top: int = 15) -> str:
    """The ``top`` layers with the highest weight error (all layers are in the JSON report)."""
    head = f"{'layer':<48} {'rel_err':>8} {'sqnr_dB':>8} {'in_err':>8} {'std':>9} {'kurt':>7} {'flush':>6} {'sat':>6}"
    worst = sorted(layers.items(), key=lambda kv: -kv[1]["weight_rel_err"])[:top]
    rows = [f"{title}: {min(top, len(layers))} of {len(layers)} layers, highest error first", head, "-" * len(head)]
    for name, r in worst:
        rows.append(
            f"{name[-48:]:<48} {r['weight_rel_err']:8.4f} {r['weight_sqnr_db']:8.2f} "
            f"{r.get('input_rel_err', float('nan')):8.4f} {r['weight_std']:9.3g} {r['weight_kurtosis']:7.2f} "
            f"{r['weight_flushed_frac']:6.3f} {r['weight_saturated_frac']:6.3f}"
        )
    return "\n".join(rows)


def write_report(
    out: Path, thresholds: MonitorThresholds, action: str, findings: list[Finding], records: list[dict[str, Any]]
) -> Path:
    """``quant_report.json`` (written whole, then renamed) + the plots; returns the JSON's path."""
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "thresholds": asdict(thresholds),
        "action": action,
        "findings": [asdict(f) for f in findings],
        "measurements": records,
    }
    tmp = out / "quant_report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=float))
    tmp.replace(out / "quant_report.json")
    try:
        write_plots(out, records)
    except Exception as e:  # plotting must never fail a training run
        log.warning("nemo_fp4qat monitor: plots not written (%s)", e)
    return out / "quant_report.json"


def write_plots(out: Path, records: list[dict[str, Any]]) -> None:
    """``quant_error_by_stage.png`` (error per layer, last measurement of each stage) and
    ``weight_stats_heatmap.png`` (final weight statistics, column-normalized)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not records:
        return
    # last measurement of each stage
    by_stage: dict[str, dict[str, Any]] = {}
    for r in records:
        by_stage[r["stage"]] = r["layers"]
    layers = list(records[-1]["layers"])
    fig, ax = plt.subplots(figsize=(min(16, max(6, 0.3 * len(layers))), 4.5))
    for stage, recs in by_stage.items():
        ax.plot(range(len(layers)), [recs.get(n, {}).get("weight_rel_err", np.nan) for n in layers], ".-",
                label=stage, lw=0.8)  # fmt: skip
    every = max(1, math.ceil(len(layers) / 40))  # at most ~40 labels stay readable
    ax.set_xticks(range(0, len(layers), every))
    ax.set_xticklabels([n[-28:] for n in layers[::every]], rotation=90, fontsize=6)
    ax.set_ylabel("weight ||Q(w)-w|| / ||w||")
    ax.set_title("Weight quantization error by layer and stage")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "quant_error_by_stage.png", dpi=120)
    plt.close(fig)
    stats = ["weight_rel_err", "weight_std", "weight_absmax", "weight_kurtosis", "weight_flushed_frac",
             "weight_saturated_frac"]  # fmt: skip
    last = records[-1]["layers"]
    mat = np.array([[float(last[n].get(s) or 0.0) for s in stats] for n in layers])
    span = mat.max(axis=0) - mat.min(axis=0)
    norm = (mat - mat.min(axis=0)) / np.where(span > 0, span, 1.0)
    fig, ax = plt.subplots(figsize=(7, min(14, max(3, 0.3 * len(layers)))))
    im = ax.imshow(norm, aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(stats)))
    ax.set_xticklabels([s.replace("weight_", "") for s in stats], rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(0, len(layers), every))
    ax.set_yticklabels([n[-32:] for n in layers[::every]], fontsize=6)
    ax.set_title("Weight statistics (column-normalized), final")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out / "weight_stats_heatmap.png", dpi=120)
    plt.close(fig)
