"""Training-step overheads on the CPU, measured side by side in one run.

* QAT step time: NVFP4 QAT (FP4QATCallback, NVFP4 weights+inputs on every linear but the output
  layer) / full-precision step, same model, batch and optimizer. Target <= 1.10.
* Peak training memory (max RSS growth of a fresh process) QAT / full precision. Target <= 1.2.
* Monitoring overhead: QAT + QuantizationMonitor(every_n_steps=50, the default) / QAT alone. Target <= 1.05.

Each variant runs in its own process (clean peak-memory reading); variants alternate over rounds
and the per-variant median is used.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

STEPS, WARMUP, ROUNDS = 60, 5, 5


def worker(variant: str) -> dict:
    import lightning.pytorch as pl
    import torch

    from nemo_fp4qat import FP4QATCallback, QuantizationMonitor

    from tiny_models import LitLM, MegatronStyleGPT, loader

    torch.manual_seed(0)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lit = LitLM(MegatronStyleGPT(hidden=256, layers=4), lr=1e-4)
    times: list[float] = []

    class Timer(pl.Callback):
        def on_train_batch_start(self, *a):
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a):
            times.append(time.perf_counter() - self.t)

    cbs: list = [Timer()]
    if variant != "fp32":
        cbs.insert(0, FP4QATCallback(policy="fp_embeddings", schedule="direct", calibration=32))
    if variant == "qat+monitor":
        cbs.insert(1, QuantizationMonitor(out_dir="/tmp/nemo_fp4qat_bench_monitor"))
    trainer = pl.Trainer(max_steps=STEPS + WARMUP, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=cbs)  # fmt: skip
    trainer.fit(lit, loader(n=(STEPS + WARMUP) * 8, seq_len=128, batch_size=8))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"step_s": sum(times[WARMUP:]) / STEPS, "rss_growth_mb": (rss - rss0) / 1024}


def render(runs: dict[str, list[dict]]) -> dict:
    """Medians and ratios of measured runs -> ``results/training_overhead.{md,json}``."""
    from common import machine, write_result

    variants = list(runs)
    med = {v: {k: statistics.median(r[k] for r in runs[v]) for k in ("step_s", "rss_growth_mb")} for v in variants}

    def per_round(a: str, b: str, key: str = "step_s") -> list[float]:
        # a and b ran back to back in each round: a shared machine's slow spells hit both sides of a ratio
        return [x[key] / y[key] for x, y in zip(runs[a], runs[b])]

    step_rounds = per_round("nvfp4_qat", "fp32")
    step_ratio = statistics.median(step_rounds)
    mem_ratio = statistics.median(per_round("nvfp4_qat", "fp32", "rss_growth_mb"))
    mon_ratio = statistics.median(per_round("qat+monitor", "nvfp4_qat"))
    md = "\n".join([
        "## Training overheads on the CPU (QAT step, memory, monitoring)",
        "",
        f"Machine: {machine()}. Model: megatron-style GPT, 4 layers, hidden 256, vocab 96; batch 8x128 tokens; "
        f"AdamW; {STEPS} timed steps after {WARMUP} warm-up; {len(step_rounds)} alternating rounds, one process "
        "per run; step times are medians over rounds, ratios the median of the per-round ratios.",
        "",
        "| variant | step (ms) | peak RSS growth (MB) |",
        "|---|---:|---:|",
        *[f"| {v} | {med[v]['step_s'] * 1e3:.1f} | {med[v]['rss_growth_mb']:.0f} |" for v in variants],
        "",
        f"- QAT step / fp32 step: **{step_ratio:.2f}** (target <= 1.10: {'met' if step_ratio <= 1.10 else 'NOT met'}); "
        f"per round: {', '.join(f'{r:.2f}' for r in step_rounds)}",
        f"- peak memory QAT / fp32: **{mem_ratio:.2f}** (target <= 1.2: {'met' if mem_ratio <= 1.2 else 'NOT met'})",
        f"- monitoring (every 50 steps) / QAT alone: **{mon_ratio:.3f}** "
        f"(target <= 1.05: {'met' if mon_ratio <= 1.05 else 'NOT met'})",
        "",
    ])  # fmt: skip
    data = {"median": med, "runs": runs, "step_ratio": step_ratio, "mem_ratio": mem_ratio, "monitor_ratio": mon_ratio}
    write_result("training_overhead", md, data)
    print(md)
    return data


def main() -> dict:
    from common import alternating_worker_runs

    return render(alternating_worker_runs(__file__, ["fp32", "nvfp4_qat", "qat+monitor"], rounds=ROUNDS))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2])))
    elif sys.argv[1:] == ["--report"]:  # re-render the committed measurements
        render(json.loads((Path(__file__).parent / "results" / "training_overhead.json").read_text())["runs"])
    else:
        main()
