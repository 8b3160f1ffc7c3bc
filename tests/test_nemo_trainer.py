"""NeMo 2.7.3 Megatron training (nl.Trainer + MegatronStrategy, CPU mode) with FP4 QAT."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nemo


def test_nemo_gpt_trains_with_the_qat_callback_and_switches_formats(tmp_path):
    pytest.importorskip("nemo.collections.llm")
    out = tmp_path / "out.json"
    worker = Path(__file__).parent / "nemo_trainer_worker.py"
    with socket.socket() as sock:  # a fresh port: this pytest process may already hold MASTER_PORT
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    proc = subprocess.run([sys.executable, str(worker), str(out)], capture_output=True, text=True, timeout=900,
                          cwd=tmp_path, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(out.read_text())
    assert res["calibrated"]
    assert [s["num_bits"] for s in res["seen"]] == [[4, 3], [4, 3], [2, 1], [2, 1]]
    assert [s["block"] for s in res["seen"]][2:] == [16, 16]
    assert [(e["step"], e["group"], e["to"]) for e in res["history"]] == [(2, "other", "nvfp4")]
    assert all(math.isfinite(x) for x in res["loss"])
