"""``make demo``: the whole pipeline on the embedded default (SmolLM2-135M, Austen corpus).

Baseline evaluation -> full-precision fine-tune (the fair baseline) -> PTQ of it -> QAT, by default
as QAD (the PTQ model distilled from the fine-tune, NVIDIA's recommended workflow; ``mode="qat"``:
progressive plain QAT from the original model) with the same data and step budget ->
evaluation of every variant -> export of the QAT model (a TensorRT-LLM checkpoint in NeMo's qnemo
layout and a unified HF checkpoint, both validated; the HF one is served by ``nemo-fp4qat serve``)
-> the QAT row re-measured on the exported checkpoint as deployed -> comparison table,
``report.json`` (with ``recovery``), ``report.md``,
PNG plots, and the quantization-quality report of the QAT run. Everything goes under ``out_dir``.

This runs the plain Lightning + Hugging Face path: on a CPU-only machine the Megatron path would not
fit the 10-minute budget (``nemo_fp4qat.nemo`` runs the same model through NeMo).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from .training import token_windows, train_lm

if TYPE_CHECKING:
    from ..qat.policy.rules import LayerPolicy

__all__ = ["DEMO_POLICIES", "DemoConfig", "run_demo"]

LM_EVAL_TASK = "fp4qat_next_sentence"  # shipped with nemo_fp4qat.eval.harness, made from the held-out book

log = logging.getLogger("nemo_fp4qat")

# Policies for the demo's model only (their rules name SmolLM2-135M's layers), by the name ``--policy`` takes.
# ``smollm2_auto``: modelopt AutoQuantize's per-layer choice over NVFP4 and FP8 for SmolLM2-135M at the
# ``default`` preset's bits, as benchmarks/bench_auto_policy.py wrote it (benchmarks/results/
# auto_policy_auto_nvfp4_fp8.yaml). At those bits its QAD gap to the fine-tune was lower than the preset's on
# each of 3 seeds (benchmarks/results/auto_policy_seeds.md). The search itself (about 150 s on 2 cores) does
# not fit the demo's budget, so the demo reads its result.
DEMO_POLICIES = {"smollm2_auto": Path(__file__).parent / "data" / "smollm2_auto_policy.yaml"}


@dataclass
class DemoConfig:
    steps: int = 20
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 1e-4
    eval_window: int = 256
    eval_windows: int = 8
    calib_samples: int = 64
    # a preset, a YAML file or a name in DEMO_POLICIES (``"default"``: the hand preset the levers and the seed
    # and token benchmarks were measured with)
    policy: str = "smollm2_auto"
    # The QAT stage. "qad": NVIDIA's QAD workflow: start from the PTQ of the fine-tuned model, the
    # fine-tune (frozen) as teacher, KL only, direct schedule, qad_lr. "qat": plain QAT from the
    # original model on the LM loss with `schedule` (what the demo ran before; `distill_alpha` > 0
    # adds distillation from the original model).
    mode: str = "qad"
    # measured on this workload at 40 steps: 1e-5 recovers 0.23, 5e-5 0.39, 1e-4 0.40
    # (shared/ENVIRONMENT.md); at the demo's 20 steps 5e-5 and 1e-4 both recover 0.27. On the demo's policy
    # 2e-5 and 5e-5 tie over 3 seeds (gap 11.1% each, benchmarks/results/demo_qad_lr.md)
    qad_lr: float = 5e-5
    # QAD steps (0: the fine-tune's `steps`). A QAD step costs about twice a fine-tune step on 2 cores
    # (fake quant and the teacher); 30 steps (a second pass over the same 80 windows) measured worse
    # than 20 (recovery 0.23 vs 0.27), so the default stays at the fine-tune's budget.
    qad_steps: int = 0
    plain_qat: bool = False  # also run plain QAT (mode "qat") and report it beside the QAD row
    schedule: str = "progressive"
    distill_alpha: float = 0.0
    # The recipe's deployable lever: activation smoothing of the gate/up inputs folded into the norms
    # (``nemo_fp4qat.qat.calibration.smoothing``; None/False: off). The QAT stage starts from the PTQ it makes;
    # the plain max-calibrated PTQ is measured too, as the recovery's reference. The plugin's NVFP4 block scale
    # search (``nemo_fp4qat.qat.calibration.block_scale_search``, a weight clip) is off: on this policy it wins PTQ
    # but holds QAD back on every seed measured (benchmarks/results/scale_levers.md: QAD gap 9.8 / 9.7 / 8.9% without
    # it, 12.2 / 11.3 / 9.7% with it); on the `default` preset it helped (benchmarks/results/levers.md).
    smoothing: Any = field(default_factory=lambda: {"sites": ["mlp_in"], "alpha": 0.5})
    block_scale_search: bool | float = False
    # modelopt's GPTQ after calibration (``CalibrationConfig.gptq``): the QAT stage starts from GPTQ-rounded weights
    gptq: bool = False
    seed: int = 0
    # documents of lm-evaluation-harness's next-sentence task (from the held-out book, offline) scored per variant
    # (the report's accuracy column; 4 choices each, about 0.3 s per document on 2 cores); 0: off
    lm_eval_limit: int = 40
    # the demo on a mixture-of-experts model: SmolLM2 sparsely upcycled into a Mixtral (``demo/upcycle.py``: every
    # layer's MLP copied into ``moe_experts`` experts, each perturbed by 1%, a router picking 2), with the ``default``
    # preset (experts NVFP4, routers 16-bit) and no smoothing; the export is a unified HF checkpoint only
    moe: bool = False
    moe_experts: int = 4
    # the QAT stage trains the model's unquantized weights (embeddings, norms, lm_head) rounded to float16, the dtype
    # the engines' checkpoints hold them in, so the served checkpoint computes what trained (None: float32 throughout,
    # and the export's rounding moves the served perplexity by 1-3%: benchmarks/notes/measured.md)
    deploy_dtype: str | None = "float16"

    def __post_init__(self) -> None:
        from ..qat.calibration.calibrate import CalibrationConfig
        from ..qat.calibration.smoothing import SmoothingConfig

        if self.moe:
            if self.policy in DEMO_POLICIES:  # they name SmolLM2's dense MLP layers
                self.policy = "default"
            self.smoothing = None

        SmoothingConfig.resolve_spec(self.smoothing)  # refuse a bad spec before the model loads
        self.layer_policy()  # the same for the policy
        # the same for these (GPTQ: refused by name on a modelopt without it, or beside the block scale search)
        CalibrationConfig(num_samples=100, block_scale_search=self.block_scale_search, gptq=self.gptq or None)
        if self.mode not in ("qad", "qat"):
            raise ValueError(f"demo mode {self.mode!r} is not known; use 'qad' (default) or 'qat'.")

    def layer_policy(self) -> LayerPolicy:
        """The policy ``policy`` names (a name in :data:`DEMO_POLICIES`, a preset or a YAML file)."""
        from ..qat.policy.rules import LayerPolicy
        from ..specs import ConfigError

        try:
            return LayerPolicy.resolve_spec(DEMO_POLICIES.get(self.policy, self.policy))
        except ConfigError as e:
            raise ConfigError(f"{e} The demo also takes: {', '.join(DEMO_POLICIES)}.") from e

    @classmethod
    def quick(cls) -> DemoConfig:
        # 4 steps: the progressive schedule's last (target) stage starts at step 3; 4 lm-eval documents per variant
        # (each scores 4 choices of a few hundred tokens through the 49k-word output layer)
        return cls(steps=4, eval_windows=2, calib_samples=8, seq_len=64, eval_window=64, lm_eval_limit=4)


def _lever_names(cfg: DemoConfig) -> list[str]:
    """The deployable levers ``cfg`` turns on, as the report names them."""
    from ..qat.calibration.smoothing import SmoothingConfig

    names = []
    sm = SmoothingConfig.resolve_spec(cfg.smoothing)
    if sm is not None:
        names.append(f"smoothing {'+'.join(sm.sites)} alpha {sm.alpha} folded into the weights")
    if cfg.block_scale_search is not False:
        names.append("NVFP4 block scale search")
    if cfg.gptq:
        names.append("GPTQ")
    return names


def run_demo(out_dir: str = "runs/demo", quick: bool = False, cfg: DemoConfig | None = None, **overrides: Any) -> int:
    from rich.console import Console

    warnings.filterwarnings("ignore", message="Calibrating on")
    # Lightning 2.4 on torch 2.13: a deprecation inside Lightning itself, printed once per fit
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    cfg = cfg or (DemoConfig.quick() if quick else DemoConfig())
    for k, v in overrides.items():
        if v is not None:
            setattr(cfg, k, v)
    cfg.__post_init__()  # overrides are checked like constructor arguments, before the model loads
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # bound to the terminal now: inside, stdout (modelopt's and NeMo's prints) goes to demo.log
    con = Console(file=sys.stdout, soft_wrap=True)
    t0 = time.time()
    with _details_to_file(out / "demo.log") as details, contextlib.redirect_stdout(details):
        return _run(cfg, out, con, t0, details)


@contextlib.contextmanager
def _lm_eval_to_file(details: TextIO) -> Iterator[None]:
    """lm-evaluation-harness's progress bars (stderr) and log messages go to the details file, not the terminal
    (its logger is set up inside ``simple_evaluate``, at the level ``LMEVAL_LOG_LEVEL`` names)."""
    saved = os.environ.get("LMEVAL_LOG_LEVEL")
    os.environ["LMEVAL_LOG_LEVEL"] = "WARNING"
    try:
        with contextlib.redirect_stderr(details):
            yield
    finally:
        if saved is None:
            os.environ.pop("LMEVAL_LOG_LEVEL", None)
        else:
            os.environ["LMEVAL_LOG_LEVEL"] = saved


def _run(cfg: DemoConfig, out: Path, con: Any, t0: float, details: TextIO) -> int:
    import lightning.pytorch as pl
    import torch
    from rich.table import Table

    from ..eval.evaluation import evaluate
    from ..eval.gate import compare_to_finetune, versus_finetune_cells, write_report
    from ..eval.harness import document_scores, run_lm_eval, write_local_tasks
    from ..export.runtime_support import ENGINE_RUNTIMES
    from ..lightning.callback import FP4QATCallback
    from ..lightning.monitor_callback import QuantizationMonitor
    from ..qat.controller import QATController
    from .model import load_corpus, load_smollm2

    policy = cfg.layer_policy()
    con.print(f"[bold]nemo-fp4qat demo[/bold]: SmolLM2-135M on Austen (details: {out / 'demo.log'})")
    log.info("demo config: %s", asdict(cfg))
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    base, tok = load_smollm2()
    if cfg.moe:
        from .upcycle import upcycle_llama_to_mixtral

        base = upcycle_llama_to_mixtral(base, num_experts=cfg.moe_experts, top_k=2, noise=0.01, seed=cfg.seed)
        con.print(f"  the model: SmolLM2-135M upcycled into a Mixtral of {cfg.moe_experts} experts per layer (top 2)")
    train_ids = tok(load_corpus("emma"))["input_ids"]
    val_ids = tok(load_corpus("persuasion"))["input_ids"]
    n_train = cfg.steps * cfg.batch_size
    train = token_windows(train_ids, 0, cfg.seq_len)
    train = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed))][:n_train]
    calib = [
        b for b in token_windows(train_ids[len(train_ids) // 2 :], cfg.calib_samples, cfg.seq_len)[:, :-1].split(8)
    ]
    val = torch.tensor(val_ids[: cfg.eval_window * cfg.eval_windows])
    tasks = write_local_tasks(out / "lm_eval_tasks", load_corpus("persuasion")) if cfg.lm_eval_limit else None

    def ev(model, name: str, lm_eval: bool = True) -> dict[str, Any]:
        with con.status(f"evaluating {name}"):
            r = evaluate(model, val, window=cfg.eval_window).as_dict()
            if tasks is not None and lm_eval:  # lm-evaluation-harness on the same model: what dashboards read
                slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
                with _lm_eval_to_file(details):
                    res = run_lm_eval(model, tok, [LM_EVAL_TASK], include_path=tasks, limit=cfg.lm_eval_limit,
                                      batch_size=8, output=out / "lm_eval" / f"{slug}.json",
                                      log_samples=True)  # fmt: skip
                scores = res["results"][LM_EVAL_TASK]
                r["acc"], r["acc_norm"] = scores["acc,none"], scores["acc_norm,none"]
                r["acc_outcomes"] = [int(x > 0) for x in document_scores(res, LM_EVAL_TASK, "acc")]
        log.info("%s: perplexity %.3f (%.0f tokens/s)%s", name, r["ppl"], r["tokens_per_s"],
                 f", {LM_EVAL_TASK} acc {r['acc']:.3f}" if r.get("acc") is not None else "")  # fmt: skip
        return r

    def stage(i: int, what: str, result: str) -> None:
        con.print(f"[bold]{i}/5[/bold] {what:<46} {result}")

    variants: dict[str, dict[str, Any]] = {}
    variants["bf16"] = ev(base, "bf16 (original)")
    stage(1, "baseline (original SmolLM2-135M)", f"perplexity {variants['bf16']['ppl']:.3f}")

    ft = copy.deepcopy(base)
    ft_losses = train_lm(ft, train, cfg, out, [], "finetune")
    variants["bf16_finetuned"] = ev(ft, "bf16 fine-tuned")
    stage(2, f"BF16 fine-tune, {cfg.steps} steps (the fair baseline)",
          f"perplexity {variants['bf16_finetuned']['ppl']:.3f}")  # fmt: skip

    calibration = {"num_samples": cfg.calib_samples, "smoothing": cfg.smoothing,
                   "block_scale_search": cfg.block_scale_search, "gptq": cfg.gptq or None}  # fmt: skip
    levers = _lever_names(cfg)

    def ptq(calibration: dict[str, Any], name: str) -> tuple[dict[str, Any], QATController]:
        model = copy.deepcopy(ft)
        ctl = QATController(policy=policy, schedule="direct", calibration=calibration,
                            forward_fn=lambda m, b: m(b))  # fmt: skip
        ctl.prepare(model)
        ctl.calibrate(model, calib)
        return ev(model, name), ctl

    # the recovery's reference: plain max calibration, no lever (the levers do not change the policy's table)
    variants["ptq"], ctl = ptq({"num_samples": cfg.calib_samples}, "PTQ (max calibration)")
    (out / "policy_table.txt").write_text(ctl.table.format_table() + "\n")  # type: ignore[union-attr]
    p = variants["ptq"]
    result = f"perplexity {p['ppl']:.3f} at {p['bits_per_weight']:.2f} bits/weight"
    recipe_name = "PTQ with the recipe's levers"
    if levers and cfg.mode != "qad":  # plain QAT starts from the original: the recipe's PTQ is built on its own
        variants["ptq_recipe"], _ = ptq(calibration, recipe_name)
        result += f"; with {' + '.join(levers)}: {variants['ptq_recipe']['ppl']:.3f}"
    label = cfg.policy if cfg.policy in DEMO_POLICIES else policy.name  # the name the user gave, not a file's path
    stage(3, f"PTQ of the fine-tune (policy {label!r})", result)

    # the export for this plugin's server (runtime "pytorch") keeps float32: nothing to round then
    deploy_dtype = cfg.deploy_dtype if policy.runtime in ENGINE_RUNTIMES else None

    def plain_qat() -> tuple[Any, list[float], FP4QATCallback, QuantizationMonitor]:
        model = copy.deepcopy(base)
        distill = {"alpha": cfg.distill_alpha} if cfg.distill_alpha > 0 else None
        cb = FP4QATCallback(policy=policy, schedule=cfg.schedule, calibration=calibration,
                            calibration_data=calib, forward_fn=lambda m, b: m.net(b), distillation=distill,
                            deploy_dtype=deploy_dtype)  # fmt: skip
        mon = QuantizationMonitor(every_n_steps=max(1, cfg.steps // 2), out_dir=str(out / "quant_quality"))
        return model, train_lm(model, train, cfg, out, [cb, mon], "qat"), cb, mon

    qad_steps = cfg.qad_steps or cfg.steps

    class RecipePTQ(pl.Callback):
        """The QAD stage's start, measured once the callback has calibrated it: the recipe's PTQ of the fine-tune
        (measured here rather than calibrated a second time on its own; its unquantized weights at the deployment
        dtype, as the stage trains them)."""

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            net, was_training = pl_module.net, pl_module.net.training
            variants["ptq_recipe"] = ev(net.eval(), recipe_name)
            net.train(was_training)

    def qad() -> tuple[Any, list[float], FP4QATCallback, QuantizationMonitor]:
        # the student starts where PTQ left the fine-tune (same calibration data); the teacher is the
        # fine-tune itself (the callback's frozen copy before quantization)
        model = copy.deepcopy(ft)
        cb = FP4QATCallback(policy=policy, schedule="direct", calibration=calibration,
                            calibration_data=calib, forward_fn=lambda m, b: m.net(b), distillation="qad",
                            deploy_dtype=deploy_dtype)  # fmt: skip
        # one switch (step 0) and the end (each full-model analysis: report.json's monitor_measure_s)
        mon = QuantizationMonitor(every_n_steps=qad_steps, out_dir=str(out / "quant_quality"))
        callbacks = [cb, RecipePTQ(), mon] if levers else [cb, mon]
        return model, train_lm(model, train, cfg, out, callbacks, "qad", lr=cfg.qad_lr, steps=qad_steps), cb, mon

    plain_note = ""
    if cfg.mode == "qad":
        if cfg.plain_qat:
            m, _, _, _ = plain_qat()
            variants["qat_plain"] = ev(m, f"plain QAT ({cfg.schedule}, from the original)")
            plain_note = f"; plain QAT {variants['qat_plain']['ppl']:.3f}"
            del m
        qat_model, qat_losses, qat_cb, monitor = qad()
        method = f"QAD from the fine-tune (direct, KL only, lr {cfg.qad_lr}, {qad_steps} steps)"
        what = f"QAD from the fine-tune, {qad_steps} steps"
    else:
        qad_note = f", distillation alpha {cfg.distill_alpha}" if cfg.distill_alpha > 0 else ""
        qat_model, qat_losses, qat_cb, monitor = plain_qat()
        method = f"plain QAT from the original ({cfg.schedule}{qad_note})"
        what = f"plain QAT ({cfg.schedule}), {cfg.steps} steps"
    if levers:
        method += "; " + ", ".join(levers)
    variants["qat"] = ev(qat_model, "QAT (in memory)", lm_eval=False)  # scored as deployed below
    start_note = ""
    if cfg.mode == "qad" and "ptq_recipe" in variants:
        start_note = f" (from the recipe's PTQ: {variants['ptq_recipe']['ppl']:.3f})"
    stage(4, what, f"perplexity {variants['qat']['ppl']:.3f}{start_note}{plain_note}")
    from ..export import ExportConfig, export_checkpoint
    from ..export.deployed_model import load_deployed_model

    # Policies say where they deploy: "trtllm" (default) or "pytorch" (MXFP8 attention: this plugin's server only).
    runtime = policy.runtime
    exports: dict[str, str] = {}
    if runtime == "trtllm" and not cfg.moe:  # a TensorRT-LLM checkpoint of an MoE is refused (kind='hf' only)
        trt = export_checkpoint(qat_model, out / "export_trtllm", ExportConfig(kind="trtllm", runtime=runtime,
                                overwrite=True), tokenizer=tok)  # fmt: skip
        exports["trtllm"] = str(trt)
    hf = export_checkpoint(qat_model, out / "export", ExportConfig(kind="hf", runtime=runtime, overwrite=True),
                           tokenizer=tok)  # fmt: skip
    exports["hf"] = str(hf)
    # The QAT row is what deploys: the exported HF checkpoint rebuilt by the serving unpacker.
    in_memory = variants.pop("qat")
    deployed = load_deployed_model(hf)
    variants["qat"] = ev(deployed.model, "QAT (exported checkpoint, as served)")
    variants["qat"]["bits_per_weight"] = in_memory["bits_per_weight"]
    variants["qat"]["weight_ratio_vs_bf16"] = in_memory["weight_ratio_vs_bf16"]
    del deployed
    stage(5, "export, validated (" + " + ".join(exports) + f", runtime {runtime})",
          f"as served: perplexity {variants['qat']['ppl']:.3f}")  # fmt: skip
    compare_to_finetune(variants)
    report = write_report(
        out,
        variants,
        extra={
            "config": asdict(cfg),
            "wall_time_s": time.time() - t0,
            "monitor_findings": len(monitor.findings),
            "monitor_measure_s": [round(r["seconds"], 3) for r in monitor.records],
            "qat_in_memory_ppl": in_memory["ppl"],
            "exports": exports,
            "export_runtime": runtime,
            "qat_method": method,
            "lm_eval": {"task": LM_EVAL_TASK, "limit": cfg.lm_eval_limit, "results": str(out / "lm_eval")}
            if tasks is not None
            else None,
        },
        loss_curves={"bf16 fine-tune": ft_losses, method: qat_losses},
        switches=qat_cb.controller.history,
    )
    table = Table(title="BF16 vs PTQ vs QAT (validation: Persuasion)")
    cols = ("variant", "perplexity", "vs fine-tune, 95% CI", "lm-eval acc", "vs fine-tune, paired", "bits/weight",
            "weights vs bf16")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right" if col != "variant" else "left")
    for name, v in variants.items():
        acc = "-" if v.get("acc") is None else f"{100 * v['acc']:.1f}%"
        ppl_vs, acc_vs = versus_finetune_cells(v)
        table.add_row(name, f"{v['ppl']:.3f}", ppl_vs, acc, acc_vs, f"{v['bits_per_weight']:.2f}",
                      f"{v['weight_ratio_vs_bf16']:.3f}")  # fmt: skip
    con.print(table)
    n_windows, n_docs = len(variants["bf16_finetuned"].get("window_nll") or []), cfg.lm_eval_limit
    con.print(f"vs fine-tune: perplexity ratio - 1 with its 95% t interval over the {n_windows} validation windows; "
              f"accuracy difference with McNemar's exact p over the {n_docs} documents (p >= 0.05: not apart; "
              "benchmarks/results/qad_levers.md scores 32,768 tokens and 600 tasks)")  # fmt: skip
    rec, gap = report["recovery"], report["gap_to_bf16"]
    con.print(f"QAT = {method}")
    own = report.get("recovery_vs_recipe_ptq")
    own_note = f", {own:.3f} against the recipe's own PTQ" if own is not None else ""
    con.print(f"gap to BF16 = ppl_QAT / ppl_BF16_finetuned - 1 = [bold]{100 * gap:.1f}%[/bold]; "
              f"recovery = (ppl_PTQ - ppl_QAT) / (ppl_PTQ - ppl_BF16_finetuned) = [bold]{rec:.3f}[/bold] "
              f"(PTQ: max calibration){own_note}")  # fmt: skip
    con.print(f"wall time {time.time() - t0:.0f} s. Written under {out}/: report.md, report.json, plots, "
              "policy_table.txt, quant_quality/, demo.log")  # fmt: skip
    for kind, path in exports.items():
        con.print(f"  {kind} checkpoint: {path}" + (f"  (serve: nemo-fp4qat serve {path})" if kind == "hf" else ""))
    return 0


@contextlib.contextmanager
def _details_to_file(path: Path) -> Iterator[TextIO]:
    """Lightning's and the plugin's INFO messages (policy tables, monitor tables, set-up notes) go to
    ``path`` at DEBUG and up instead of the terminal, which keeps the stages, the table and the
    progress bars; their warnings still reach both. The libraries' own notes go to the file only: transformers'
    and modelopt's log messages, Python warnings raised inside installed packages (modelopt's export notes),
    and transformers' progress bars (the one-time GGUF conversion) are off."""
    handler = logging.FileHandler(path, mode="w")
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    # imported first: both add their own stream handlers when imported, which must be quieted here
    import lightning.pytorch  # noqa: F401
    import transformers

    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "nemo_fp4qat", "transformers")]
    saved = [(lg, lg.level, [(h, h.level) for h in lg.handlers]) for lg in loggers]
    for lg in loggers:
        for h in lg.handlers:
            h.setLevel(max(h.level, logging.ERROR if lg.name == "transformers" else logging.WARNING))
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    modelopt_log = logging.getLogger("modelopt")  # no handler of its own: its warnings would reach stderr
    modelopt_log.addHandler(handler)
    modelopt_log.propagate = False
    show = warnings.showwarning

    def show_library_warnings_in_the_file(message, category, filename, lineno, file=None, line=None):
        if "site-packages" in str(filename):
            handler.stream.write(warnings.formatwarning(message, category, filename, lineno, line))
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = show_library_warnings_in_the_file
    try:
        yield handler.stream
    finally:
        warnings.showwarning = show
        modelopt_log.removeHandler(handler)
        modelopt_log.propagate = True
        if bars:
            transformers.utils.logging.enable_progress_bar()
        for lg, level, handlers in saved:
            lg.removeHandler(handler)
            lg.setLevel(level)
            for h, hl in handlers:
                h.setLevel(hl)
        handler.close()
