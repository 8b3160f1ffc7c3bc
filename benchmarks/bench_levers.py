"""Deployable accuracy levers (#17), each alone and combined, PTQ and QAD, every QAD result exported.

One BF16 fine-tune (the demo's: SmolLM2-135M, Emma, 20 steps) is the teacher and the starting point;
each lever is then applied to a copy of it: PTQ (calibrated, no training), and for the levers named
in ``QAD_LEVERS`` the demo's QAD stage (KL to the fine-tune, direct schedule, ``DemoConfig.qad_lr``,
20 steps), exported as a unified HF checkpoint (validated on write) and measured as served. Levers:
activation smoothing folded into the norms / ``up_proj`` rows (``nemo_fp4qat.qat.calibration.smoothing``) at its
sites and strengths, minimum-error NVFP4 weight block scales applied as a weight clip
(``nemo_fp4qat.qat.calibration.block_scale_search``), and FP8 instead of NVFP4 MLP activations (policy
``nvfp4_w4a8``, same weight bits), and an offline block-Hadamard rotation of the residual stream
(``residual_rotation``, PTQ only). Gap to BF16 = ppl / ppl(fine-tune) - 1; recovery against plain
max-calibrated PTQ of the default policy and against the same lever's own PTQ.

Run: ``.venv-core/bin/python benchmarks/bench_levers.py [--quick]`` (about 25 minutes on 2 cores),
part of ``make bench-accuracy``. Writes ``benchmarks/results/levers.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

from accuracy_data import load_accuracy_data
from common import RESULTS_DIR, machine, pyplot, rerender, save_figure, write_result

from nemo_fp4qat import FP4QATCallback, LayerPolicy
from nemo_fp4qat.demo.pipeline import DemoConfig
from nemo_fp4qat.demo.training import train_lm
from nemo_fp4qat.eval.gate import recovery

# lever name -> (policy, smoothing spec, block scale search)
SM_MLP = {"sites": ["mlp_in"], "alpha": 0.5}
SM_IN = {"sites": ["attn_in", "mlp_in"], "alpha": 0.5}
LEVERS: dict[str, tuple[str, dict | None, bool]] = {
    "none (default policy, max calibration)": ("default", None, False),
    "smooth mlp_in a0.5": ("default", SM_MLP, False),
    "smooth mlp_in a0.7": ("default", {"sites": ["mlp_in"], "alpha": 0.7}, False),
    "smooth attn_in+mlp_in a0.5": ("default", SM_IN, False),
    "smooth attn_in+mlp_in+mlp_down a0.5": ("default", {"sites": [*SM_IN["sites"], "mlp_down"], "alpha": 0.5}, False),
    "block scale search": ("default", None, True),
    "block scale search + smooth mlp_in a0.5": ("default", SM_MLP, True),
    "FP8 MLP activations (nvfp4_w4a8)": ("nvfp4_w4a8", None, False),
    "FP8 MLP activations + smooth attn_in+mlp_in a0.5": ("nvfp4_w4a8", SM_IN, False),
    "FP8 MLP activations + block scale search": ("nvfp4_w4a8", None, True),
    "rotation: block Hadamard 16": ("default", None, False),
    "rotation: block Hadamard 64": ("default", None, False),
    "activation ranges searched per layer": ("default", None, False),
}
# levers applied to a rotated copy of the fine-tune (``residual_rotation``): lever -> Hadamard block size
ROTATIONS = {"rotation: block Hadamard 16": 16, "rotation: block Hadamard 64": 64}
# levers whose PTQ model gets its input amaxes searched (``activation_range_search``: a learned range's static optimum)
RANGE_SEARCH = {"activation ranges searched per layer"}
NONE = "none (default policy, max calibration)"
# QAD for the rows that could change the recipe; PTQ only for the others (smoothing attn_in + mlp_in measured worse
# than none after QAD in an earlier run of this table; the other smoothing variants lose at PTQ already)
QAD_LEVERS = [
    NONE,
    "smooth mlp_in a0.5",
    "block scale search",
    "block scale search + smooth mlp_in a0.5",
    "FP8 MLP activations (nvfp4_w4a8)",
    "FP8 MLP activations + block scale search",
]


def qad_row(ft, data, out: Path, policy: str, smoothing: dict | None, search: bool, **levers) -> dict:
    """The demo's QAD stage on a copy of the fine-tune ``ft`` with one lever, exported (unified HF, validated on
    write) and measured as served; ``levers``: :func:`qad_served`'s scale levers."""
    return qad_served(ft, data, out, policy, smoothing, search, **levers)[0]


