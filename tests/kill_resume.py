"""Kill-and-resume harness: SIGKILL training at named and random points, resume, compare bit for bit.

Each kill point is one scenario: a fresh run directory, a worker process that SIGKILLs itself at the
point (or is SIGKILLed by this driver after a random delay), then workers that resume from whatever is
on disk until one finishes. The finished scenario must equal one uninterrupted run exactly:

* every loss any process recorded for a step equals the uninterrupted run's loss at that step (a step run
  again after a resume gives the same loss as the first time);
* the final model state (every weight and quantizer buffer, by sha256), formats and switch history;
* the exported checkpoint, file by file (sha256 from its manifest), with nothing half-written: no
  ``.partial``/``.old`` directory left beside it and every file matching its manifest.

Used by ``tests/reliability/test_kill_resume.py`` (a few points) and ``benchmarks/bench_reliability.py``
(every point, counts in RESULTS.md).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent
WORKER = HERE / "kill_resume_worker.py"

# Named points (EVENT:N, see kill_resume_worker): calibration (first and switch recalibrations), each
# switch, steps, checkpoint writes (torn files), and every stage of the export. An uninterrupted run has
# 2 calibration forwards (the start; the switch to NVFP4, whose amax is recalibrated: MX formats have none),
# 3 switches, 12 steps, 18 checkpoint writes (every 2 steps and last.ckpt) and one export.
LIGHTNING_POINTS = [
    "calib:1", "calib:2",
    "switch:1", "switch:2", "switch:3",
    "step:1", "step:3", "step:6", "step:9", "step:11", "step:12",
    "ckpt:1", "ckpt:2", "ckpt:5", "ckpt:8", "ckpt:12", "ckpt:17", "ckpt:18",
    "export_weights:1", "export_manifest:1", "export_rename:1",
]  # fmt: skip


@dataclass
class Outcome:
    point: str
    ok: bool
    kills: int
    resumes: int
    problems: list[str] = field(default_factory=list)


def _run_worker(run_dir: Path, spec: str | None, timeout: float = 600, kill_after: float | None = None) -> int:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(WORKER), str(run_dir), *([spec] if spec else [])]
    with open(run_dir.parent / f"{run_dir.name}.log", "ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    if kill_after is not None:
        try:
            return proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            return proc.wait()
    return proc.wait(timeout=timeout)


def reference(root: Path) -> dict:
    """The uninterrupted run, timed (random kill delays are drawn within its wall time)."""
    run = root / "reference"
    run.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    rc = _run_worker(run, None)
    if rc != 0:
        raise RuntimeError(f"the uninterrupted run failed (rc {rc}); see {root / 'reference.log'}")
    return {"dir": run, "seconds": time.perf_counter() - t, **_collect(run)}


def _collect(run: Path) -> dict:
    losses: dict[int, list[float]] = {}
    for line in (run / "losses.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line torn by the kill: not a recorded step
            continue
        losses.setdefault(rec["step"], []).append(rec["loss"])
    final = json.loads((run / "final.json").read_text()) if (run / "final.json").exists() else None
    manifest_path = run / "export" / "nemo_fp4qat_manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    return {"losses": losses, "final": final, "manifest": manifest}


def _compare(ref: dict, run: Path) -> list[str]:
    from nemo_fp4qat.export.atomic import file_sha256

    got = _collect(run)
    problems = []
    for step, values in got["losses"].items():
        want = ref["losses"].get(step, [None])[0]
        bad = [v for v in values if v != want]
        if bad:
            problems.append(f"step {step}: loss {bad[0]!r} != uninterrupted {want!r}")
    if set(got["losses"]) != set(ref["losses"]):
        problems.append(f"steps recorded {sorted(got['losses'])} != {sorted(ref['losses'])}")
    if got["final"] is None:
        problems.append("no final state (the resumed run did not finish)")
    else:
        for key in ("formats", "history", "global_step"):  # not "events": a resumed process sees fewer
            if got["final"][key] != ref["final"][key]:
                problems.append(f"final {key} differs")
        diff = [k for k, v in ref["final"]["state"].items() if got["final"]["state"].get(k) != v]
        if diff or set(got["final"]["state"]) != set(ref["final"]["state"]):
            problems.append(f"final state differs in {len(diff)} tensors, e.g. {diff[:2]}")
    if got["manifest"] is None:
        problems.append("no complete export (manifest missing)")
    else:
        for rel, meta in ref["manifest"]["files"].items():
            mine = got["manifest"]["files"].get(rel)
            if mine == meta:
                continue
            # build_engine.sh, engine_plan.json and validation.json name the export's own path
            same = mine is not None and (run / "export" / rel).read_bytes().replace(bytes(run), b"<run>") == (
                ref["dir"] / "export" / rel).read_bytes().replace(bytes(ref["dir"]), b"<run>")  # fmt: skip
            if not same:
                problems.append(f"exported {rel} differs from the uninterrupted run's")
        if set(got["manifest"]["files"]) != set(ref["manifest"]["files"]):
            problems.append("the export holds other files than the uninterrupted run's")
        for rel, meta in got["manifest"]["files"].items():
            if file_sha256(run / "export" / rel) != meta["sha256"]:
                problems.append(f"exported {rel} does not match its manifest")
    stale = [p.name for p in run.iterdir() if ".partial-" in p.name or ".old-" in p.name]
    if stale:
        problems.append(f"stale partial export directories left: {stale}")
    return problems


def scenario(root: Path, ref: dict, point: str, seed: int = 0, max_resumes: int = 4) -> Outcome:
    """Kill at ``point`` (``EVENT:N``, or ``random:K`` = SIGKILL after a random delay), resume, compare."""
    run = root / point.replace(":", "_")
    run.mkdir(parents=True, exist_ok=True)
    if point.startswith("random"):
        delay = random.Random(f"{seed}:{point}").uniform(0.1, 1.0) * ref["seconds"]
        rc = _run_worker(run, None, kill_after=delay)
    else:
        rc = _run_worker(run, point)
    kills = int(rc == -signal.SIGKILL)
    resumes = 0
    while not (run / "final.json").exists() and resumes < max_resumes:
        resumes += 1
        rc = _run_worker(run, None)
        if rc not in (0, -signal.SIGKILL):
            return Outcome(point, False, kills, resumes, [f"resume failed with rc {rc}; see {run}.log"])
    problems = [] if kills or point.startswith("random") else [f"the kill point {point} was never reached"]
    problems += _compare(ref, run)
    return Outcome(point, not problems, kills, resumes, problems)
