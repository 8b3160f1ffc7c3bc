"""Render the GPU runs' JSON into markdown, so every GPU figure in RESULTS.md and README.md comes from a committed
results file.

* ``results/gpu_h200.json`` -> ``results/gpu_h200.md``: the first H200 check (modelopt's CUDA kernels vs the CPU
  kernel, step overhead), kept as measured.
* ``results/gpu_check.json`` -> ``results/gpu_check.md``: the acceptance run of ``benchmarks/gpu_check.py`` (kernel
  parity with the exact CUDA path, QAD -> export -> validate -> perplexity, step time), when one has been run.

``python benchmarks/render_gpu.py [--src JSON --dst MD]`` renders one file (the acceptance-run format).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
SRC = HERE / "results" / "gpu_h200.json"
DST = HERE / "results" / "gpu_h200.md"
CHECK_SRC = HERE / "results" / "gpu_check.json"
CHECK_DST = HERE / "results" / "gpu_check.md"


def render(d: dict) -> str:
    by_fmt: dict[str, dict[str, float]] = defaultdict(lambda: {"numel": 0, "mismatches": 0, "max": 0.0})
    for p in d["parity"]:
        agg = by_fmt[p["format"]]
        agg["numel"] += p["numel"]
        agg["mismatches"] += p["mismatches"]
        agg["max"] = max(agg["max"], p["max_abs_diff"])
    shapes = sorted({"x".join(map(str, p["shape"])) for p in d["parity"]})
    mags = sorted({p["mag"] for p in d["parity"]})
    dtypes = sorted({p["dtype"].replace("torch.", "") for p in d["parity"]})
    lines = [
        f"## GPU check ({d['device']}, one run of `benchmarks/gpu_check.py`; rendered by `benchmarks/render_gpu.py`)",
        "",
        f"torch {d['torch']}, modelopt {d['modelopt']}. Same random tensors ({', '.join(dtypes)}; shapes "
        f"{', '.join(shapes)}; magnitudes {', '.join(f'{m:g}' for m in mags)}) through modelopt's CUDA fake quant and "
        "through this package's CPU kernel.",
        "",
        "| format | elements compared | elements differing | max abs diff |",
        "|---|---:|---:|---:|",
    ]
    for fmt, a in by_fmt.items():
        lines.append(f"| {fmt} | {a['numel']} | {a['mismatches']} | {a['max']:g} |")
    worst = [p for p in d["parity"] if p["format"] == "nvfp4" and p["mismatches"]]
    lines += ["", "NVFP4 cases that differ (modelopt's Triton kernel vs this package, which equals modelopt's "
              "`NVFP4QTensor` export path bit for bit on the CPU tests):", "",
              "| dtype | shape | magnitude | differing / elements | max abs diff |",
              "|---|---|---:|---:|---:|"]  # fmt: skip
    for p in worst:
        lines.append(f"| {p['dtype'].replace('torch.', '')} | {'x'.join(map(str, p['shape']))} | {p['mag']:g} | "
                     f"{p['mismatches']} / {p['numel']} | {p['max_abs_diff']:g} |")  # fmt: skip
    q = d["qat_step"]
    lines += [
        "",
        f"QAT step overhead ({q['model']}, bf16):",
        "",
        "| variant | step (ms) | peak memory (GiB) |",
        "|---|---:|---:|",
        f"| BF16 | {1e3 * q['bf16']['step_s']:.1f} | {q['bf16']['peak_mem_gib']:.2f} |",
        f"| NVFP4 QAT (modelopt fake quant, weights + inputs) | {1e3 * q['nvfp4_qat']['step_s']:.1f} | "
        f"{q['nvfp4_qat']['peak_mem_gib']:.2f} |",
        "",
        f"Ratios: step time QAT / BF16 = **{q['step_time_ratio_qat_over_bf16']:.2f}**, peak memory = "
        f"**{q['peak_mem_ratio_qat_over_bf16']:.2f}**.",
        "",
        f"Fake-quant throughput on the GPU: modelopt NVFP4 {d['gpu_fakequant_nvfp4_elems_per_s'] / 1e9:.0f} G el/s vs "
        f"device copy {d['gpu_copy_elems_per_s'] / 1e9:.0f} G el/s "
        f"({d['gpu_fakequant_nvfp4_elems_per_s'] / d['gpu_copy_elems_per_s']:.2f}x). On that host's "
        f"{d['host_cpu_threads']} CPU threads (an earlier, pure-torch version of the CPU kernel): "
        f"{d['cpu_ours_nvfp4_elems_per_s'] / 1e6:.0f} M el/s vs modelopt's NVFP4QTensor quantize-only "
        f"{d['cpu_modelopt_nvfp4qtensor_elems_per_s'] / 1e6:.0f} M el/s.",
        "",
    ]
    return "\n".join(lines)


def _kernel_cell(rec: dict[str, Any]) -> str:
    if "mismatches" in rec:
        return f"{rec['mismatches']}"
    return "not run" if "skipped" in rec else f"error: {rec.get('error', '?')[:60]}"


def render_check(d: dict[str, Any]) -> str:
    """The acceptance run (``gpu_check.py``'s JSON) as markdown."""
    lines = [f"## GPU acceptance run: {d['device']}", "",
             f"torch {d['torch']}, modelopt {d['modelopt']}, triton {d.get('triton')}. Written by "
             "`benchmarks/gpu_check.py`, rendered by `benchmarks/render_gpu.py`.", ""]  # fmt: skip
    if d.get("errors"):
        lines += ["Sections that failed:", ""] + [f"- `{e.splitlines()[-1][:200]}`" for e in d["errors"]] + [""]
    d = dict(d)
    for key in ("parity", "static", "qad", "qad_budget"):  # past the run's time budget: named, to be run with --only
        if isinstance(d.get(key), dict) and isinstance(d[key].get("skipped"), str):
            lines += [f"`{key}`: not run ({d.pop(key)['skipped']}).", ""]
    parity = d.get("parity") or []
    if parity:
        agg: dict[str, dict[str, Any]] = defaultdict(lambda: {"numel": 0, "modelopt": [], "exact": []})
        for p in parity:
            a = agg[p["format"]]
            a["numel"] += p["numel"]
            for k in ("modelopt", "exact"):
                if k in p:
                    a[k].append(p[k])

        def total(recs: list[dict[str, Any]]) -> str:
            if not recs:
                return "n/a"
            if all("mismatches" in r for r in recs):
                return str(sum(r["mismatches"] for r in recs))
            return _kernel_cell(next(r for r in recs if "mismatches" not in r))

        lines += ["Elements that differ from the CPU kernel (which equals modelopt's exporter, `NVFP4QTensor`):", "",
                  "| format | elements | modelopt's CUDA kernel | exact CUDA path (NVFP4: Triton; FP8: torch) |",
                  "|---|---:|---:|---:|"]  # fmt: skip
        for fmt, a in agg.items():
            lines.append(f"| {fmt} | {a['numel']} | {total(a['modelopt'])} | {total(a['exact'])} |")
        lines.append("")
    static = [r for r in d.get("static") or [] if "lsq" not in r and "numel" in r]
    if static:

        def cell(r: dict[str, Any], kernel: str, op: str) -> str:
            k = r.get(kernel, {})
            if op in k:
                return str(k[op]["mismatches"])
            return "skipped" if "skipped" in k else f"error: {k.get('error', '')[:60]}"

        lines += ["Static per-block NVFP4 (modelopt >= 0.46's calibrated / learned weight scales) and LSQ's FP4 cast: "
                  "elements that differ from this package's torch forwards on the CPU:", "",
                  "| dtype | shape | magnitude | elements | static: exact path | static: modelopt's Triton kernel "
                  "| cast: exact | cast: modelopt |", "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in static:
            lines.append(f"| {r['dtype']} | {'x'.join(map(str, r['shape']))} | {r['mag']:g} | {r['numel']} | "
                         f"{cell(r, 'exact', 'static')} | {cell(r, 'modelopt', 'static')} | {cell(r, 'exact', 'cast')} "
                         f"| {cell(r, 'modelopt', 'cast')} |")  # fmt: skip
        lsq = next((r["lsq"] for r in d["static"] if "lsq" in r), {})
        for key, res in lsq.items():
            if isinstance(res, dict) and "y" in res:
                rel = ", ".join(f"{k} {v['max_rel_diff']:.1e}" for k, v in res.items())
                lines.append(f"\nLSQ (dual) quantizer, {key} against the CPU, largest relative difference: {rel}.")
        lines.append("")
    q = d.get("qad")
    if q:
        lines += [f"QAD of {q['model']} on {q['device']} ({q['dtype']}, {q['steps']} steps, {q['train_s']:.0f} s); "
                  f"perplexity of the trained model {q['trained_ppl']:.3f}:", "",
                  "| export | validated | FP4 codes compared | differing (exact kernel) | differing (modelopt's "
                  "kernel) | perplexity on the device | on the CPU |",
                  "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for kind, e in q["exports"].items():
            if "error" in e:
                first = next((ln.strip() for ln in e["error"].splitlines() if "ERROR" in ln), e["error"])
                lines.append(f"| {kind} | error: {first[:220]} | | | | | |")
                continue
            mo = e.get("fp4_codes_different_modelopt_kernel", "not run")
            if e.get("validated_modelopt_kernel") is False:
                mo = f"{mo}; fails validation ({e['errors_modelopt_kernel'][-1]})"
            lines.append(f"| {kind} | {e['validated']} | {e['fp4_codes_compared']} | {e['fp4_codes_different_exact']} "
                         f"| {mo} | {e['ppl_device']:.3f} | {e['ppl_cpu']:.3f} |")  # fmt: skip
        lines.append("")
    for key in ("step", "step_1b", "step_accum"):
        st = d.get(key)
        if st and "skipped" in st:
            lines += [f"Step time (`{key}`): not run ({st['skipped']}).", ""]
        elif st:
            lines += [f"Step time ({st['model']}, {st['dtype']}):", "",
                      "| variant | step (ms) | / BF16 | peak memory (GiB) |", "|---|---:|---:|---:|"]  # fmt: skip
            for v in ("bf16", "qat_exact", "qat_modelopt"):
                r = st.get(v, {})
                if "step_s" not in r:
                    lines.append(f"| {v} | not run | | |")
                    continue
                ratio = st.get(f"step_ratio_{v}", 1.0)
                mem = f"{r['peak_mem_gib']:.2f}" if "peak_mem_gib" in r else "n/a"
                lines.append(f"| {v} | {1e3 * r['step_s']:.1f} | {ratio:.2f} | {mem} |")
            lines.append("")
    pr = d.get("profile")
    if pr and "skipped" in pr:
        lines += [f"Profile: not run ({pr['skipped']}).", ""]
    elif pr:
        variants = [v for v in ("bf16", "qat_exact", "qat_modelopt") if "ms_by_category" in pr.get(v, {})]
        cats = sorted({c for v in variants for c in pr[v]["ms_by_category"]},
                      key=lambda c: -max(pr[v]["ms_by_category"].get(c, 0.0) for v in variants))  # fmt: skip
        unit = "kernels" if "kernels" in pr[variants[0]] else "operators"
        lines += [f"One step under torch's profiler ({pr['model']}, {pr['dtype']}), self time by category (ms):", "",
                  "| category | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]  # fmt: skip
        for c in cats:
            lines.append(f"| {c} | " + " | ".join(f"{pr[v]['ms_by_category'].get(c, 0.0):.2f}" for v in variants)
                         + " |")  # fmt: skip
        lines.append("| **total** | " + " | ".join(f"{pr[v]['ms_total']:.2f}" for v in variants) + " |")
        lines.append(f"| {unit} launched | " + " | ".join(str(pr[v][unit]) for v in variants) + " |")
        lines.append("")
        alone = [(v, pr[v]["fake_quant_alone"]) for v in variants if "fake_quant_alone" in pr[v]]
        if alone:
            lines += ["The step's fake quant timed alone (forward; the backward is a straight-through pass):", "",
                      "| kernel | weights (ms) | weight elements | inputs (ms) | input elements |",
                      "|---|---:|---:|---:|---:|"]  # fmt: skip
            for v, a in alone:
                lines.append(f"| {v} | {a['weights_ms']:.2f} | {a['weights_elements']} | {a['inputs_ms']:.2f} | "
                             f"{a['inputs_elements']} |")  # fmt: skip
            lines.append("")
    if d.get("runs"):
        lines += [f"Runs: {d['runs']}", ""]
    mg = d.get("megatron")
    if mg and "skipped" in mg:
        lines += [f"megatron-core QAD: not run here ({mg['skipped']}).", ""]
    elif mg:
        e = mg["export"]
        codes = (e.get("numeric") or {}).get("fp4_codes_different", "n/a")
        peak = f"{mg['peak_gib']:.2f}" if mg.get("peak_gib") is not None else "n/a"
        lines += [
            f"### megatron-core QAD (local layer spec, {mg['shape']}, megatron-core {mg['megatron_core']})",
            "",
            "| BF16 step (ms) | QAD step (ms) | QAD / BF16 | peak GiB | TensorRT-LLM export | FP4 codes different |",
            "|---:|---:|---:|---:|---|---:|",
            f"| {mg['bf16_step_ms']:.1f} | {mg['qad_step_ms']:.1f} | {mg['qad_over_bf16']:.2f} | {peak} | "
            f"{'validated' if e['ok'] else 'FAILED'} | {codes} |",
            "",
        ]
    if d.get("nemo", {}).get("skipped"):
        lines += [f"NeMo path: not run here ({d['nemo']['skipped']}).", ""]
    if d.get("qad_budget"):
        lines += render_qad_budget(d["qad_budget"])
    return "\n".join(lines)


def render_qad_budget(q: dict[str, Any]) -> list[str]:
    """The ``qad_budget`` section: per token budget, the fine-tune, both PTQ starts and every QAD run as served."""
    p = q["plan"]
    lines = [f"### QAD at a real token budget ({q['model']} on {q['device']})", "",
             f"Policy `{q['policy']}`, smoothing {q['smoothing']}; batch {p['batch']} x {p['seq_len']}; fine-tune lr "
             f"{p['finetune_lr']:g}; warm-up {p['warmup']:.0%} of the steps then cosine decay. Training text: "
             f"{', '.join(q['train_texts'])} ({q['windows_available']} windows); perplexity on the first "
             f"{p['eval_tokens']:,} tokens of {q['eval_text']}, multiple choice on {p['mc_tasks']} next-sentence tasks "
             "from it (largest budget). QAD rows are the unified HF export, validated and loaded as served. Recovery: "
             "the share of the start's perplexity gap to the fine-tune that QAD closes.", "",
             "| tokens | run | lr | perplexity | gap to fine-tune | recovery | multiple choice | export | train s |",
             "|---:|---|---:|---:|---:|---:|---:|---|---:|"]  # fmt: skip
    for r in sorted(q["rows"], key=lambda r: (-r["tokens"], r["run"] != "finetune", r["run"])):
        if "error" in r:
            lines.append(f"| {r['tokens']:,} | {r['run']} | | error: {r['error'].splitlines()[-1][:120]} | | | | | |")
            continue
        lr = f"{r['lr']:g}" if "lr" in r else ""
        gap = f"{100 * r['gap']:.1f}%" if "gap" in r else ""
        rec = f"{r['recovery']:.3f}" if "recovery" in r else ""
        mc = f"{r['mc']['acc']:.3f}" if "mc" in r else ""
        train = f"{r['train_s']:.0f}" if "train_s" in r else ""
        run = r["run"].rsplit(" lr ", 1)[0]  # the learning rate has its own column
        lines.append(f"| {r['tokens']:,} | {run} | {lr} | {r['ppl']:.3f} | {gap} | {rec} | {mc} | "
                     f"{r.get('export', '')} | {train} |")  # fmt: skip
    if q.get("skipped"):
        lines += ["", "Not run (past the section's deadline): " + "; ".join(f"`{s['run']}`" for s in q["skipped"])
                  + f". {q['skipped'][0]['why'].split('; ')[-1].capitalize()}."]  # fmt: skip
    tps = ", ".join(f"{k} {v:,.0f}" for k, v in q.get("tokens_per_s", {}).items())
    lines += ["", f"Training tokens per second: {tps}.", ""]
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Render the GPU runs' JSON into markdown.")
    p.add_argument("--src", type=Path, help="an acceptance run's gpu_check.json")
    p.add_argument("--dst", type=Path, help="where its markdown goes")
    args = p.parse_args(argv)
    if args.src is not None:
        dst = args.dst or args.src.with_suffix(".md")
        dst.write_text(render_check(json.loads(args.src.read_text())))
        print(f"wrote {dst}")
        return
    DST.write_text(render(json.loads(SRC.read_text())))
    print(f"wrote {DST}")
    if CHECK_SRC.is_file():
        CHECK_DST.write_text(render_check(json.loads(CHECK_SRC.read_text())))
        print(f"wrote {CHECK_DST}")


if __name__ == "__main__":
    main()
