"""One Megatron-Bridge training run in subprocesses (``tests/workers/bridge_trainer_worker.py``): Bridge's
``pretrain`` initializes torch.distributed and megatron's global state once per process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megatron_utils import free_port
from paths import WORKERS, worker_env
from preloaded import FORK_SERVER, PreloadedProcess


def run_bridge_worker(tmp_path, name: str, ckpt, nproc: int = 1, **env) -> dict:
    """The worker's JSON record of a run (``log``: its stdout and stderr); the env variables are the worker's.
    ``nproc`` > 1 starts that many ranks on gloo (``RANK`` / ``WORLD_SIZE``); global rank 0's record is returned,
    with every rank's under ``ranks``."""
    out = tmp_path / f"{name}.json"
    port = str(free_port())
    dist = {"WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    script, argv = WORKERS / "bridge_trainer_worker.py", [str(out), str(ckpt)]
    procs = []
    for rank in range(nproc):
        rank_env = worker_env(**{k: str(v) for k, v in env.items()}, **dist, RANK=str(rank), LOCAL_RANK=str(rank))
        if FORK_SERVER:  # forked from a process that imported Megatron-Bridge once (preloaded.py)
            logs = tmp_path / f"{name}.logs" / f"rank{rank}"
            procs.append(PreloadedProcess(script, argv, rank_env, Path.cwd(), logs))
        else:
            procs.append(subprocess.Popen([sys.executable, str(script), *argv], env=rank_env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))  # fmt: skip
    logs = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        logs.append((p.returncode, stdout, stderr))
    for rank, (rc, stdout, stderr) in enumerate(logs):
        assert rc == 0, f"rank {rank}: " + stdout[-3000:] + stderr[-6000:]
    ranks = []
    for rank, (_, stdout, stderr) in enumerate(logs):
        data = json.loads((out if rank == 0 else out.with_name(f"{out.name}.rank{rank}")).read_text())
        data["log"] = stdout + stderr
        ranks.append(data)
    return {**ranks[0], "ranks": ranks}
