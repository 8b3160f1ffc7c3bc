"""Where a CPU QAT step's time goes (#21), per op, beside a full-precision step of the same model.

Same model, batch and optimizer as ``bench_training_overhead.py`` (megatron-style GPT 4x256, batch
8x128, AdamW, NVFP4 weights and inputs on every linear but the output layer). The full-precision and the QAT
model take turns step by step in one process (separate processes spread a step's time by 20-40% on a shared
machine, more than the difference measured here); timers wrap the pieces a QAT step is made of:

* ``weight fake quant`` / ``input fake quant``: modelopt ``TensorQuantizer._fake_quantize`` of weight and
  input quantizers, inclusive (what ``TensorQuantizer.forward`` calls after its state checks); split into
  * ``kernel``: the fake-quant op itself (``tensor_quant.dynamic_block_quantize_op``, this plugin's CPU backend),
    and within it ``native``: the C kernel's call (``native_kernels.native_nvfp4``),
  * ``amax``: ``TensorQuantizer._get_amax`` (reading the static amax, or computing a dynamic one),
  * ``dispatch``: the rest, modelopt's Python around the op (autograd function, checks, attribute reads);
* ``forward`` / ``backward`` / ``optimizer``: the phases of the step (``training_step``, ``loss.backward()``,
  ``AdamW.step()``; forward includes the fake quant above, backward the straight-through estimator);
* ``other``: the remainder of the step (``zero_grad``).

Timers are ``time.perf_counter`` pairs (the CPU runs ops synchronously); their own cost (about a microsecond
per call) is included, so the dispatch column is an upper bound.

A second measurement, without timers, splits the QAT / full-precision step ratio by variant, all four models
taking turns step by step in one process on the same batches:

* ``nvfp4_qat``: the QAT model as trained (modelopt's quantized modules, this plugin's CPU kernel);
* ``quantizers off``: the same model with every quantizer disabled: modelopt's module and quantizer Python
  without fake quant;
* ``kernel only``: the full-precision model with each of those 16 linears doing the same fake quant (the same
  kernel, the QAT model's amaxes) through a minimal straight-through function and nothing else: the floor the
  kernel sets for any wrapper.

Writes ``results/qat_step_profile.{md,json}``.
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

STEPS, WARMUP, ROUNDS = 30, 5, 3


def _timed(acc: dict[str, dict[str, float]], current: list[str], key_fn, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[current[0]][key_fn(args)] += time.perf_counter() - t

    return wrapper


def _kernel_only_model(fp32, qat):
    """``fp32``'s copy whose linears (those quantized in ``qat``) fake-quantize their input and weight with this
    plugin's NVFP4 kernel and ``qat``'s amaxes through a minimal straight-through function, without modelopt.
    A measuring reference written here because it is what no library ships: the kernel's own floor."""
    import copy

    import torch
    import torch.nn.functional as F
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import TensorQuantizer

    from nemo_fp4qat.numerics.fake_quant import fake_quant_nvfp4

    class _STE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, amax):
            return fake_quant_nvfp4(x, amax)

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class _KernelOnlyLinear(torch.nn.Linear):
        def forward(self, x):
            return F.linear(_STE.apply(x, self.amax_in), _STE.apply(self.weight, self.amax_w), self.bias)

    model = copy.deepcopy(fp32)
    mods = dict(model.named_modules())
    n = 0
    for name, m in qat.named_modules():
        wq = getattr(m, "weight_quantizer", None)
        if isinstance(wq, TensorQuantizer) and wq.is_enabled and isinstance(mods.get(name), torch.nn.Linear):
            lin = mods[name]
            lin.__class__ = _KernelOnlyLinear
            lin.amax_in, lin.amax_w = m.input_quantizer.amax.detach(), wq.amax.detach()
            n += 1
    assert n == 16, n
    return model


