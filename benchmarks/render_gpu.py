"""Write ``results/gpu_h200.md`` from ``results/gpu_h200.json`` (the output of one run of ``gpu_check.py``
on a GPU machine), so every GPU figure in RESULTS.md and README.md comes from the committed JSON."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent
SRC = HERE / "results" / "gpu_h200.json"
DST = HERE / "results" / "gpu_h200.md"


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


def main() -> None:
    DST.write_text(render(json.loads(SRC.read_text())))
    print(f"wrote {DST}")


if __name__ == "__main__":
    main()
