"""The GPU acceptance run's ``qad_budget`` section: QAD at a real token budget, the accuracy question the CPU cannot
answer (on 2 cores 1M tokens of QAD take about 4.5 hours per learning rate).

SmolLM2-135M, trained in bfloat16 autocast over float32 master weights on the GPU (a 1e-6 AdamW step is below a
bfloat16 weight's rounding; the CPU runs float32), with the demo's policy and recipe (``DemoConfig``: its policy,
activation smoothing, unquantized weights trained at the export's ``deploy_dtype``). Per budget of distinct training
tokens (largest first, the smaller ones a prefix of the same seeded token order):

* ``finetune``: the BF16 fine-tune of the original model (the teacher and the reference);
* ``start max`` / ``start gptq``: PTQ of the fine-tune, max calibration and GPTQ-rounded weights;
* ``qad <start> lr <lr>``: QAD from each start at each learning rate (KL to the fine-tune, linear warm-up then
  cosine decay), exported as a unified HF checkpoint (validated on write) and measured as served.

Every model is scored by perplexity on the held-out book's first ``eval_tokens`` tokens and, at the largest budget,
on ``mc_tasks`` next-sentence tasks made from it. Training text: Austen's novels but the held-out *Persuasion*, and
the King James Pentateuch (``nemo_fp4qat/demo/data``; >= 1M distinct tokens). Calibration takes windows of the same
order past the largest budget.

Each run is planned against ``deadline``: its cost is estimated from the throughput the runs before it measured
(tokens per second per kind of run, plus that kind's export and scoring time), and a run that would end past the
deadline is recorded as skipped, by name, with what it needs (``--only qad_budget`` gives the section a whole run).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

TRAIN_TEXTS = ("emma", "mansfieldpark", "northangerabbey", "prideprejudice", "sensesensibility", "kjv_pentateuch")
EVAL_TEXT = "persuasion"


@dataclass(frozen=True)
class BudgetPlan:
    """What the section trains and measures. ``budgets``: distinct training tokens per point (steps x batch x
    seq_len), largest first; ``qad_lrs``: QAD's peak learning rates; ``warmup``: the share of steps warming up."""

    seq_len: int
    batch: int
    budgets: tuple[int, ...]
    qad_lrs: tuple[float, ...]
    finetune_lr: float
    warmup: float
    eval_tokens: int
    eval_window: int
    mc_tasks: int
    calib_samples: int
    starts: tuple[str, ...] = ("max", "gptq")
    seed: int = 0

    def steps(self, tokens: int) -> int:
        return tokens // (self.batch * self.seq_len)


GPU_PLAN = BudgetPlan(seq_len=512, batch=16, budgets=(1_048_576, 262_144, 65_536), qad_lrs=(1e-6, 1e-5, 5e-5),
                      finetune_lr=5e-5, warmup=0.05, eval_tokens=32_768, eval_window=1024, mc_tasks=600,
                      calib_samples=64)  # fmt: skip
# the CPU rehearsal: a tiny random Llama on the same texts as bytes, every kind of run once per budget
CPU_PLAN = BudgetPlan(seq_len=32, batch=2, budgets=(256, 128), qad_lrs=(1e-5, 5e-5), finetune_lr=1e-3, warmup=0.25,
                      eval_tokens=256, eval_window=64, mc_tasks=4, calib_samples=4)  # fmt: skip


class ByteTokenizer:
    """UTF-8 bytes as token ids (the tiny rehearsal model has no tokenizer of its own)."""

    bos_token_id = None
    eos_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}


def warmup_cosine(step: int, total: int, warmup: float) -> float:
    """The learning rate's multiplier at ``step`` of ``total``: linear warm-up over ``warmup`` of the steps (at
    least one), then cosine decay to zero at the last step."""
    w = max(1, round(warmup * total))
    if step < w:
        return (step + 1) / w
    return 0.5 * (1 + math.cos(math.pi * (step - w + 1) / max(1, total - w + 1)))


