"""Reliability counts (#19): kill points resumed exactly, bad configurations refused, non-finite cases
detected, server faults survived, artifacts lost or corrupted. Writes ``results/reliability.{md,json}``.

* Kill/resume, on both paths (``tests/kill_resume.py``): every named point plus ``RANDOM`` SIGKILLs after a
  random delay, each a fresh run killed, resumed and compared bit for bit with one uninterrupted run
  (losses of every step any process ran, final weights and quantizer buffers, formats, switch history,
  exported files), with a check that no export, partial directory or unfinished checkpoint is left
  half-written. The NeMo path runs in the nemo environment (``--nemo-python``, ``make reliability`` passes it).
* The other counts are the test cases that prove them, run here through pytest (its JUnit XML gives
  the per-case outcome): the bad-configuration table, the non-finite detection tests, the server-fault tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent

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


def _kill_resume(harness) -> tuple[list, float]:
    from kill_resume import reference, scenario
    from rich.progress import track

    root = Path(tempfile.mkdtemp(prefix=f"nemo_fp4qat_kill_{harness.name}_"))
    ref = reference(root, harness)
    points = [*harness.points, *[f"random:{i}" for i in range(RANDOM)]]
    outcomes = [scenario(root, ref, p) for p in track(points, description=f"kill/resume ({harness.name})")]
    return outcomes, ref["seconds"]


def main(nemo_python: str | None) -> dict:
    from common import machine, write_result
    from kill_resume import LIGHTNING, NEMO

    t0 = time.time()
    harnesses = [LIGHTNING, *([dataclasses.replace(NEMO, python=nemo_python)] if nemo_python else [])]
    runs = {h.name: (h, *_kill_resume(h)) for h in harnesses}
    counts = {name: _pytest_counts(args) for name, args in TEST_COUNTS.items()}
    lost = {name: [o for o in outcomes if any(w in p for p in o.problems for w in ("export", "manifest", "stale",
                                                                                      "unfinished"))]
            for name, (_, outcomes, _) in runs.items()}  # fmt: skip
    described = {
        "lightning": "Lightning path: tiny Llama with `FP4QATCallback` (three precision switches, the switch to "
        "NVFP4 recalibrating), Lightning checkpoints every 2 of 12 steps, resumed from `last.ckpt`, unified HF "
        "export at the end",
        "nemo": "NeMo path: `llm.train` of a tiny `llm.GPTModel` (MegatronStrategy, CPU mode) with "
        "`NeMoFP4QATCallback` (three switches), NeMo's `ModelCheckpoint` dist-checkpoints every 2 of 8 steps "
        "behind `NeMoLogger`, `QATAutoResume(resume_if_exists=True)` (NeMo's `AutoResume` plus a resume when the "
        "first `-last` checkpoint is torn), TensorRT-LLM export at the end",
    }
    lines = [
        "## Reliability (`make reliability`, written by benchmarks/bench_reliability.py)",
        "",
        f"Machine: {machine()}. Kill/resume: each point is a fresh run SIGKILLed there, resumed and compared bit "
        "for bit (every recorded loss, final weights and quantizer buffers, formats, switch history, exported "
        "files) with one uninterrupted run.",
        "",
        *[f"- {described[name]} (uninterrupted run {seconds:.0f} s)." for name, (_, _, seconds) in runs.items()],
        "",
        "| what | count | passed |",
        "|---|---:|---:|",
        *[f"| kill points resumed exactly, {name} path (named: {len(h.points)}, random: {RANDOM}) | "
          f"{len(outcomes)} | {sum(o.ok for o in outcomes)} |" for name, (h, outcomes, _) in runs.items()],
        *[f"| {name} | {sum(c.values())} | {c['passed']} |" for name, c in counts.items()],
        *[f"| artifacts lost or corrupted (exports, checkpoints), {name} path | {len(runs[name][1])} runs | "
          f"{len(bad)} lost |" for name, bad in lost.items()],
    ]  # fmt: skip
    for name, (_, outcomes, _) in runs.items():
        lines += [
            "",
            f"| kill point ({name}) | SIGKILLed | resumes | result |",
            "|---|---:|---:|---|",
            *[f"| {o.point} | {o.kills} | {o.resumes} | {'exact' if o.ok else '; '.join(o.problems)[:120]} |"
              for o in outcomes],
        ]  # fmt: skip
    lines += ["", f"Wall time {time.time() - t0:.0f} s.", ""]
    md = "\n".join(lines)
    data = {
        "kill_resume": {name: [o.__dict__ for o in outcomes] for name, (_, outcomes, _) in runs.items()},
        "reference_seconds": {name: seconds for name, (_, _, seconds) in runs.items()},
        "test_counts": counts,
        "lost_or_corrupted": sum(len(bad) for bad in lost.values()),
    }
    write_result("reliability", md, data)
    print(md)
    return data


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nemo-python", help="the nemo environment's python: also run the NeMo path's kill points")
    main(ap.parse_args().nemo_python)