def qad_served(ft, data, out: Path, policy: str, smoothing: dict | None, search: bool, learned_scales=None,
               distillation="qad", lr: float | None = None, **calibration_fields) -> tuple[dict, object]:  # fmt: skip
    """:func:`qad_row`'s row and the model it measured: the served checkpoint rebuilt by the serving unpacker
    (the trained model if the export was refused). ``learned_scales`` and further ``CalibrationConfig`` fields
    (``weight_scale``, ``act_scale``, ``gptq``) choose the scale levers; ``distillation`` the QAD loss; ``lr`` the
    QAD learning rate (default: the demo's)."""
    from nemo_fp4qat.export import ExportConfig, ExportValidationError, export_checkpoint
    from nemo_fp4qat.export.deployed_model import load_deployed_model

    cfg = data.cfg
    t0 = time.time()
    m = copy.deepcopy(ft)
    calibration = {"num_samples": cfg.calib_samples, "smoothing": smoothing, "block_scale_search": search,
                   **calibration_fields}  # fmt: skip
    cb = FP4QATCallback(policy=policy, schedule="direct", calibration=calibration, calibration_data=data.calib,
                        forward_fn=lambda x, b: x.net(b), distillation=distillation,
                        learned_scales=learned_scales)  # fmt: skip
    train_lm(m, data.train, cfg, out, [cb], "qad", lr=lr or cfg.qad_lr)
    in_memory = data.ppl(m)
    try:
        runtime = LayerPolicy.resolve_spec(policy).runtime  # a policy TensorRT-LLM cannot run exports for ours
        export = ExportConfig(kind="hf", overwrite=True, runtime=runtime)
        hf = export_checkpoint(m, out / "export", export, tokenizer=data.tok)
    except ExportValidationError as e:  # a finding to report, not a reason to lose the other rows
        model, exported = m, str(e).splitlines()[-1]
    else:
        model, exported = load_deployed_model(hf).model, "validated"
    row = {"qad": data.ppl(model), "qad_in_memory": in_memory, "qad_s": time.time() - t0, "export": exported}
    return row, model


def rotated(ft, block: int, data):
    """The fine-tune with its residual stream rotated (``residual_rotation``), checked to compute what it did."""
    from residual_rotation import check, rotate_residual_stream

    m = rotate_residual_stream(ft, block)
    drift = check(ft, m, data.calib[0][:2])
    if drift > 1e-4:
        raise SystemExit(f"the block-{block} rotation changed the full-precision logits by {drift:.2e} (relative)")
    print(f"rotation block {block}: full-precision logits within {drift:.1e} (relative)", flush=True)
    return m


def main() -> None:
    import lightning.pytorch as pl

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4-step smoke run of the whole script")
    ap.add_argument("--render", action="store_true", help="only rewrite levers.md / .png from levers.json")
    ap.add_argument("--only", nargs="+", metavar="LEVER", help="re-run these levers only (the fine-tune too) and "
                    "merge them into levers.json; the other rows are kept as measured")  # fmt: skip
    args = ap.parse_args()
    if args.render:
        rerender("levers", render, plot)
        return
    cfg = DemoConfig.quick() if args.quick else DemoConfig()
    out = Path("runs/bench_levers")
    pl.seed_everything(cfg.seed)
    data = load_accuracy_data(cfg)
    t0 = time.time()
    ft = data.finetune(out)
    ft_ppl = data.ppl(ft)
    print(f"fine-tune {ft_ppl:.3f} ({time.time() - t0:.0f} s)", flush=True)
    only = set(args.only or LEVERS)
    unknown = only - set(LEVERS)
    if unknown:
        raise SystemExit(f"unknown lever(s) {sorted(unknown)}; choose from {list(LEVERS)}")
    kept = json.loads((RESULTS_DIR / "levers.json").read_text())["rows"] if args.only else {}
    rows: dict[str, dict] = {n: r for n, r in kept.items() if n not in only}
    sources = {name: rotated(ft, ROTATIONS[name], data) for name in ROTATIONS if name in only}
    for name, (policy, smoothing, search) in LEVERS.items():
        if name not in only:
            continue
        t0 = time.time()
        m = data.ptq(sources.get(name, ft), policy, smoothing, search)
        extra = {}
        if name in RANGE_SEARCH:
            from activation_range_search import GRID, search_activation_ranges

            chosen = search_activation_ranges(m, data.calib, lambda x, b: x(b))
            extra = {
                "range_grid": list(GRID),
                "range_multipliers": {str(c): list(chosen.values()).count(c) for c in GRID},
            }
        rows[name] = {"policy": policy, "smoothing": smoothing, "block_scale_search": search, "ptq": data.ppl(m),
                      "ptq_s": time.time() - t0}  # fmt: skip
        if name in ROTATIONS:
            rows[name]["rotation_block"] = ROTATIONS[name]
        rows[name].update(extra)
        print(f"{name}: PTQ {rows[name]['ptq']:.3f}", flush=True)
        del m
    for name in QAD_LEVERS:
        if name not in only:
            continue
        rows[name].update(qad_row(sources.get(name, ft), data, out, *LEVERS[name]))
        r = rows[name]
        print(f"{name}: QAD {r['qad']:.3f} (in memory {r['qad_in_memory']:.3f}), export {r['export']}", flush=True)
    base_ptq = rows[NONE]["ptq"]
    for r in rows.values():
        for key in ("ptq", "qad"):
            if key in r:
                r[f"{key}_gap"] = r[key] / ft_ppl - 1
        if "qad" in r:
            r["recovery_vs_max_ptq"] = recovery(base_ptq, r["qad"], ft_ppl)
            r["recovery_vs_own_ptq"] = recovery(r["ptq"], r["qad"], ft_ppl)
    if kept and abs(json.loads((RESULTS_DIR / "levers.json").read_text())["bf16_finetuned"] - ft_ppl) > 1e-9:
        raise SystemExit("the fine-tune differs from the one the kept rows were measured against; run every lever")
    rows = {n: rows[n] for n in LEVERS if n in rows}  # table order
    data_out = {"machine": machine(), "config": vars(cfg), "bf16_finetuned": ft_ppl, "rows": rows}
    write_result("levers", render(data_out), data_out)
    plot(data_out, RESULTS_DIR / "levers.png")


