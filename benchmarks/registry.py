"""Every benchmark, in one registry, behind one command line.

    python benchmarks/registry.py list [--group GROUP]      # name, group, results file, what it measures
    python benchmarks/registry.py run NAME... [-- ARGS]     # run benchmarks (each its own process), ARGS passed on
    python benchmarks/registry.py run --group GROUP         # every benchmark of a group (make bench: "bench")
    python benchmarks/registry.py render NAME               # rewrite its results file from its committed JSON

Groups: ``bench`` (speed, memory, export, serving, the demo's figures; ``make bench``), ``accuracy`` (tens of
minutes each; ``make bench-accuracy``), ``accuracy-peers`` (with the benchmark-only peers on ``PYTHONPATH``),
``mutation`` (``make mutate``), ``reliability`` (``make reliability``), ``gpu`` (``make gpu-check``, on a GPU).
The scripts that are not benchmarks are helpers the benchmarks import (``HELPERS``); the tests check that every
script is one or the other and that every results file has its writer here. Benchmarks that build the tests'
tiny models import ``tests/helpers/``: the registry runs every script with it on ``PYTHONPATH`` (as the
Makefile's targets do).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: the script that runs it, what it writes, and how its markdown is re-rendered."""

    name: str
    script: str
    group: str
    results: tuple[str, ...]
    what: str
    render: tuple[str, ...] | None = None  # the script's arguments that re-render without measuring


BENCHMARKS = [
    Benchmark("cpu_fakequant", "bench_cpu_fakequant.py", "bench", ("cpu_fakequant",),
              "CPU fake-quant kernels vs a tensor copy and modelopt's NVFP4QTensor"),
    Benchmark("training_overhead", "bench_training_overhead.py", "bench", ("training_overhead",),
              "QAT / full-precision step, side by side; peak memory; monitoring cost", ("--report",)),
    Benchmark("qat_step_profile", "profile_qat_step.py", "bench", ("qat_step_profile",),
              "where a CPU QAT step's extra time goes, per op"),
    Benchmark("demo", "bench_demo.py", "bench", ("demo",), "make demo's wall time, gap to BF16 and recovery"),
    Benchmark("export_size", "bench_export_size.py", "bench", ("export_size",),
              "bytes of the SmolLM2 export per format against BF16"),
    Benchmark("serve_load", "bench_serve.py", "bench", ("serve_load",), "the OpenAI server under concurrent clients"),
    Benchmark("accuracy", "bench_accuracy.py", "accuracy", ("accuracy",),
              "one seed of every policy and schedule, PTQ and QAT, on SmolLM2"),
    Benchmark("accuracy_followup", "bench_accuracy_followup.py", "accuracy", ("accuracy_followup",),
              "the follow-up rows of the accuracy table (QAD from the fine-tune)"),
    Benchmark("accuracy_seeds", "bench_accuracy_seeds.py", "accuracy-peers", ("accuracy_seeds",),
              "ours vs torchao and modelopt QAT over seeds"),
    Benchmark("pareto", "bench_pareto.py", "accuracy", ("pareto",), "perplexity against bits per weight",
              ("--render",)),
    Benchmark("levers", "bench_levers.py", "accuracy", ("levers",), "the deployable accuracy levers, PTQ and QAD",
              ("--render",)),
    Benchmark("recipe_seeds", "bench_recipe_seeds.py", "accuracy", ("recipe_seeds",),
              "the demo's recipe against no lever over seeds", ("--render",)),
    Benchmark("auto_policy", "bench_auto_policy.py", "accuracy", ("auto_policy", "auto_policy_seeds"),
              "modelopt AutoQuantize's policy vs the presets at equal bits, PTQ and QAD (--only: over seeds)",
              ("--render",)),
    Benchmark("qad_tokens", "bench_qad_tokens.py", "accuracy", ("qad_tokens",),
              "QAD's gap and recovery against distinct training tokens, W4A16 beside", ("--render",)),
    Benchmark("demo_qad_lr", "bench_demo_qad_lr.py", "accuracy", ("demo_qad_lr",),
              "the demo's QAD stage against its learning rate, on the demo's policy", ("--render",)),
    Benchmark("scale_levers", "bench_scale_levers.py", "accuracy", ("scale_levers",),
              "modelopt's NVFP4 scale levers (mse, local Hessian, 4/6, act headroom, LSQ) vs the demo's recipe",
              ("--render",)),
    Benchmark("mc", "bench_mc.py", "accuracy", ("mc",), "multiple choice with a paired test", ("--render",)),
    Benchmark("qad_levers", "bench_qad_levers.py", "accuracy", ("qad_levers",),
              "GPTQ start and distillation losses side by side over seeds, 32k tokens, paired MC", ("--render",)),
    Benchmark("mutation", "run_mutation.py", "mutation", ("mutation",), "mutation testing of the numerics"),
    Benchmark("reliability", "bench_reliability.py", "reliability", ("reliability",),
              "kill/resume at every point, bad configurations, server faults"),
    Benchmark("gpu_check", "gpu_check.py", "gpu", ("gpu_check", "gpu_h200"),
              "the GPU acceptance run (parity, QAD -> export -> validate, step time, QAD at 1M tokens)"),
    Benchmark("qad_budget_cost", "gpu_qad_budget.py", "bench", ("qad_budget_cost",),
              "the GPU run's qad_budget section: its cost per token measured here, its GPU time estimated",
              ("--render",)),
]  # fmt: skip
# Scripts the benchmarks use that are not benchmarks themselves.
HELPERS = {
    "accuracy_data.py": "the demo workload's data for the accuracy benchmarks",
    "activation_range_search.py": "the per-layer activation range search behind a levers row",
    "common.py": "results files, re-rendering, side-by-side workers",
    "extract_texts.py": "how the shipped public-domain texts were extracted from their Debian packages",
    "peer_torchao.py": "torchao's NVFP4 QAT as a row of the accuracy benchmark",
    "residual_rotation.py": "the residual rotation behind a levers row",
    "render_gpu.py": "the GPU runs' JSON rendered into markdown (`render gpu_check`)",
    "run_all.py": "RESULTS.md, the index of the results files",
    "registry.py": "this file",
}
GROUPS = sorted({b.group for b in BENCHMARKS})


