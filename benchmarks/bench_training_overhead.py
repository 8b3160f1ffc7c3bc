"""Training-step overheads on the CPU, measured side by side in one run.

* QAT step time: NVFP4 QAT (FP4QATCallback, NVFP4 weights+inputs on every linear but the output
  layer) / full-precision step, same model, batch and optimizer. Target <= 1.05 (issue 37; 1.10 before).
* Peak training memory (max RSS growth of a fresh process) QAT / full precision. Target <= 1.2.
* Monitoring overhead: QAT + QuantizationMonitor(every_n_steps=50, the default) / QAT alone. Target <= 1.05.

Each variant runs in its own process (clean peak-memory reading); variants alternate over rounds
and the per-variant median is used. Separate processes on a shared 2-core machine spread the step ratio
widely (the full-precision step alone moves by 20-40% from process to process), so the step ratio is
also measured side by side in one process (``interleaved``): the full-precision and the QAT model take
turns step by step on the same batches, and each QAT step is divided by the full-precision step next to it.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent

STEPS, WARMUP, ROUNDS = 60, 5, 5
INTERLEAVED_ROUNDS = 3
STEP_TARGET = 1.05


def worker(variant: str) -> dict:
    import lightning.pytorch as pl
    import torch

    from nemo_fp4qat import FP4QATCallback, QuantizationMonitor

    from tiny_models import LitLM, MegatronStyleGPT, loader

    torch.manual_seed(0)
    # modelopt's quantization package (about 90 MB of modules) is imported on first use; loaded here in every
    # variant so that the growth below is training's, not an import only the QAT variants would pay inside it
    import modelopt.torch.quantization  # noqa: F401

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


def interleaved_worker() -> dict:
    """fp32 and QAT steps taking turns in one process; per-step times."""
    from common import step_overhead_pair

    models, opts, batches = step_overhead_pair(STEPS + WARMUP)
    times: dict[str, list[float]] = {k: [] for k in models}

    def step(name: str, batch, i: int) -> None:
        lit, opt = models[name], opts[name]
        loss = lit.training_step(batch, i)
        opt.zero_grad()
        loss.backward()
        opt.step()

    names = list(models)
    for i, batch in enumerate(batches):
        for name in names[i % 2 :] + names[: i % 2]:  # each model goes first in turn
            t = time.perf_counter()
            step(name, batch, i)
            times[name].append(time.perf_counter() - t)
    return {k: v[WARMUP:] for k, v in times.items()}


def render_interleaved(rounds: list[dict]) -> tuple[list[str], dict]:
    """Paired per-step ratios of the interleaved runs -> markdown lines and figures."""
    per_step = [q / f for r in rounds for q, f in zip(r["nvfp4_qat"], r["fp32"])]
    out = {
        "ratio": statistics.median(per_step),
        "per_round": [statistics.median([q / f for q, f in zip(r["nvfp4_qat"], r["fp32"])]) for r in rounds],
        "qat_step_ms": statistics.median(t for r in rounds for t in r["nvfp4_qat"]) * 1e3,
        "fp32_step_ms": statistics.median(t for r in rounds for t in r["fp32"]) * 1e3,
    }
    lines = [
        f"Side by side in one process ({len(rounds)} processes x {STEPS} steps after {WARMUP} warm-up; the two "
        "models take turns step by step on the same batches; ratio = median over all steps of QAT step / the "
        "full-precision step beside it):",
        "",
        "| variant | step (ms) |",
        "|---|---:|",
        f"| fp32 | {out['fp32_step_ms']:.1f} |",
        f"| nvfp4_qat | {out['qat_step_ms']:.1f} |",
        "",
        f"- QAT step / fp32 step, side by side: **{out['ratio']:.3f}** (target <= {STEP_TARGET}: "
        f"{'met' if out['ratio'] <= STEP_TARGET else 'NOT met'}); per process: "
        f"{', '.join(f'{r:.3f}' for r in out['per_round'])}",
    ]
    return lines, out


def render(runs: dict[str, list[dict]], interleaved: list[dict] | None = None) -> dict:
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
        f"- QAT step / fp32 step, separate processes (Lightning loop): **{step_ratio:.2f}** "
        f"(target <= {STEP_TARGET}: {'met' if step_ratio <= STEP_TARGET else 'NOT met'}); "
        f"per round: {', '.join(f'{r:.2f}' for r in step_rounds)}; step per process: fp32 "
        f"{min(r['step_s'] for r in runs['fp32']) * 1e3:.1f} to {max(r['step_s'] for r in runs['fp32']) * 1e3:.1f} ms, "
        f"QAT {min(r['step_s'] for r in runs['nvfp4_qat']) * 1e3:.1f} to "
        f"{max(r['step_s'] for r in runs['nvfp4_qat']) * 1e3:.1f} ms",
        f"- peak memory QAT / fp32: **{mem_ratio:.2f}** (target <= 1.2: {'met' if mem_ratio <= 1.2 else 'NOT met'})",
        f"- monitoring (every 50 steps) / QAT alone: **{mon_ratio:.3f}** "
        f"(target <= 1.05: {'met' if mon_ratio <= 1.05 else 'NOT met'})",
        "",
    ])  # fmt: skip
    data = {"median": med, "runs": runs, "step_ratio": step_ratio, "mem_ratio": mem_ratio, "monitor_ratio": mon_ratio}
    if interleaved:
        lines, data["interleaved"] = render_interleaved(interleaved)
        md += "\n" + "\n".join(lines) + "\n"
        data["interleaved_runs"] = interleaved
    write_result("training_overhead", md, data)
    print(md)
    return data


def main() -> dict:
    from common import alternating_worker_runs

    runs = alternating_worker_runs(__file__, ["fp32", "nvfp4_qat", "qat+monitor"], rounds=ROUNDS)
    interleaved = alternating_worker_runs(__file__, ["interleaved"], rounds=INTERLEAVED_ROUNDS)["interleaved"]
    return render(runs, interleaved)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(interleaved_worker() if sys.argv[2] == "interleaved" else worker(sys.argv[2])))
    elif sys.argv[1:] == ["--report"]:  # re-render the committed measurements
        saved = json.loads((Path(__file__).parent / "results" / "training_overhead.json").read_text())
        render(saved["runs"], saved.get("interleaved_runs"))
    else:
        main()