def variants_worker() -> dict:
    """fp32, the QAT model, the QAT model with its quantizers off and the kernel-only model taking turns step by
    step in this process, with no timers but the step's; per-step seconds."""
    import copy

    import torch
    from common import step_overhead_pair
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import TensorQuantizer

    models, opts, batches = step_overhead_pair(STEPS + WARMUP)
    off = copy.deepcopy(models["nvfp4_qat"])
    for m in off.modules():
        if isinstance(m, TensorQuantizer):
            m.disable()
    models["quantizers off"] = off
    models["kernel only"] = _kernel_only_model(models["fp32"], models["nvfp4_qat"])
    for k in ("quantizers off", "kernel only"):
        opts[k] = torch.optim.AdamW(models[k].parameters(), lr=1e-4)
    times: dict[str, list[float]] = {k: [] for k in models}
    names = list(models)
    for i, batch in enumerate(batches):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # each goes first in turn
            lit, opt = models[name], opts[name]
            t = time.perf_counter()
            loss = lit.training_step(batch, i)
            opt.zero_grad()
            loss.backward()
            opt.step()
            times[name].append(time.perf_counter() - t)
    return {k: v[WARMUP:] for k, v in times.items()}


VARIANTS = [
    ("nvfp4_qat", "QAT as trained (modelopt's modules, this plugin's kernel)"),
    ("quantizers off", "the same modules, every quantizer disabled (modelopt's Python, no fake quant)"),
    ("kernel only", "the same fake quant in a minimal straight-through linear, no modelopt (the kernel's floor)"),
]


def render_variants(rounds: list[dict]) -> tuple[list[str], dict]:
    """Per-step ratios to the full-precision step beside it, medians over all processes' steps."""
    ratios = {v: statistics.median(a / f for r in rounds for a, f in zip(r[v], r["fp32"])) for v, _ in VARIANTS}
    ms = {v: statistics.median(t for r in rounds for t in r[v]) * 1e3 for v in ["fp32", *ratios]}
    lines = [
        f"Step ratio by variant, no timers ({len(rounds)} processes x {STEPS} steps after {WARMUP} warm-up; the "
        "four models take turns step by step on the same batches; ratio = median over all steps of the variant's "
        "step / the full-precision step beside it):",
        "",
        "| variant | step (ms) | / fp32 step |",
        "|---|---:|---:|",
        f"| fp32 | {ms['fp32']:.1f} | 1.000 |",
        *[f"| {label} | {ms[v]:.1f} | {ratios[v]:.3f} |" for v, label in VARIANTS],
        "",
        f"- of QAT's {100 * (ratios['nvfp4_qat'] - 1):.1f}% over full precision: the kernel's fake quant "
        f"{100 * (ratios['kernel only'] - 1):.1f}%, modelopt's modules without it "
        f"{100 * (ratios['quantizers off'] - 1):.1f}%, the rest (modelopt's quantizer dispatch around the kernel) "
        f"{100 * (ratios['nvfp4_qat'] - ratios['kernel only'] - ratios['quantizers off'] + 1):.1f}%",
        "",
    ]
    return lines, {"ratio": ratios, "step_ms": ms}


def worker() -> dict:
    """The full-precision and the QAT model taking turns step by step in this process; ms per step per part."""
    from common import step_overhead_pair
    from modelopt.torch.quantization import tensor_quant
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import TensorQuantizer

    acc: dict[str, dict[str, float]] = {
        "fp32": collections.defaultdict(float),
        "nvfp4_qat": collections.defaultdict(float),
    }
    current = ["fp32"]

    def kind(args) -> str:
        return getattr(args[0], "_profile_kind", "other")

    # the op is looked up on tensor_quant at call time (how the CPU backend plugs in too: installed first, so the
    # timer wraps it); the fp32 model has no quantizers, so these timers run in the QAT steps only
    from nemo_fp4qat.numerics.cpu_backend import install_cpu_backend

    install_cpu_backend()
    from nemo_fp4qat.numerics import native_kernels

    native_kernels.native_nvfp4 = _timed(acc, current, lambda a: "native", native_kernels.native_nvfp4)
    op = tensor_quant.dynamic_block_quantize_op
    tensor_quant.dynamic_block_quantize_op = _timed(acc, current, lambda a: "kernel", op)
    TensorQuantizer._fake_quantize = _timed(
        acc, current, lambda a: f"{kind(a)} fake quant", TensorQuantizer._fake_quantize
    )
    TensorQuantizer._get_amax = _timed(acc, current, lambda a: "amax", TensorQuantizer._get_amax)

    models, opts, batches = step_overhead_pair(STEPS + WARMUP)
    qat = models["nvfp4_qat"]
    for name, m in qat.named_modules():
        if isinstance(m, TensorQuantizer):
            m._profile_kind = "weight" if name.endswith("weight_quantizer") else "input"
    for i, batch in enumerate(batches):
        if i == WARMUP:
            for a in acc.values():
                a.clear()
        for name in list(models)[i % 2 :] + list(models)[: i % 2]:  # each goes first in turn
            current[0] = name
            lit, opt, a = models[name], opts[name], acc[name]
            t0 = time.perf_counter()
            loss = lit.training_step(batch, i)
            t1 = time.perf_counter()
            opt.zero_grad()
            t1b = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            a["forward"] += t1 - t0
            a["backward"] += t2 - t1b
            a["optimizer"] += t3 - t2
            a["step"] += t3 - t0
    return {v: {k: t / STEPS * 1e3 for k, t in a.items()} for v, a in acc.items()}  # ms per step