def token_order(tok: Any, plan: BudgetPlan) -> torch.Tensor:
    """[windows, seq_len + 1]: every training text's non-overlapping windows (none spans two texts), in one seeded
    order: a smaller budget trains on a prefix of a larger one's windows."""
    from nemo_fp4qat.demo.model import load_corpus
    from nemo_fp4qat.demo.training import token_windows

    windows = torch.cat([token_windows(tok(load_corpus(t))["input_ids"], 0, plan.seq_len) for t in TRAIN_TEXTS])
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(plan.seed))
    return windows[order]


class Planner:
    """Estimates each run's seconds from what the runs before it measured, and skips what would end past the
    deadline. A kind's cost: its training tokens over its measured tokens per second, plus its measured fixed time
    (calibration, export, scoring); a kind not measured yet borrows ``finetune``'s throughput times ``slowdown``."""

    def __init__(self, deadline: float, slowdown: float = 2.5) -> None:
        self.deadline = deadline
        self.slowdown = slowdown
        self.tokens_per_s: dict[str, float] = {}
        self.fixed_s: dict[str, float] = {}

    def estimate(self, kind: str, tokens: int) -> float:
        tps = self.tokens_per_s.get(kind) or self.tokens_per_s.get("finetune", 0.0) / self.slowdown
        train = tokens / tps if tps > 0 and tokens else 0.0
        return train + self.fixed_s.get(kind, 0.0)

    def fits(self, kind: str, tokens: int) -> tuple[bool, float]:
        est = self.estimate(kind, tokens)
        return time.time() + est <= self.deadline, est

    def record(self, kind: str, tokens: int, train_s: float, other_s: float) -> None:
        if tokens and train_s > 0:
            self.tokens_per_s[kind] = tokens / train_s
        self.fixed_s[kind] = other_s


def _autocast(device: str) -> Any:
    """bfloat16 autocast on the GPU; float32 on the CPU, which has no fast bfloat16 arithmetic here (about 10x
    slower): the rehearsal runs the same code, the cost measurement the rate that float32 gives."""
    return torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device != "cpu")


