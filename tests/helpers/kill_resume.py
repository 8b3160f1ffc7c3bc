"""Kill-and-resume harness: SIGKILL training at named and random points, resume, compare bit for bit.

Each kill point is one scenario: a fresh run directory, a worker process that SIGKILLs itself at the
point (or is SIGKILLed by this driver after a random delay), then workers that resume from whatever is
on disk until one finishes. The finished scenario must equal one uninterrupted run exactly:

* every loss any process recorded for a step equals the uninterrupted run's loss at that step (a step run
  again after a resume gives the same loss as the first time);
* the final model state (every weight and quantizer buffer, by sha256), formats and switch history;
* the exported checkpoint, file by file (sha256 from its manifest), with nothing half-written: no
  ``.partial``/``.old`` directory left beside it and every file matching its manifest.

Two paths share the harness: Lightning (``kill_resume_worker.py``: ``FP4QATCallback`` on a tiny Llama, a
unified HF export) and NeMo (``kill_resume_nemo_worker.py``: ``llm.train`` with ``NeMoFP4QATCallback``, NeMo's
dist-checkpoints and ``AutoResume``, a TensorRT-LLM export; nemo env). Used by
``tests/lightning/test_kill_resume.py`` and ``tests/nemo/test_nemo_kill_resume.py`` (a few points each) and
``benchmarks/bench_reliability.py`` (every point, counts in RESULTS.md).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from paths import WORKERS, worker_env
from preloaded import FORK_SERVER, PreloadedProcess, start_server

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
# NeMo path: 4 calibration forwards (2 batches at the start, 2 at the switch to NVFP4), 3 switches, 8 steps,
# 8 dist-checkpoint saves (steps 2, 4, 6, 8 and a -last copy of each: torn, or complete with NeMo's unfinished
# marker still on disk; 11 marker removals, 3 of them for superseded -last copies) and one TensorRT-LLM export.
NEMO_POINTS = [
    "calib:1", "calib:3",
    "switch:1", "switch:2", "switch:3",
    "step:1", "step:3", "step:5", "step:7", "step:8",
    "ckpt_torn:1", "ckpt_torn:2", "ckpt_torn:5", "ckpt_torn:8",
    "ckpt_marker:1", "ckpt_marker:3", "ckpt_marker:6", "ckpt_marker:11",
    "export_weights:1", "export_manifest:1", "export_rename:1",
]  # fmt: skip


@dataclass(frozen=True)
class Harness:
    """One path: its worker script, named kill points and the interpreter that runs it."""

    name: str
    worker: Path
    points: list[str]
    python: str = sys.executable


LIGHTNING = Harness("lightning", WORKERS / "kill_resume_worker.py", LIGHTNING_POINTS)
NEMO = Harness("nemo", WORKERS / "kill_resume_nemo_worker.py", NEMO_POINTS)


@dataclass
class Outcome:
    point: str
    ok: bool
    kills: int
    resumes: int
    problems: list[str] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forked(harness: Harness) -> bool:
    """Whether the harness's workers fork from the preloaded server (this interpreter's) or start as processes."""
    return FORK_SERVER and harness.python == sys.executable


def _run_worker(harness: Harness, run_dir: Path, spec: str | None, timeout: float = 900,
                kill_after: float | None = None) -> int:  # fmt: skip
    # NeMo initialises torch.distributed (gloo) in each process: a fresh port each time
    env = worker_env(PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    argv = [str(run_dir), *([spec] if spec else [])]
    log = run_dir.parent / f"{run_dir.name}.log"
    # its own session = its own process group, which a kill takes down whole (the worker's children too)
    proc: PreloadedProcess | subprocess.Popen
    if _forked(harness):  # forked from a process that imported its libraries once
        proc = PreloadedProcess(harness.worker, argv, env, Path.cwd(), None, new_session=True,
                                stdout=Path(os.devnull), stderr=log)  # fmt: skip
    else:
        with open(log, "ab") as err:
            proc = subprocess.Popen([harness.python, str(harness.worker), *argv], env=env, stdout=subprocess.DEVNULL,
                                    stderr=err, start_new_session=True)  # fmt: skip
    if kill_after is not None:
        try:
            return proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()
    return proc.wait(timeout=timeout)


def reference(root: Path, harness: Harness = LIGHTNING) -> dict:
    """The uninterrupted run, timed (random kill delays are drawn within its wall time)."""
    run = root / "reference"
    run.mkdir(parents=True, exist_ok=True)
    if _forked(harness):  # random kill delays are drawn within a forked run's time, not the server's start
        start_server()
    t = time.perf_counter()
    rc = _run_worker(harness, run, None)
    if rc != 0:
        raise RuntimeError(f"the uninterrupted run failed (rc {rc}); see {root / 'reference.log'}")
    return {"dir": run, "seconds": time.perf_counter() - t, "harness": harness, **_collect(run)}


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


def _comparable(files: dict) -> dict:
    """The manifest entries compared with the uninterrupted run's: all but ``nemo_context/``, NeMo's trainer
    context dump, whose artifact files get random (uuid) names in every process (checked for io.json only)."""
    return {rel: meta for rel, meta in files.items() if not rel.startswith("nemo_context/")}


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
        ref_files, got_files = _comparable(ref["manifest"]["files"]), _comparable(got["manifest"]["files"])
        for rel, meta in ref_files.items():
            mine = got_files.get(rel)
            if mine == meta:
                continue
            # build_engine.sh, engine_plan.json and validation.json name the export's own path
            same = mine is not None and (run / "export" / rel).read_bytes().replace(bytes(run), b"<run>") == (
                ref["dir"] / "export" / rel).read_bytes().replace(bytes(ref["dir"]), b"<run>")  # fmt: skip
            if not same:
                problems.append(f"exported {rel} differs from the uninterrupted run's")
        if set(got_files) != set(ref_files):
            problems.append("the export holds other files than the uninterrupted run's")
        if any(r.startswith("nemo_context/") for r in ref["manifest"]["files"]) and (
            "nemo_context/io.json" not in got["manifest"]["files"]
        ):
            problems.append("the export's nemo_context has no io.json")
        for rel, meta in got["manifest"]["files"].items():
            if file_sha256(run / "export" / rel) != meta["sha256"]:
                problems.append(f"exported {rel} does not match its manifest")
    stale = [p.name for p in run.iterdir() if ".partial-" in p.name or ".old-" in p.name]
    if stale:
        problems.append(f"stale partial export directories left: {stale}")
    unfinished = [p.name for p in run.glob("ckpt/*-unfinished")]  # NeMo's marker of a checkpoint being written
    if unfinished:
        problems.append(f"unfinished checkpoints left: {unfinished}")
    return problems


def scenario(root: Path, ref: dict, point: str, seed: int = 0, max_resumes: int = 4) -> Outcome:
    """Kill at ``point`` (``EVENT:N``, or ``random:K`` = SIGKILL after a random delay), resume, compare."""
    harness = ref["harness"]
    run = root / point.replace(":", "_")
    run.mkdir(parents=True, exist_ok=True)
    if point.startswith("random"):
        delay = random.Random(f"{seed}:{point}").uniform(0.1, 1.0) * ref["seconds"]
        rc = _run_worker(harness, run, None, kill_after=delay)
    else:
        rc = _run_worker(harness, run, point)
    kills = int(rc == -signal.SIGKILL)
    resumes = 0
    while not (run / "final.json").exists() and resumes < max_resumes:
        resumes += 1
        rc = _run_worker(harness, run, None)
        if rc not in (0, -signal.SIGKILL):
            return Outcome(point, False, kills, resumes, [f"resume failed with rc {rc}; see {run}.log"])
    problems = [] if kills or point.startswith("random") else [f"the kill point {point} was never reached"]
    problems += _compare(ref, run)
    return Outcome(point, not problems, kills, resumes, problems)
