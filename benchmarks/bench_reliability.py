"""Reliability counts (#19): kill points resumed exactly, bad configurations refused, non-finite cases
detected, server faults survived, artifacts lost or corrupted. Writes ``results/reliability.{md,json}``.

* Kill/resume: every named point of ``tests/kill_resume.LIGHTNING_POINTS`` plus ``RANDOM`` SIGKILLs after a
  random delay, each a fresh run killed, resumed and compared bit for bit with one uninterrupted run
  (losses of every step any process ran, final weights and quantizer buffers, formats, switch history,
  exported files), with a check that no export or partial directory is left half-written.
* The other counts are the test cases that prove them, run here through pytest (its JUnit XML gives
  the per-case outcome): the bad-configuration table, the non-finite detection tests, the server-fault tests.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))

RANDOM = 5
# (what is counted, pytest selection)
TEST_COUNTS = {
    "bad configurations refused with a message naming field and fix": ["tests/qat/test_bad_config.py"],
    "non-finite cases detected (weights, inputs, amax, gradients, loss)": [
        "tests/lightning/test_monitor.py", "-k", "nonfinite or inf or nan"],
    "server faults survived (oversize, slow client, 2x concurrency, backend exception, disconnect, timeout)": [
        "tests/serve/test_serve_faults.py",
        "tests/serve/test_serve.py::test_a_request_past_the_timeout_gets_504_and_its_generation_stops",
        "tests/serve/test_serve_openai.py::test_a_client_that_disconnects_mid_stream_frees_its_rows"],
}  # fmt: skip


def _pytest_counts(args: list[str]) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args],
                       cwd=ROOT, capture_output=True, text=True)  # fmt: skip
        cases = ET.parse(xml).getroot().iter("testcase")
        out = {"passed": 0, "failed": 0, "skipped": 0}
        for c in cases:
            kind = "failed" if c.find("failure") is not None or c.find("error") is not None else (
                "skipped" if c.find("skipped") is not None else "passed")  # fmt: skip
            out[kind] += 1
        return out


def main() -> dict:
    from common import machine, write_result
    from kill_resume import LIGHTNING_POINTS, reference, scenario
    from rich.progress import track

    t0 = time.time()
    root = Path(tempfile.mkdtemp(prefix="nemo_fp4qat_kill_"))
    ref = reference(root)
    points = [*LIGHTNING_POINTS, *[f"random:{i}" for i in range(RANDOM)]]
    outcomes = [scenario(root, ref, p) for p in track(points, description="kill/resume scenarios")]
    exact = [o for o in outcomes if o.ok]
    lost = [o for o in outcomes if any("export" in p or "manifest" in p or "stale" in p for p in o.problems)]
    counts = {name: _pytest_counts(args) for name, args in TEST_COUNTS.items()}
    lines = [
        "## Reliability (`make reliability`, written by benchmarks/bench_reliability.py)",
        "",
        f"Machine: {machine()}. Kill/resume: Lightning path, tiny Llama with `FP4QATCallback` (three precision "
        "switches, the switch to NVFP4 recalibrating), checkpoints every 2 of 12 steps, unified HF export at the "
        "end; each point is a fresh run SIGKILLed there, resumed from `last.ckpt` and compared bit for bit with one "
        f"uninterrupted run ({ref['seconds']:.0f} s).",
        "",
        "| what | count | passed |",
        "|---|---:|---:|",
        f"| kill points resumed exactly (named: {len(LIGHTNING_POINTS)}, random: {RANDOM}) | {len(outcomes)} | "
        f"{len(exact)} |",
        *[f"| {name} | {sum(c.values())} | {c['passed']} |" for name, c in counts.items()],
        f"| artifacts lost or corrupted (exports, checkpoints) | {len(outcomes)} runs | {len(lost)} lost |",
        "",
        "| kill point | SIGKILLed | resumes | result |",
        "|---|---:|---:|---|",
        *[f"| {o.point} | {o.kills} | {o.resumes} | {'exact' if o.ok else '; '.join(o.problems)[:120]} |"
          for o in outcomes],
        "",
        f"Wall time {time.time() - t0:.0f} s.",
        "",
    ]  # fmt: skip
    md = "\n".join(lines)
    data = {
        "kill_resume": [o.__dict__ for o in outcomes],
        "reference_seconds": ref["seconds"],
        "test_counts": counts,
        "lost_or_corrupted": len(lost),
    }
    write_result("reliability", md, data)
    print(md)
    return data


if __name__ == "__main__":
    main()
