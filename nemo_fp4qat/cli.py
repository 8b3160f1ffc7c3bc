"""The ``nemo-fp4qat`` command line: ``demo``, ``eval`` (quality gate), ``formats``, ``models``, ``export``,
``validate``, ``serve``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["main", "supported_models_markdown"]


_GROUP_NAMES = {"ssm_mixer": "Mamba mixers", "linear_attention": "linear attention", "mlp": "MLP",
                "shared_experts": "shared experts", "other": "other linears",
                "mixer_feeding_attention": "the mixer feeding each attention layer"}  # fmt: skip


def _preset_formats(preset: str, groups: tuple[str, ...]) -> str:
    """What ``preset`` gives each of ``groups`` (``attention FP8; MLP, experts NVFP4``), and its KV cache."""
    from .qat.policy.rules import LayerPolicy

    policy = LayerPolicy.preset(preset)
    formats: dict[str, tuple[str, str]] = {}
    for rule in policy.rules:
        formats.setdefault(rule.group, (rule.weight, rule.input))
    by_label: dict[str, list[str]] = {}
    for group in groups:
        weight, act = formats.get(group, (policy.default, policy.default))
        if weight == "bf16":
            label = "16-bit"
        elif act in (weight, None):
            label = weight.upper()
        else:
            label = f"{weight.upper()} weights" if act == "bf16" else f"{weight.upper()} weights, {act.upper()} inputs"
        by_label.setdefault(label, []).append(_GROUP_NAMES.get(group, group))
    text = "; ".join(f"{', '.join(names)} {label}" for label, names in by_label.items())
    return text + (f"; KV cache {policy.kv_cache.upper()}" if policy.kv_cache else "")


def supported_models_markdown() -> str:
    """The README's supported-models table, rendered from :data:`nemo_fp4qat.architectures.FAMILIES` (the preset's
    formats read from the preset itself)."""
    from .architectures import FAMILIES

    rows = ["| Family | Front ends | Preset: what it quantizes | Export | Read back by |", "|---|---|---|---|---|"]
    for f in FAMILIES:
        if f.refused:
            rows.append(f"| {f.name} | {', '.join(f.front_ends)} | refused by name: {f.refused} | - | - |")
            continue
        what = f"`{f.preset}`: {_preset_formats(f.preset, f.quantizes)}"
        readers = ", ".join(("the validator", *f.readers))
        export = ", ".join(f.export) or "not tested yet"
        readers = readers if f.export else "-"
        rows.append(f"| {f.name} | {', '.join(f.front_ends)} | {what} | {export} | {readers} |")
    return "\n".join(rows) + "\n"


def _models(args: argparse.Namespace) -> int:
    if args.markdown:
        sys.stdout.write(supported_models_markdown())
        return 0
    from rich.console import Console
    from rich.markdown import Markdown

    Console().print(Markdown(supported_models_markdown()))
    return 0


def _formats(_: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .numerics.formats import list_formats

    t = Table(title="nemo-fp4qat formats")
    for col in ("name", "element", "block", "scale", "bits/elem", "TRT-LLM quant_algo", "native on"):
        t.add_column(col)
    for f in list_formats():
        if f.element is None:
            el = "-"
        elif f.element[0] == "int":
            el = f"INT{f.element[1]}"
        else:
            el = f"E{f.element[0]}M{f.element[1]}"
        t.add_row(
            f.name,
            el,
            str(f.block_size or "-"),
            f.scale,
            f"{f.bits_per_element:g}",
            f.trtllm_quant_algo or "-",
            ", ".join(f.hardware),
        )
    Console().print(t)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo.pipeline import run_demo

    smoothing: Any = None  # None: the demo's default
    if args.smoothing == ["off"]:
        smoothing = False
    elif args.smoothing is not None or args.smoothing_alpha is not None:
        smoothing = {k: v for k, v in (("sites", args.smoothing), ("alpha", args.smoothing_alpha)) if v}
    return run_demo(out_dir=args.out, quick=args.quick, steps=args.steps, distill_alpha=args.distill,
                    schedule=args.schedule, policy=args.policy, mode=args.mode, qad_lr=args.qad_lr,
                    qad_steps=args.qad_steps, plain_qat=args.plain_qat or None, smoothing=smoothing,
                    block_scale_search=args.block_scale_search, gptq=args.gptq, moe=args.moe or None)  # fmt: skip


def _eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .eval.gate import QualityGate

    if args.report:
        report = json.loads(Path(args.report).read_text())
        variants = report["variants"]
    else:
        if not args.model:
            print("nemo-fp4qat eval: give --report REPORT.json, or --model DIR [--text FILE]", file=sys.stderr)
            return 2
        return _eval_model(args)
    for name, v in variants.items():
        acc = "" if v.get("acc") is None else f"  acc {100 * v['acc']:.1f}%"
        print(f"{name:>16}: perplexity {v['ppl']:.3f}{acc}")
    if report.get("recovery") is not None:
        print(f"recovery: {report['recovery']:.3f}")
    if not args.gate:
        return 0
    gate = QualityGate(max_ppl_increase_pct=args.max_ppl_increase, max_acc_drop=args.max_acc_drop,
                       candidate=args.candidate, baseline=args.baseline)  # fmt: skip
    return _gate_verdict(lambda: gate.check(variants), f"{args.candidate} vs {args.baseline}")


def _gate_verdict(check: Any, label: str) -> int:
    """Run a quality-gate ``check``; print its verdict; exit status 0 passed, 1 failed, 2 the check was refused."""
    try:
        res = check()
    except ValueError as e:
        print(f"quality gate: {e}", file=sys.stderr)
        return 2
    if res.passed:
        print(f"quality gate PASSED ({label}): {res.checks}")
        return 0
    for f in res.failures:
        print(f"quality gate FAILED: {f}", file=sys.stderr)
    return 1


def _eval_model(args: argparse.Namespace) -> int:
    """Perplexity of a model directory: an export (what deploys, rebuilt by the serving unpacker) or
    a plain Hugging Face model. Without --text, the demo's held-out book and windows."""
    import json
    from pathlib import Path

    from .eval.evaluation import evaluate, load_mc_tasks
    from .export.deployed_model import is_export_dir, load_deployed_model

    if args.tasks and args.model is None:
        print("nemo-fp4qat eval: --tasks needs --model DIR or --export DIR", file=sys.stderr)
        return 2
    if is_export_dir(args.model):
        deployed = load_deployed_model(args.model)
        model, tok, formats = deployed.model, deployed.tokenizer, deployed.weight_formats
        if tok is None:
            print(f"nemo-fp4qat eval: {args.model} has no tokenizer (export with tokenizer=...).", file=sys.stderr)
            return 2
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        model, formats = AutoModelForCausalLM.from_pretrained(args.model), None
    if args.tasks:
        return _lm_eval(args, model, tok)
    if args.text:
        text, window, windows = Path(args.text).read_text(), args.window or 512, args.windows or 16
    else:  # the demo's validation set, so the figure is comparable with runs/demo/report.json
        from .demo.model import load_corpus
        from .demo.pipeline import DemoConfig

        d = DemoConfig()
        text, window, windows = load_corpus("persuasion"), args.window or d.eval_window, args.windows or d.eval_windows
    ids = tok(text)["input_ids"][: window * windows]
    mc = load_mc_tasks(args.mc) if args.mc else None
    res = evaluate(model, ids, window=window, max_windows=windows, tokenizer=tok, mc_tasks=mc, weight_formats=formats)
    print(json.dumps(res.as_dict(), indent=1))
    return 0


