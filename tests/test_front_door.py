"""The front door is light: ``import nemo_fp4qat``, ``nemo-fp4qat --help`` and ``nemo-fp4qat formats`` load neither
torch, Lightning nor modelopt; the fake-quant backend is still in place before any modelopt quantizer runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.twice("the backend installs over modelopt 0.37's modules, whichever loads first")
HEAVY = ("torch", "lightning", "modelopt", "transformers")


def _run(code: str, **env: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _loaded(after: str) -> list[str]:
    code = f"import json, sys\n{after}\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 2), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_help_and_formats_load_no_heavy_library():
    assert _loaded("import nemo_fp4qat") == []
    help_ = "from nemo_fp4qat.cli import main\nimport contextlib, io\ntry:\n"
    help_ += "    with contextlib.redirect_stdout(io.StringIO()): main(['--help'])\nexcept SystemExit: pass"
    assert _loaded(help_) == []
    fmts = "from nemo_fp4qat.cli import main\nimport contextlib, io\n"
    fmts += "with contextlib.redirect_stdout(io.StringIO()): main(['formats'])"
    assert _loaded(fmts) == []


def test_the_backend_is_installed_when_modelopt_loads_after_the_package():
    code = """
import json
import nemo_fp4qat
import modelopt.torch.quantization as mtq
import torch
from nemo_fp4qat.numerics.cpu_backend import cpu_backend_installed
m = torch.nn.Sequential(torch.nn.Linear(32, 32))
mtq.quantize(m, mtq.NVFP4_DEFAULT_CFG, lambda mm: mm(torch.randn(2, 32)))
y = m(torch.randn(2, 32))  # NVFP4 on a CPU tensor: modelopt alone refuses it
print(json.dumps({"installed": cpu_backend_installed(), "finite": bool(torch.isfinite(y).all())}))
"""
    assert _run(code) == {"installed": True, "finite": True}
    before = "import json, modelopt.torch.quantization\nimport nemo_fp4qat\n"
    before += "from nemo_fp4qat.numerics.cpu_backend import cpu_backend_installed\n"
    before += "print(json.dumps({'installed': cpu_backend_installed()}))"
    assert _run(before) == {"installed": True}  # modelopt first, then the package
    off = code.replace("y = m(torch.randn(2, 32))", "y = torch.ones(1)")  # NVFP4 would fail on a CPU without it
    assert _run(off, NEMO_FP4QAT_CPU_BACKEND="0") == {"installed": False, "finite": True}