def render(d: dict) -> str:
    cfg, ft = d["config"], d["bf16_finetuned"]
    lines = [
        "## Deployable accuracy levers, PTQ and QAD (`benchmarks/bench_levers.py`)",
        "",
        f"Machine: {d['machine']}. SmolLM2-135M, BF16 fine-tune on Emma ({cfg['steps']} steps x {cfg['batch_size']} x "
        f"{cfg['seq_len']} tokens, lr {cfg['lr']}): perplexity on Persuasion **{ft:.3f}**. Each lever on a copy of "
        f"it: PTQ ({cfg['calib_samples']} calibration samples) and QAD ({cfg['steps']} steps, KL to the fine-tune, "
        f"lr {cfg['qad_lr']}), the QAD model exported (unified HF, validated) and measured as served. One seed. "
        "Gap = ppl / ppl(fine-tune) - 1; recovery against the default policy's max-calibrated PTQ, and against "
        "the lever's own PTQ.",
        "",
        "| lever | PTQ ppl | PTQ gap | QAD ppl (served) | QAD gap | recovery vs max PTQ | recovery vs own PTQ "
        "| export |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in d["rows"].items():
        qad = (f"{r['qad']:.3f} | {100 * r['qad_gap']:.1f}% | {r['recovery_vs_max_ptq']:.3f} | "
               f"{r['recovery_vs_own_ptq']:.3f} | {r['export']}") if "qad" in r else "- | - | - | - | -"  # fmt: skip
        lines.append(f"| {name} | {r['ptq']:.3f} | {100 * r['ptq_gap']:.1f}% | {qad} |")
    rows = d["rows"]
    w4a4 = {n: r for n, r in rows.items() if r["policy"] == "default"}
    best_ptq = min(w4a4, key=lambda n: w4a4[n]["ptq"])
    qad4 = {n: r for n, r in w4a4.items() if "qad" in r}
    best_qad = min(qad4, key=lambda n: qad4[n]["qad"])
    fp8 = {n: r for n, r in rows.items() if r["policy"] != "default" and "qad" in r}
    ptq_gain = rows[NONE]["ptq"] - w4a4[best_ptq]["ptq"]
    qad_gain = rows[NONE]["qad"] - qad4[best_qad]["qad"]
    lines += [
        "",
        f"- NVFP4 activations (the default policy): the best PTQ is **{best_ptq}** ({w4a4[best_ptq]['ptq']:.3f} "
        f"vs {rows[NONE]['ptq']:.3f} with max calibration alone, {ptq_gain:.3f} better); after QAD the best row is "
        f"**{best_qad}** ({qad4[best_qad]['qad']:.3f} vs {rows[NONE]['qad']:.3f}, {qad_gain:.3f} better; gap "
        f"{100 * qad4[best_qad]['qad_gap']:.1f}%, recovery {qad4[best_qad]['recovery_vs_max_ptq']:.3f} against "
        "max-calibrated PTQ).",
    ]
    for n, r in fp8.items():
        lines.append(f"- {n}: QAD {r['qad']:.3f}, gap {100 * r['qad_gap']:.1f}%, recovery "
                     f"{r['recovery_vs_max_ptq']:.3f} against the default policy's PTQ ({r['export']}).")  # fmt: skip
    for n, r in rows.items():
        if "range_multipliers" in r:
            picked = ", ".join(f"x{c}: {k}" for c, k in r["range_multipliers"].items() if k)
            lines.append(f"- {n}: input amax multipliers chosen from {r['range_grid']} (layers per multiplier: "
                         f"{picked}); PTQ {r['ptq']:.3f} vs {rows[NONE]['ptq']:.3f} with max calibration.")  # fmt: skip
    lines += ["", "![levers](results/levers.png)", ""]
    return "\n".join(lines) + "\n"


def plot(d: dict, path: Path) -> None:
    plt = pyplot()

    names = list(d["rows"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    y = range(len(names))
    ax.barh([i + 0.2 for i in y], [d["rows"][n]["ptq"] for n in names], 0.4, label="PTQ")
    ax.barh([i - 0.2 for i in y], [d["rows"][n].get("qad", 0) for n in names], 0.4, label="QAD (served)")
    ax.axvline(d["bf16_finetuned"], color="k", ls="--", label="BF16 fine-tune")
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    lo = d["bf16_finetuned"] * 0.95
    ax.set_xlim(lo, max(r["ptq"] for r in d["rows"].values()) * 1.02)
    ax.set_xlabel("perplexity on Persuasion (lower is better)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
