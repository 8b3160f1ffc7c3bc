"""One Megatron-Bridge training run in a subprocess (``tests/workers/bridge_trainer_worker.py``): Bridge's
``pretrain`` initializes torch.distributed and megatron's global state once per process."""

from __future__ import annotations

import json
import subprocess
import sys

from paths import WORKERS, worker_env


def run_bridge_worker(tmp_path, name: str, ckpt, **env) -> dict:
    """The worker's JSON record of a run (``log``: its stdout and stderr); the env variables are the worker's."""
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "bridge_trainer_worker.py"), str(out), str(ckpt)],
        env=worker_env(**{k: str(v) for k, v in env.items()}),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    data = json.loads(out.read_text())
    data["log"] = proc.stdout + proc.stderr
    return data