def _lm_eval(args: argparse.Namespace, model: Any, tok: Any) -> int:
    """lm-evaluation-harness on the loaded model: its table on stdout, its results JSON at --output, and with
    --gate --baseline-results the gate on task metrics."""
    import json
    import tempfile
    from pathlib import Path

    from .eval.gate import QualityGate
    from .eval.harness import lm_eval_table, run_lm_eval, write_local_tasks

    names, include = [], []
    for item in args.tasks.split(","):
        if Path(item).is_dir():  # a directory of task YAMLs: every task it defines
            include.append(item)
            names += [line.split(":", 1)[1].strip() for f in sorted(Path(item).glob("*.y*ml"))
                      for line in f.read_text().splitlines() if line.startswith("task:")]  # fmt: skip
        else:
            names.append(item.strip())
    with tempfile.TemporaryDirectory() as tmp:
        from .demo.model import load_corpus

        include.append(str(write_local_tasks(tmp, load_corpus("persuasion"))))
        try:
            limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
            results = run_lm_eval(model, tok, names, include_path=include, limit=limit,
                                  batch_size=args.batch_size, output=args.output)  # fmt: skip
        except ValueError as e:
            print(f"nemo-fp4qat eval: {e}", file=sys.stderr)
            return 2
    print(lm_eval_table(results))
    print(f"lm-eval results: {args.output}")
    if not args.gate:
        return 0
    if not args.baseline_results:
        print("nemo-fp4qat eval: --gate with --tasks needs --baseline-results (the baseline's lm-eval JSON)",
              file=sys.stderr)  # fmt: skip
        return 2
    gate = QualityGate(max_ppl_increase_pct=args.max_ppl_increase, max_acc_drop=args.max_acc_drop)
    baseline = json.loads(Path(args.baseline_results).read_text())
    return _gate_verdict(lambda: gate.check_lm_eval(results, baseline), f"lm-eval tasks vs {args.baseline_results}")