def by_name(name: str) -> Benchmark:
    found = [b for b in BENCHMARKS if b.name == name]
    if not found:
        import difflib

        near = difflib.get_close_matches(name, [b.name for b in BENCHMARKS], n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise SystemExit(f"no benchmark {name!r}{hint}; `python benchmarks/registry.py list` shows them")
    return found[0]


def _run(script: str, args: list[str]) -> int:
    helpers = str(HERE.parent / "tests" / "helpers")
    path = os.pathsep.join(p for p in (helpers, os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.call([sys.executable, str(HERE / script), *args], env={**os.environ, "PYTHONPATH": path})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="the registered benchmarks")
    ls.add_argument("--group", choices=GROUPS)
    rn = sub.add_parser("run", help="run benchmarks, each in its own process")
    rn.add_argument("names", nargs="*")
    rn.add_argument("--group", choices=GROUPS)
    rn.add_argument("args", nargs=argparse.REMAINDER, help="after --: passed to each script")
    rd = sub.add_parser("render", help="rewrite a benchmark's markdown from its committed JSON")
    rd.add_argument("name")
    a = p.parse_args(argv)
    if a.cmd == "list":
        for b in BENCHMARKS:
            if a.group in (None, b.group):
                print(f"{b.name:<20} {b.group:<15} {', '.join(r + '.md' for r in b.results):<32} {b.what}")
        return 0
    if a.cmd == "render":
        b = by_name(a.name)
        if b.name == "gpu_check":
            return _run("render_gpu.py", [])
        if b.render is None:
            raise SystemExit(f"{b.name} has no re-render: its results file is written only by running it")
        return _run(b.script, list(b.render))
    chosen = [by_name(n) for n in a.names] + [b for b in BENCHMARKS if a.group and b.group == a.group]
    if not chosen:
        raise SystemExit("name a benchmark or a --group; `python benchmarks/registry.py list` shows them")
    extra = [x for x in a.args if x != "--"]
    for b in chosen:
        print(f"== {b.name} ({b.script})", flush=True)
        rc = _run(b.script, extra)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
