"""Where a CPU QAT step's time goes (#21), per op, beside a full-precision step of the same model.

Same model, batch and optimizer as ``bench_training_overhead.py`` (megatron-style GPT 4x256, batch
8x128, AdamW, NVFP4 weights and inputs on every linear but the output layer). Each variant runs in its
own process; inside it, timers wrap (for this process only) the pieces a QAT step is made of:

* ``weight fake quant`` / ``input fake quant``: modelopt ``TensorQuantizer.forward`` of weight and input
  quantizers, inclusive; split into
  * ``kernel``: the fake-quant op itself (``tensor_quant.dynamic_block_quantize_op``, our C kernel on a CPU),
  * ``amax``: ``TensorQuantizer._get_amax`` (reading the static amax, or computing a dynamic one),
  * ``dispatch``: the rest, modelopt's Python around the op (autograd function, checks, attribute reads);
* ``forward`` / ``backward`` / ``optimizer``: the phases of the Lightning step (forward includes the fake
  quant above; backward includes the straight-through estimator);
* ``other``: the remainder of the step (Lightning's loop, callbacks).

Timers are ``time.perf_counter`` pairs (the CPU runs ops synchronously); their own cost (about a microsecond
per call) is included, so the dispatch column is an upper bound. Writes ``results/qat_step_profile.{md,json}``.
"""

from __future__ import annotations

import collections
import functools
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

STEPS, WARMUP, ROUNDS = 30, 5, 3


def _timed(acc: dict[str, float], key_fn, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key_fn(args)] += time.perf_counter() - t

    return wrapper


def worker(variant: str) -> dict:
    import lightning.pytorch as pl
    import torch
    from modelopt.torch.quantization import tensor_quant
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import TensorQuantizer

    from nemo_fp4qat import FP4QATCallback

    from tiny_models import LitLM, MegatronStyleGPT, loader

    acc: dict[str, float] = collections.defaultdict(float)
    counting = [False]

    def kind(args) -> str:
        return getattr(args[0], "_profile_kind", "other")

    if variant == "nvfp4_qat":
        # the op is looked up on tensor_quant at call time (how the CPU backend plugs in too)
        op = tensor_quant.dynamic_block_quantize_op
        tensor_quant.dynamic_block_quantize_op = _timed(acc, lambda a: "kernel", op)
        TensorQuantizer.forward = _timed(acc, lambda a: f"{kind(a)} fake quant", TensorQuantizer.forward)
        TensorQuantizer._get_amax = _timed(acc, lambda a: "amax", TensorQuantizer._get_amax)

    torch.manual_seed(0)
    lit = LitLM(MegatronStyleGPT(hidden=256, layers=4), lr=1e-4)
    marks: dict[str, float] = {}

    class Phases(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, *a):
            counting[0] = trainer.global_step >= WARMUP
            if counting[0] and not marks.get("kinds_set"):
                for name, m in pl_module.named_modules():
                    if isinstance(m, TensorQuantizer):
                        m._profile_kind = "weight" if name.endswith("weight_quantizer") else "input"
                marks["kinds_set"] = 1.0
                acc.clear()
            marks["start"] = time.perf_counter()

        def on_before_backward(self, *a):
            marks["bwd"] = time.perf_counter()

        def on_after_backward(self, *a):
            marks["bwd_end"] = time.perf_counter()

        def on_before_optimizer_step(self, *a):
            marks["opt"] = time.perf_counter()

        def on_train_batch_end(self, *a):
            if not counting[0]:
                return
            end = time.perf_counter()
            acc["step"] += end - marks["start"]
            acc["forward"] += marks["bwd"] - marks["start"]
            acc["backward"] += marks["bwd_end"] - marks["bwd"]
            acc["optimizer"] += end - marks["opt"]

    cbs: list = [Phases()]
    if variant != "fp32":
        cbs.insert(0, FP4QATCallback(policy="fp_embeddings", schedule="direct", calibration=32))
    trainer = pl.Trainer(max_steps=STEPS + WARMUP, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=cbs)  # fmt: skip
    trainer.fit(lit, loader(n=(STEPS + WARMUP) * 8, seq_len=128, batch_size=8))
    per_step = {k: v / STEPS * 1e3 for k, v in acc.items()}  # ms per step
    return per_step


ROWS = [
    ("step", "whole step"),
    ("forward", "forward (incl. fake quant)"),
    ("weight fake quant", "  weight quantizers (inclusive)"),
    ("input fake quant", "  input quantizers (inclusive)"),
    ("kernel", "    of which the fake-quant op (C kernel)"),
    ("amax", "    of which amax reads"),
    ("dispatch", "    of which modelopt's Python around the op"),
    ("backward", "backward (incl. straight-through)"),
    ("optimizer", "optimizer step"),
    ("other", "rest of the step (loop, callbacks)"),
]


def main() -> dict:
    from common import alternating_worker_runs, machine, write_result

    runs = alternating_worker_runs(__file__, ["fp32", "nvfp4_qat"], ROUNDS)
    med: dict[str, dict[str, float]] = {}
    for v, rs in runs.items():
        keys = set().union(*rs)
        med[v] = {k: statistics.median(r.get(k, 0.0) for r in rs) for k in keys}
        m = med[v]
        if "kernel" in m:
            m["dispatch"] = m["weight fake quant"] + m["input fake quant"] - m["kernel"] - m.get("amax", 0.0)
        m["other"] = m["step"] - m["forward"] - m["backward"] - m["optimizer"]
    f, q = med["fp32"], med["nvfp4_qat"]
    lines = [
        "## Per-op profile of a CPU QAT step (`benchmarks/profile_qat_step.py`)",
        "",
        f"Machine: {machine()}. Megatron-style GPT 4x256, batch 8x128, AdamW, NVFP4 weights and inputs on 16 "
        f"linears; {STEPS} steps after {WARMUP} warm-up, median of {ROUNDS} alternating processes, ms per step. "
        "Timers wrap modelopt's `TensorQuantizer.forward`, `_get_amax` and the fake-quant op in the profiled "
        "process only.",
        "",
        "| part | fp32 (ms) | NVFP4 QAT (ms) | QAT - fp32 (ms) |",
        "|---|---:|---:|---:|",
    ]
    for key, label in ROWS:
        a, b = f.get(key), q.get(key, 0.0)
        lines.append(f"| {label} | {'' if a is None else f'{a:.1f}'} | {b:.1f} | "
                     f"{'' if a is None else f'{b - a:+.1f}'} |")  # fmt: skip
    lines += ["", f"- QAT step / fp32 step under the timers: **{q['step'] / f['step']:.2f}**", ""]
    md = "\n".join(lines)
    data = {"median_ms": med, "runs": runs, "steps": STEPS, "warmup": WARMUP}
    write_result("qat_step_profile", md, data)
    print(md)
    return data


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2])))
    else:
        main()
