"""Run every CPU benchmark and rebuild benchmarks/RESULTS.md from their results.

The accuracy benchmarks (tens of minutes each) are run on their own (`make bench-accuracy`); their
results/*.md sections are collected here like the rest.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

BENCHES = [
    "bench_cpu_fakequant",
    "bench_training_overhead",
    "profile_qat_step",
    "bench_demo",
    "bench_export_size",
    "bench_serve",
]
# Rendered from committed results of runs elsewhere (the GPU check's JSON): no machine needed.
RENDERERS = ["render_gpu"]


def main() -> None:
    # --only-collect: rebuild RESULTS.md from results/ (after a benchmark run on its own, e.g. the accuracy ones)
    if "--only-collect" not in sys.argv[1:]:
        for name in BENCHES:
            importlib.import_module(name).main()
    for name in RENDERERS:
        importlib.import_module(name).main()
    parts = [
        "# Benchmark results",
        "",
        "Every section below is written by the script it names, from a committed results file "
        "(`benchmarks/results/`); speed and memory figures are ratios measured side by side in one run. "
        "Regenerate with `make bench` (CPU), `make bench-accuracy`, `make mutate`, and `benchmarks/gpu_check.py` "
        "on a GPU (then `benchmarks/render_gpu.py`). Hand-written reading notes live in `benchmarks/notes/`.",
        "",
    ]
    for f in sorted((HERE / "results").glob("*.md")):
        parts.append(f.read_text())
    (HERE / "RESULTS.md").write_text("\n".join(parts))
    print(f"wrote {HERE / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
