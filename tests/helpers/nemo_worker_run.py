"""Running ``nemo_trainer_worker.py`` as its own process(es), for the NeMo tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megatron_utils import free_port
from paths import WORKERS, worker_env
from preloaded import FORK_SERVER, PreloadedProcess


def run_worker(tmp_path, name, *args, steps=4, devices=1, tp=1, export_dir=None, **env_extra):
    """Run the worker (``DEVICES`` processes) and return its JSON (one per rank when ``devices > 1``)."""
    out = tmp_path / f"{name}.json"
    worker = WORKERS / "nemo_trainer_worker.py"
    port = free_port()  # a fresh port: this pytest process may already hold MASTER_PORT
    env = {**worker_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "STEPS": str(steps),
           "DEVICES": str(devices), "TP": str(tp)}  # fmt: skip
    if export_dir:
        env["EXPORT_DIR"] = str(export_dir)
    env.update({k: str(v) for k, v in env_extra.items()})
    if FORK_SERVER:  # forked from a process that imported NeMo once (preloaded.py); Lightning starts other ranks
        proc = PreloadedProcess(worker, [str(out), *args], env, tmp_path, tmp_path / f"{name}.logs")
        stdout, stderr = proc.communicate(timeout=900)
    else:
        done = subprocess.run([sys.executable, str(worker), str(out), *args], capture_output=True, text=True,
                              timeout=900, cwd=tmp_path, env=env)  # fmt: skip
        proc, stdout, stderr = done, done.stdout, done.stderr
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    if devices > 1:
        return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(devices)]
    return json.loads(out.read_text())
