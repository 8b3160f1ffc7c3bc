"""Shared helpers for the benchmarks: timing, machine description, writing results."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"


def best_of(fn: Callable[[], object], reps: int = 5, warmup: int = 1) -> float:
    """Best wall time of ``reps`` runs (seconds): the least disturbed by the rest of the machine."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    libs = f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    try:
        import transformers

        libs += f", transformers {transformers.__version__}"
    except ImportError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {libs}"


def write_result(name: str, markdown: str, data: dict) -> None:
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{name}.md").write_text(markdown)
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(data, indent=1))


def rerender(name: str, render: Callable[[dict], str], plot: Callable[[dict, Path], None] | None = None) -> None:
    """``--render``: rewrite results/<name>.md (and its PNG) from the committed <name>.json, measuring nothing."""
    data = json.loads((RESULTS_DIR / f"{name}.json").read_text())
    write_result(name, render(data), data)
    if plot is not None:
        plot(data, RESULTS_DIR / f"{name}.png")


def alternating_worker_runs(script: str, variants: list[str], rounds: int) -> dict[str, list[dict]]:
    """Run ``script --worker VARIANT`` in a fresh process per run, variants alternating over ``rounds``
    (so drift of the machine hits every variant alike); each run's last stdout line is its JSON result."""
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            out = subprocess.run([sys.executable, script, "--worker", v], capture_output=True, text=True, check=True)
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs


def step_overhead_pair(n_batches: int) -> tuple[dict, dict, list]:
    """The CPU step-overhead benchmark's two models (megatron-style GPT 4x256 in a ``LitLM``, same init): full
    precision and NVFP4 QAT prepared as ``FP4QATCallback`` does before the first step (policy ``fp_embeddings``,
    direct, 32 calibration samples), an AdamW each, and ``n_batches`` batches of 8x128 tokens. For measuring the
    two side by side in one process (``tests/helpers/`` must be on ``sys.path`` for ``tiny_models``)."""
    import copy

    import torch

    from nemo_fp4qat import QATController

    from tiny_models import LitLM, MegatronStyleGPT, loader

    torch.manual_seed(0)
    fp32 = LitLM(MegatronStyleGPT(hidden=256, layers=4), lr=1e-4)
    qat = copy.deepcopy(fp32)
    batches = list(loader(n=n_batches * 8, seq_len=128, batch_size=8))
    ctl = QATController(policy="fp_embeddings", schedule="direct", calibration=32, forward_fn=lambda m, b: m(b))
    ctl.prepare(qat.net)
    ctl.calibrate(qat.net, batches[:4])
    ctl.step(qat.net, 0)
    models = {"fp32": fp32, "nvfp4_qat": qat}
    for lit in models.values():
        lit.log = lambda *a, **k: None  # no trainer to log to
    return models, {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}, batches


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (benchmarks run headless and only write PNGs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    """Write ``fig`` to ``path`` as the results' PNGs are written (tight layout, 120 dpi) and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
