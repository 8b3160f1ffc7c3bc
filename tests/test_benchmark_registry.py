"""Every benchmark script is registered in benchmarks/registry.py (or is a declared helper), every results file
has its registered writer, and the registry's command line lists, runs and re-renders."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from paths import ROOT

BENCH = ROOT / "benchmarks"


def _registry():
    spec = importlib.util.spec_from_file_location("benchmark_registry", BENCH / "registry.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_every_script_is_registered_or_a_helper_and_every_results_file_has_a_writer():
    reg = _registry()
    scripts = {b.script for b in reg.BENCHMARKS}
    assert {p.name for p in BENCH.glob("*.py")} == scripts | set(reg.HELPERS)
    assert not scripts & set(reg.HELPERS)
    written = {r for b in reg.BENCHMARKS for r in b.results}
    assert {p.stem for p in (BENCH / "results").glob("*.md")} <= written
    for b in reg.BENCHMARKS:
        assert (BENCH / b.script).is_file(), b.script
        for flag in b.render or ():
            assert f'"{flag}"' in (BENCH / b.script).read_text(), (b.name, flag)


def test_the_command_line_lists_and_refuses_by_name():
    run = [sys.executable, str(BENCH / "registry.py")]
    out = subprocess.run([*run, "list", "--group", "bench"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "training_overhead" in out.stdout and "levers" not in out.stdout
    bad = subprocess.run([*run, "run", "levrs"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "did you mean 'levers'" in bad.stderr
    none = subprocess.run([*run, "render", "demo"], capture_output=True, text=True, timeout=120)
    assert none.returncode != 0 and "no re-render" in none.stderr


def test_render_rewrites_a_results_file_from_its_json_unchanged():
    md = BENCH / "results" / "mc.md"
    before = md.read_bytes()
    try:
        out = subprocess.run([sys.executable, str(BENCH / "registry.py"), "render", "mc"], capture_output=True,
                             text=True, timeout=600)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert md.read_bytes() == before
    finally:
        md.write_bytes(before)