def _export(args: argparse.Namespace) -> int:
    import modelopt.torch.opt as mto
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .export import ExportConfig, ExportRefused, ExportValidationError, export_checkpoint

    try:
        cfg = ExportConfig(kind=args.kind, runtime=args.runtime, tensor_parallel=args.tp, dtype=args.dtype,
                           overwrite=args.overwrite, decoder_type=args.decoder_type)  # fmt: skip
    except ValueError as e:
        print(f"nemo-fp4qat export: {e}", file=sys.stderr)
        return 2
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
    mto.restore(model, args.modelopt_state)  # quantizers, formats and amax as trained
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    try:
        path = export_checkpoint(model, args.out, cfg, tokenizer=tokenizer)
    except (ExportRefused, ExportValidationError, FileExistsError) as e:
        print(f"nemo-fp4qat export: {e}", file=sys.stderr)
        return 2 if not isinstance(e, ExportValidationError) else 1
    print((path / "validation.json").read_text() if (path / "validation.json").exists() else path)
    print(f"exported to {path}; build plan: {path / 'build_engine.sh'}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    import json

    from .export import validate_export

    try:
        report = validate_export(args.dir, runtime=args.runtime)
    except (FileNotFoundError, ValueError) as e:
        print(f"nemo-fp4qat validate: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0 if report.ok else 1


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    import uvicorn

    from .serve import ServeSettings, create_app, load_backend

    key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    settings = ServeSettings(
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens,
        max_batch_size=args.max_batch_size,
        timeout_s=args.timeout,
        api_key=key,
        max_body_bytes=args.max_body_bytes,
        max_queued_requests=args.max_queued_requests,
    )
    app = create_app(load_backend(args.export_dir, args.backend), settings)
    uvicorn.run(app, host=args.host, port=args.port, timeout_graceful_shutdown=int(args.timeout) + 5)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``nemo-fp4qat`` command line (tests parse every documented command with it)."""
    p = argparse.ArgumentParser(prog="nemo-fp4qat", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the end-to-end FP4 QAT demo on the embedded default")
    d.add_argument("--out", default="runs/demo", help="output directory")
    d.add_argument("--quick", action="store_true", help="a few steps only (smoke test)")
    d.add_argument("--steps", type=int, help="training steps for the fine-tune and QAT runs")
    d.add_argument("--mode", choices=["qad", "qat"], help="QAT stage: qad (default: the PTQ model distilled from "
                   "the fine-tune) or qat (plain QAT from the original model)")  # fmt: skip
    d.add_argument("--qad-lr", type=float, help="learning rate of the QAD stage (default 5e-5)")
    d.add_argument("--qad-steps", type=int, help="steps of the QAD stage (default: --steps)")
    d.add_argument("--plain-qat", action="store_true", help="also run plain QAT and report it beside QAD")
    d.add_argument("--distill", type=float, help="--mode qat: weight of distillation from the original (0..1)")
    d.add_argument("--schedule", help="--mode qat: precision schedule preset or YAML (default: progressive)")
    d.add_argument("--policy", help="layer policy preset or YAML (default: smollm2_auto, modelopt "
                   "AutoQuantize's choice for SmolLM2 at the default preset's bits)")  # fmt: skip
    d.add_argument("--smoothing", nargs="*", metavar="SITE", help="fold SmoothQuant factors into the weights "
                   "before calibration at these sites (attn_in mlp_in mlp_down; none given: the default sites), "
                   "'off' to disable")  # fmt: skip
    d.add_argument("--smoothing-alpha", type=float, help="migration strength of --smoothing (default 0.5)")
    d.add_argument("--block-scale-search", action=argparse.BooleanOptionalAction, help="clip NVFP4 weights to their "
                   "minimum-error block scales after calibration (default: the demo's recipe)")  # fmt: skip
    d.add_argument("--gptq", action=argparse.BooleanOptionalAction, help="round the weights with modelopt's GPTQ "
                   "after calibration, so the QAT stage starts from them (default: the demo's recipe)")  # fmt: skip
    d.add_argument("--moe", action="store_true", help="run it on a mixture-of-experts model: SmolLM2 upcycled into a "
                   "Mixtral (4 experts, top 2), policy 'default' (experts NVFP4, routers 16-bit), no smoothing, "
                   "unified HF export only")  # fmt: skip
    d.set_defaults(fn=_demo)
    e = sub.add_parser("eval", help="evaluate a model, or check a comparison report against the quality gate")
    e.add_argument("--report", help="report.json written by `demo` (variants to compare)")
    e.add_argument("--model", "--export", dest="model", help="an export directory (unified HF or TRT-LLM "
                   "checkpoint: evaluated as deployed) or a Hugging Face model directory")  # fmt: skip
    e.add_argument("--tasks", help="lm-evaluation-harness tasks, comma-separated names or directories of task YAMLs "
                   "(shipped, offline: fp4qat_next_sentence, fp4qat_heldout_perplexity)")  # fmt: skip
    e.add_argument("--limit", type=float, help="documents per lm-eval task (a fraction if < 1)")
    e.add_argument("--batch-size", type=int, default=8, help="lm-eval batch size")
    e.add_argument("--output", default="lm_eval_results.json", help="where lm-eval's results JSON goes")
    e.add_argument("--baseline-results", help="the baseline's lm-eval results JSON, for --gate with --tasks")
    e.add_argument("--text", help="held-out text file for perplexity (default: the demo's validation book)")
    e.add_argument("--mc", help="multiple-choice JSONL file {input, choices, answer}")
    e.add_argument("--window", type=int, help="tokens per window (default 512; the demo's 256 without --text)")
    e.add_argument("--windows", type=int, help="windows (default 16; the demo's 8 without --text)")
    e.add_argument("--gate", action="store_true", help="exit non-zero if the quality gate fails")
    e.add_argument("--max-ppl-increase", type=float, default=0.5, help="percent over the baseline")
    e.add_argument("--max-acc-drop", type=float, default=1.0, help="accuracy points below the baseline")
    e.add_argument("--candidate", default="qat")
    e.add_argument("--baseline", default="bf16_finetuned")
    e.set_defaults(fn=_eval)
    f = sub.add_parser("formats", help="list the supported quantization formats")
    f.set_defaults(fn=_formats)
    m = sub.add_parser("models", help="list the supported model families: front ends, preset, export, readers")
    m.add_argument("--markdown", action="store_true", help="print the README's markdown table")
    m.set_defaults(fn=_models)
    x = sub.add_parser(
        "export",
        help="export a QAT-trained Hugging Face model (unified HF or TRT-LLM checkpoint)",
        description="Rebuild a QAT-trained Hugging Face model from its base folder and the file "
        "`modelopt.torch.opt.save(model, PATH)` wrote after training (quantizers, formats, amax and weights), "
        "then export it validated and atomically. In training, FP4QATCallback(export_dir=..., export={...}) "
        "does the same at the end of fit without this step; `make demo` exports to runs/demo/export "
        "(unified HF) and runs/demo/export_trtllm (TensorRT-LLM checkpoint, qnemo layout). NeMo training: "
        "NeMoFP4QATCallback(export_dir=...) writes the TensorRT-LLM checkpoint at the end of fit (see README).",
    )
    x.add_argument("--model", required=True, help="the Hugging Face model directory the QAT run started from")
    x.add_argument("--modelopt-state", required=True, help="file written by mto.save(model, PATH) after QAT")
    x.add_argument("--out", required=True, help="export directory (written atomically)")
    x.add_argument("--kind", default="hf", choices=["hf", "trtllm"])
    x.add_argument("--runtime", default="trtllm", choices=["trtllm", "vllm", "sglang", "pytorch"])
    x.add_argument("--tp", type=int, default=1, help="inference tensor parallelism (--kind trtllm)")
    x.add_argument("--dtype", default=None, help="dtype of unquantized tensors (default: the model's; a float32 "
                   "model's in float16 for the engines, float32 for --runtime pytorch)")  # fmt: skip
    x.add_argument("--decoder-type", default=None, help="modelopt decoder type for --kind trtllm (inferred)")
    x.add_argument("--overwrite", action="store_true")
    x.set_defaults(fn=_export)
    v = sub.add_parser("validate", help="check an exported checkpoint the way a runtime would")
    v.add_argument("dir")
    v.add_argument("--runtime", default="trtllm", choices=["trtllm", "vllm", "sglang", "pytorch"])
    v.add_argument("--json", action="store_true")
    v.set_defaults(fn=_validate)
    s = sub.add_parser("serve", help="serve an exported checkpoint over HTTP (the OpenAI completions and chat API)")
    s.add_argument("export_dir")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key-file", help="file holding the bearer token required on every endpoint but /health")
    s.add_argument("--backend", default="auto", choices=["auto", "pytorch", "trtllm"])
    s.add_argument("--max-prompt-tokens", type=int, default=1024)
    s.add_argument("--max-tokens", type=int, default=256, help="upper limit for a request's max_tokens")
    s.add_argument("--max-batch-size", type=int, default=8)
    s.add_argument("--timeout", type=float, default=60.0, help="seconds before a request is cancelled (504)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    s.add_argument("--max-queued-requests", type=int, default=64, help="beyond this many waiting: 503 + Retry-After")
    s.set_defaults(fn=_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
