"""Rebuild benchmarks/RESULTS.md, the index of the results files (after running the ``bench`` group of
``benchmarks/registry.py`` unless ``--only-collect``)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent

from registry import BENCHMARKS  # noqa: E402

# Rendered from committed results of runs elsewhere (the GPU check's JSON): no machine needed.
RENDERERS = ["render_gpu"]
# results file -> the script that writes it (the first registered)
WRITERS = {r: b.script for b in reversed(BENCHMARKS) for r in b.results}


def _updated(path: Path) -> str:
    """The date of the commit that last changed ``path`` (its measurement's date), or "uncommitted"."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%cs", "--", path.name], cwd=path.parent,
                             capture_output=True, text=True, timeout=30).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "uncommitted"


def index(results: Path) -> str:
    """RESULTS.md: one row per results file (what it measures, the script that writes it, when it changed)."""
    rows = ["| results | what | written by | updated |", "|---|---|---|---|"]
    for f in sorted(results.glob("*.md")):
        text = f.read_text()
        heading = next((line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#")), f.stem)
        heading = re.sub(r"\s*\(`?benchmarks/[^)]*\)", "", heading).replace("|", "/")
        named = re.findall(r"benchmarks/(\w+\.py)", text)
        script = WRITERS.get(f.stem) or (named[0] if named else "?")
        rows.append(f"| [`{f.name}`](results/{f.name}) | {heading} | `benchmarks/{script}` | {_updated(f)} |")
    return "\n".join(rows)


def main() -> None:
    # --only-collect: rebuild RESULTS.md from results/ (after a benchmark run on its own, e.g. the accuracy ones)
    if "--only-collect" not in sys.argv[1:]:
        for b in BENCHMARKS:
            if b.group == "bench":
                importlib.import_module(b.script.removesuffix(".py")).main()
    for name in RENDERERS:
        importlib.import_module(name).main([])
    parts = [
        "# Benchmark results",
        "",
        "One row per results file; each is written by the script it names (speed and memory figures are ratios "
        "measured side by side in one run). Regenerate with `make bench` (CPU), `make bench-accuracy`, "
        "`make mutate`, `make reliability`, and `make gpu-check` on a GPU (then `benchmarks/render_gpu.py`). "
        "Hand-written reading notes: `benchmarks/notes/`.",
        "",
        index(HERE / "results"),
        "",
    ]
    (HERE / "RESULTS.md").write_text("\n".join(parts))
    print(f"wrote {HERE / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