ROWS = [
    ("step", "whole step"),
    ("forward", "forward (incl. fake quant)"),
    ("weight fake quant", "  weight quantizers (inclusive)"),
    ("input fake quant", "  input quantizers (inclusive)"),
    ("kernel", "    of which the fake-quant op (this plugin's CPU backend)"),
    ("native", "      of which the C kernel call"),
    ("amax", "    of which amax reads"),
    ("dispatch", "    of which modelopt's Python around the op"),
    ("forward rest", "  rest of the forward's difference (modelopt's module and quantizer forwards around it, GEMMs)"),
    ("backward", "backward (incl. straight-through)"),
    ("optimizer", "optimizer step"),
    ("other", "rest of the step (zero_grad)"),
]


def main() -> dict:
    from common import alternating_worker_runs, machine, write_result

    rounds = alternating_worker_runs(__file__, ["side_by_side"], ROUNDS)["side_by_side"]
    variant_rounds = alternating_worker_runs(__file__, ["variants"], ROUNDS)["variants"]
    runs = {v: [r[v] for r in rounds] for v in ("fp32", "nvfp4_qat")}
    med: dict[str, dict[str, float]] = {}
    for r in rounds:  # derived parts per process, then medians (a difference of medians can go below zero)
        f, q = r["fp32"], r["nvfp4_qat"]
        q["dispatch"] = q["weight fake quant"] + q["input fake quant"] - q["kernel"] - q.get("amax", 0.0)
        q["forward rest"] = q["forward"] - f["forward"] - q["weight fake quant"] - q["input fake quant"]
        for m in (f, q):
            m["other"] = m["step"] - m["forward"] - m["backward"] - m["optimizer"]
    for v, rs in runs.items():
        keys = set().union(*rs)
        med[v] = {k: statistics.median(r.get(k, 0.0) for r in rs) for k in keys}
    f, q = med["fp32"], med["nvfp4_qat"]
    lines = [
        "## Per-op profile of a CPU QAT step (`benchmarks/profile_qat_step.py`)",
        "",
        f"Machine: {machine()}. Megatron-style GPT 4x256, batch 8x128, AdamW, NVFP4 weights and inputs on 16 "
        f"linears; the two models take turns step by step in one process, {STEPS} steps each after {WARMUP} "
        f"warm-up; median of {ROUNDS} processes, ms per step. Timers wrap modelopt's `TensorQuantizer._fake_quantize`, "
        "`_get_amax`, the fake-quant op and the C kernel's call (called in the QAT steps only).",
        "",
        "| part | fp32 (ms) | NVFP4 QAT (ms) | QAT - fp32 (ms) |",
        "|---|---:|---:|---:|",
    ]
    for key, label in ROWS:
        a, b = f.get(key), q.get(key, 0.0)
        lines.append(f"| {label} | {'' if a is None else f'{a:.1f}'} | {b:.1f} | "
                     f"{'' if a is None else f'{b - a:+.1f}'} |")  # fmt: skip
    lines += ["", f"- QAT step / fp32 step under the timers: **{q['step'] / f['step']:.2f}**", ""]
    vlines, vdata = render_variants(variant_rounds)
    md = "\n".join(lines + vlines)
    data = {"median_ms": med, "runs": runs, "steps": STEPS, "warmup": WARMUP, "variants": vdata,
            "variant_runs": variant_rounds}  # fmt: skip
    write_result("qat_step_profile", md, data)
    print(md)
    return data


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(variants_worker() if sys.argv[2] == "variants" else worker()))
    else:
        main()