def _train(model: Any, windows: torch.Tensor, plan: BudgetPlan, lr: float, device: str,
           teacher: Any = None) -> tuple[float, list[float]]:  # fmt: skip
    """One pass over ``windows`` (in order, ``plan.batch`` a step) with AdamW at peak ``lr``, warm-up and cosine
    decay; cross-entropy, or KL to ``teacher``'s logits (QAD). Returns (seconds, losses)."""
    import torch.nn.functional as F

    from nemo_fp4qat.qat.distillation.distiller import kd_loss

    steps = len(windows) // plan.batch
    opt = torch.optim.AdamW((p for p in model.parameters() if p.requires_grad), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, steps, plan.warmup))
    model.train()
    losses = []
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        b = windows[i * plan.batch : (i + 1) * plan.batch].to(device)
        with _autocast(device):
            logits = model(b[:, :-1]).logits
            if teacher is None:
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
            else:
                with torch.no_grad():
                    target = teacher(b[:, :-1]).logits
                loss = kd_loss(logits, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    sync()
    model.eval()
    return time.perf_counter() - t0, losses


class _Scorer:
    """Perplexity on the held-out tokens and, where asked, the next-sentence tasks' accuracy."""

    def __init__(self, tok: Any, plan: BudgetPlan, device: str) -> None:
        from nemo_fp4qat.demo.model import load_corpus
        from nemo_fp4qat.eval.tasks import next_sentence_tasks

        book = load_corpus(EVAL_TEXT)
        self.ids = torch.tensor(tok(book)["input_ids"][: plan.eval_tokens])
        self.tasks = next_sentence_tasks(book, n=plan.mc_tasks, seed=plan.seed)
        self.tok, self.plan, self.device = tok, plan, device

    @torch.no_grad()
    def __call__(self, model: Any, mc: bool) -> dict[str, Any]:
        from nemo_fp4qat.eval.evaluation import multiple_choice_accuracy, perplexity

        windows = self.plan.eval_tokens // self.plan.eval_window
        with _autocast(self.device):
            out: dict[str, Any] = {"ppl": float(perplexity(model, self.ids, window=self.plan.eval_window,
                                                           max_windows=windows)["ppl"])}  # fmt: skip
            if mc:
                out["mc"] = multiple_choice_accuracy(model, self.tok, self.tasks)
        return out


def run_order(plan: BudgetPlan, best_lr: Any) -> Any:
    """The QAD runs as (budget, start, lr), most telling first, so a deadline cuts the least: at the largest budget
    QAD from the max start at the middle learning rate, then the other rates (where does the rate peak), the GPTQ
    start at the best rate so far (does QAD beat the GPTQ start), the smaller budgets at that rate (does recovery
    grow with tokens), then the rest. ``best_lr(budget, start)``: the best measured rate, asked when needed."""
    big, smaller = plan.budgets[0], plan.budgets[1:]
    lrs = list(plan.qad_lrs)
    mid = lrs[len(lrs) // 2]
    seen: set[tuple[int, str, float]] = set()

    def once(*run: Any) -> Any:
        if run not in seen:
            seen.add(run)
            yield run

    first, *others = plan.starts
    yield from once(big, first, mid)
    for lr in lrs:
        yield from once(big, first, lr)
    for start in others:
        yield from once(big, start, best_lr(big, first))
    for tokens in smaller:
        yield from once(tokens, first, best_lr(big, first))
    for start in plan.starts:
        for tokens in plan.budgets:
            for lr in lrs:
                yield from once(tokens, start, lr)


def qad_budget(device: str, small: bool, work: Path, deadline: float, plan: BudgetPlan | None = None) -> dict[str, Any]:
    """Runs the section (see the module's docstring); every run is a row of the result, measured or skipped."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from nemo_fp4qat import QATController
    from nemo_fp4qat.demo.pipeline import DemoConfig
    from nemo_fp4qat.eval.gate import recovery
    from nemo_fp4qat.qat.deploy_precision import DeployPrecision

    plan = plan or (CPU_PLAN if small else GPU_PLAN)
    demo = DemoConfig()
    if small:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
        base, tok, what = LlamaForCausalLM(cfg), ByteTokenizer(), "tiny random Llama (2 x 64), UTF-8 bytes as tokens"
        policy: Any = "default"  # the demo's own policy names SmolLM2's layers
    else:
        from nemo_fp4qat.demo.model import load_smollm2

        base, tok = load_smollm2()
        what, policy = "SmolLM2-135M (embedded)", demo.layer_policy()
    base = base.to(device).eval()
    runtime = policy.runtime if not isinstance(policy, str) else "trtllm"
    order = token_order(tok, plan)
    need = plan.steps(plan.budgets[0]) * plan.batch
    if len(order) < need + 1:
        raise RuntimeError(f"the training texts hold {len(order)} windows of {plan.seq_len + 1} tokens; the largest "
                           f"budget needs {need} and calibration more: ship more text or lower the budget")  # fmt: skip
    calib = list(order[need:][: plan.calib_samples, :-1].split(8))
    score = _Scorer(tok, plan, device)
    planner = Planner(deadline)
    res: dict[str, Any] = {"model": what, "device": device, "plan": asdict(plan),
                           "policy": getattr(policy, "name", policy), "smoothing": demo.smoothing,
                           "train_texts": list(TRAIN_TEXTS), "eval_text": EVAL_TEXT, "windows_available": len(order),
                           "rows": [], "skipped": []}  # fmt: skip
    res["deploy_dtype"] = demo.deploy_dtype

    @contextlib.contextmanager
    def deployed_precision(model: Any) -> Any:
        """The demo's ``deploy_dtype``: the quantized model's float32 unquantized weights seen at the export's
        16-bit dtype while it trains and is scored, so the served checkpoint computes what trained."""
        hooks = DeployPrecision(demo.deploy_dtype) if demo.deploy_dtype else None
        if hooks is not None:
            hooks.install(model)
        try:
            yield
        finally:
            if hooks is not None:
                hooks.remove()

    finetuned: dict[int, tuple[Any, dict]] = {}
    starts: dict[tuple[int, str], tuple[Any, dict]] = {}
    qad_ppl: dict[tuple[int, str, float], float] = {}

    def windows(tokens: int) -> torch.Tensor:
        return order[: plan.steps(tokens) * plan.batch]

    def finetune(tokens: int) -> tuple[Any, dict]:
        if tokens not in finetuned:
            ft = copy.deepcopy(base)
            train_s, losses = _train(ft, windows(tokens), plan, plan.finetune_lr, device)
            t = time.perf_counter()
            ft.requires_grad_(False)
            row = {"run": "finetune", "tokens": tokens, "lr": plan.finetune_lr, "train_s": train_s,
                   "last_loss": losses[-1], **score(ft, tokens == plan.budgets[0])}  # fmt: skip
            planner.record("finetune", tokens, train_s, time.perf_counter() - t)
            res["rows"].append(row)
            finetuned[tokens] = ft, row
        return finetuned[tokens]

    def start_of(tokens: int, start: str) -> tuple[Any, dict]:
        if (tokens, start) not in starts:
            ft, _ = finetune(tokens)
            t = time.perf_counter()
            st = copy.deepcopy(ft).requires_grad_(True)
            calibration = {"num_samples": plan.calib_samples, "smoothing": demo.smoothing,
                           "gptq": True if start == "gptq" else None}  # fmt: skip
            ctl = QATController(policy=policy, calibration=calibration, forward_fn=lambda m, b: m(b.to(device)))
            ctl.prepare(st)
            ctl.calibrate(st, calib)
            with deployed_precision(st):
                row = {"run": f"start {start}", "tokens": tokens, "calibrate_s": time.perf_counter() - t,
                       **score(st, tokens == plan.budgets[0])}  # fmt: skip
            planner.record(f"start {start}", 0, 0.0, time.perf_counter() - t)
            res["rows"].append(row)
            starts[tokens, start] = st, row
        return starts[tokens, start]

    def best_lr(tokens: int, start: str) -> float:
        measured = {lr: p for (b, s, lr), p in qad_ppl.items() if (b, s) == (tokens, start) and math.isfinite(p)}
        return min(measured, key=measured.get) if measured else plan.qad_lrs[len(plan.qad_lrs) // 2]

    for tokens, start, lr in run_order(plan, best_lr):
        name = f"{tokens:,} tokens: qad {start} lr {lr:g}"
        est = planner.estimate("qad", tokens)
        if tokens not in finetuned:
            est += planner.estimate("finetune", tokens)
        if (tokens, start) not in starts:
            est += planner.estimate(f"start {start}", 0)
        if time.time() + est > deadline:
            res["skipped"].append({"run": name, "why": f"needs about {est:.0f} s, past the section's deadline; "
                                   "run it with --only qad_budget"})  # fmt: skip
            continue
        row: dict[str, Any] = {"run": f"qad {start} lr {lr:g}", "start": start, "tokens": tokens, "lr": lr}
        m = None
        try:
            ft, ft_row = finetune(tokens)
            st, start_row = start_of(tokens, start)
            m = copy.deepcopy(st)
            with deployed_precision(m):
                row["train_s"], losses = _train(m, windows(tokens), plan, lr, device, teacher=ft)
                t = time.perf_counter()
                row["in_memory"] = score(m, False)["ppl"]
            row["last_loss"] = losses[-1]
            row.update(_served(m, work / "export", tok if not small else None, runtime, score,
                               tokens == plan.budgets[0]))  # fmt: skip
            row["recovery"] = recovery(start_row["ppl"], row["ppl"], ft_row["ppl"])
            row["gap"] = row["ppl"] / ft_row["ppl"] - 1
            qad_ppl[tokens, start, lr] = row["ppl"]
            planner.record("qad", tokens, row["train_s"], time.perf_counter() - t)
        except Exception:  # recorded; the other runs go on
            row["error"] = traceback.format_exc()[-1500:]
        res["rows"].append(row)
        del m
        if device != "cpu":
            torch.cuda.empty_cache()
    res["tokens_per_s"] = planner.tokens_per_s
    res["fixed_s"] = planner.fixed_s
    return res


def _served(model: Any, out: Path, tok: Any, runtime: str, score: _Scorer, mc: bool) -> dict[str, Any]:
    """``model`` exported (unified HF checkpoint, validated on write), loaded as served and scored."""
    from nemo_fp4qat.export import ExportConfig, ExportValidationError, export_checkpoint
    from nemo_fp4qat.export.deployed_model import load_deployed_model

    try:
        hf = export_checkpoint(model, out, ExportConfig(kind="hf", overwrite=True, runtime=runtime), tokenizer=tok)
    except ExportValidationError as e:  # a finding: scored in memory, the refusal recorded
        return {"export": str(e).splitlines()[-1][:300], **score(model, mc)}
    served = load_deployed_model(hf).model.to(score.device).eval()
    return {"export": "validated", **score(served, mc)}


COST_PLAN = BudgetPlan(seq_len=512, batch=4, budgets=(8192,), qad_lrs=(5e-5,), finetune_lr=5e-5, warmup=0.25,
                       eval_tokens=4096, eval_window=1024, mc_tasks=40, calib_samples=16, starts=("max",))  # fmt: skip


def _flop_params(layers: int, hidden: int, q_heads: int, kv_heads: int, ffn: int, vocab: int) -> int:
    """Parameters a token's forward multiplies by (the decoder's linears and the output head; not the embedding)."""
    kv = hidden * kv_heads // q_heads
    return layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn) + vocab * hidden


def gpu_estimate(cost: dict[str, Any], h200: dict[str, Any], plan: BudgetPlan = GPU_PLAN) -> dict[str, Any]:
    """The section's seconds on a GPU, estimated. The fine-tune's tokens per second: the H200's measured BF16 step
    (``gpu_h200.json``: Llama 8 x 2048, 4 x 1024 tokens) scaled by FLOPs per token to SmolLM2-135M at the same
    utilisation (``optimistic``; a 576-wide model reaches less, ``at_third_utilisation`` assumes a third). QAD's:
    the QAD / fine-tune ratio measured on the CPU. Fixed costs per run (calibration, export, validation, scoring):
    the CPU's divided by ``cpu_over_gpu_fixed``, a guess (the export's validation runs on the CPU either way)."""
    ratio = _flop_params(8, 2048, 16, 4, 5632, 32000) / _flop_params(30, 576, 9, 3, 1536, 49152)
    ft_tps = 4 * 1024 / h200["qat_step"]["bf16"]["step_s"] * ratio
    qad_tps = ft_tps * cost["tokens_per_s"]["qad"] / cost["tokens_per_s"]["finetune"]
    cpu_over_gpu_fixed = 4.0
    fixed = {k: v / cpu_over_gpu_fixed for k, v in cost["fixed_s"].items()}
    out: dict[str, Any] = {"flops_ratio": ratio, "finetune_tokens_per_s": ft_tps, "qad_tokens_per_s": qad_tps,
                           "fixed_s": fixed, "cpu_over_gpu_fixed": cpu_over_gpu_fixed,
                           "qad_runs": len(plan.budgets) * len(plan.starts) * len(plan.qad_lrs)}  # fmt: skip
    for name, slow in (("optimistic", 1.0), ("at_third_utilisation", 3.0)):
        total = 0.0
        for b in plan.budgets:
            total += slow * b / ft_tps + fixed["finetune"] + len(plan.starts) * fixed["start max"]
            total += len(plan.starts) * len(plan.qad_lrs) * (slow * b / qad_tps + fixed["qad"])
        out[name] = {"total_s": total, "largest_budget_qad_s": slow * plan.budgets[0] / qad_tps + fixed["qad"]}
    return out


def render_cost(d: dict[str, Any]) -> str:
    c, g, p = d["cpu"], d["gpu_estimate"], d["gpu_plan"]
    return "\n".join(
        [
            "## The `qad_budget` section's cost (`benchmarks/gpu_qad_budget.py`)",
            "",
            f"Measured on the CPU ({d['machine']}): SmolLM2-135M, float32, batch {d['cost_plan']['batch']} x "
            f"{d['cost_plan']['seq_len']}, {d['cost_plan']['budgets'][0]:,} tokens per run.",
            "",
            "| run | tokens / s (CPU) | fixed s per run (CPU) | tokens / s (GPU, estimated) "
            "| fixed s (GPU, estimated) |",
            "|---|---:|---:|---:|---:|",
            f"| fine-tune | {c['tokens_per_s']['finetune']:.0f} | {c['fixed_s']['finetune']:.1f} | "
            f"{g['finetune_tokens_per_s']:,.0f} | {g['fixed_s']['finetune']:.1f} |",
            f"| PTQ start (calibration, scoring) | - | {c['fixed_s']['start max']:.1f} | - | "
            f"{g['fixed_s']['start max']:.1f} |",
            f"| QAD (+ export, validation, scoring as served) | {c['tokens_per_s']['qad']:.0f} | "
            f"{c['fixed_s']['qad']:.1f} | {g['qad_tokens_per_s']:,.0f} | {g['fixed_s']['qad']:.1f} |",
            "",
            f"The GPU plan ({', '.join(f'{b:,}' for b in p['budgets'])} tokens; learning rates "
            f"{', '.join(f'{lr:g}' for lr in p['qad_lrs'])}; starts {', '.join(p['starts'])}: "
            f"{g['qad_runs']} QAD runs) "
            f"is estimated at {g['optimistic']['total_s']:.0f} s in all at the H200 step's utilisation and "
            f"{g['at_third_utilisation']['total_s']:.0f} s at a third of it; one QAD run at the largest budget at "
            f"{g['optimistic']['largest_budget_qad_s']:.0f}-{g['at_third_utilisation']['largest_budget_qad_s']:.0f} s. "
            f"On this CPU one QAD run of {p['budgets'][0]:,} tokens would take "
            f"{p['budgets'][0] / c['tokens_per_s']['qad'] / 3600:.1f} h.",
            "",
            "How the GPU figures are estimated: the fine-tune's tokens per second from the H200's measured BF16 step "
            f"(`gpu_h200.json`, Llama 8 x 2048) scaled by FLOPs per token ({g['flops_ratio']:.2f}x fewer for "
            "SmolLM2-135M) "
            "at the same utilisation, and at a third of it; QAD's rate from the QAD / "
            f"fine-tune ratio measured here; fixed costs as the CPU's divided by {g['cpu_over_gpu_fixed']:g} "
            "(a guess). "
            "The section plans every run against its deadline from the rates its own earlier runs measured, and skips "
            "by name what would end past it, so an estimate off by a factor costs runs, not the section.",
            "",
        ]
    )


def main() -> None:
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(
        description="measure the qad_budget section's cost on this CPU: one fine-tune and "
        "one QAD of SmolLM2, written to benchmarks/results/qad_budget_cost.{json,md}"
    )
    ap.add_argument("--render", action="store_true", help="only rewrite the .md from the .json")
    args = ap.parse_args()
    results = Path(__file__).parent / "results"
    sys.path.insert(0, str(Path(__file__).parent))
    from common import machine

    if args.render:
        d = json.loads((results / "qad_budget_cost.json").read_text())
    else:
        work = Path("runs/qad_budget_cost")
        cpu = qad_budget("cpu", False, work, time.time() + 10 * 3600, plan=COST_PLAN)
        h200 = json.loads((results / "gpu_h200.json").read_text())
        d = {"machine": machine(), "cost_plan": asdict(COST_PLAN), "gpu_plan": asdict(GPU_PLAN), "cpu": cpu,
             "gpu_estimate": gpu_estimate(cpu, h200)}  # fmt: skip
        (results / "qad_budget_cost.json").write_text(json.dumps(d, indent=1))
    (results / "qad_budget_cost.md").write_text(render_cost(d))
    print(render_cost(d))


if __name__ == "__main__":
    main()
