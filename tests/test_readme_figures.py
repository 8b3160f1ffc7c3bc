"""README figures trace to results files written by scripts: every figure in a README paragraph that cites
`benchmarks/results/<file>` is in one of the files it cites, every "Measured" line cites one, and every
cited file is written by a committed script."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITE = re.compile(r"benchmarks/results/([\w.-]+\.md)")
# a figure: a decimal number, or a number with a unit (x, %, s, ms, req/s)
FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+|\d+(?=x|%| s\b| ms\b| req/s))")


def blocks(text: str) -> list[str]:
    """Paragraphs, bullets (a bullet and its continuation lines are one block) and table rows (one block each)."""
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        for b in re.split(r"\n(?=\* )", para):
            if b.lstrip().startswith("|"):
                out += _table_rows(b)
            elif b.strip():
                out.append(b)
    return out


def missing_figures(block: str, results_dir: Path) -> list[str]:
    cited = [results_dir / name for name in CITE.findall(block)]
    held = "\n".join(f.read_text() for f in cited if f.is_file())
    text = CITE.sub("", block)
    return [fig for fig in FIGURE.findall(text) if not re.search(rf"(?<![\d.]){re.escape(fig)}(?![\d])", held)]


def _table_rows(table: str) -> list[str]:
    """A markdown table's rows, with its "target" column blanked: targets are goals, not measured figures."""
    rows = [r for r in table.splitlines() if r.strip()]
    header = [c.strip() for c in rows[0].strip().strip("|").split("|")]
    if "target" not in header:
        return rows
    col = header.index("target")
    out = []
    for r in rows:
        cells = r.strip().strip("|").split("|")
        if len(cells) == len(header):
            cells[col] = " "
        out.append("|" + "|".join(cells) + "|")
    return out


def test_every_figure_is_in_the_results_file_it_cites():
    bad = {}
    for block in blocks((ROOT / "README.md").read_text()):
        if CITE.search(block):
            miss = missing_figures(block, ROOT / "benchmarks" / "results")
            if miss:
                bad[block[:80]] = miss
    assert not bad, f"README figures not in the cited results files: {bad}"


def test_every_measured_row_cites_a_results_file():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Measured") : readme.index("\n## ", readme.index("## Measured") + 5)]
    rows = [b for b in blocks(section) if b.startswith("|") and not set(b) <= set("|-: ")][1:]  # no header
    assert 6 <= len(rows) <= 15
    assert all(CITE.search(r) for r in rows), [r[:60] for r in rows if not CITE.search(r)]


def test_cited_files_exist_and_a_committed_script_writes_them():
    scripts = "\n".join(p.read_text() for p in (ROOT / "benchmarks").glob("*.py"))
    for name in set(CITE.findall((ROOT / "README.md").read_text())):
        assert (ROOT / "benchmarks" / "results" / name).is_file(), name
        stem = name.removesuffix(".md")
        assert re.search(rf"[\"']{re.escape(stem)}(\.md|\.json)?[\"']", scripts), f"no script writes {name}"


def test_the_check_catches_a_figure_that_is_not_there(tmp_path):
    (tmp_path / "x.md").write_text("| ratio | 0.36 |\n")
    assert missing_figures("speed 0.36 (`benchmarks/results/x.md`)", tmp_path) == []
    assert missing_figures("speed 0.56x (`benchmarks/results/x.md`)", tmp_path) == ["0.56"]
    assert missing_figures("speed 0.3 (`benchmarks/results/x.md`)", tmp_path) == ["0.3"]  # not a prefix match


def test_a_table_row_is_checked_but_not_its_target():
    rows = _table_rows("| figure | value | target | results |\n|---|---|---|---|\n| speed | 0.36 | 0.5 | `x` |")
    assert rows[-1].split("|")[3].strip() == "" and "0.36" in rows[-1]
