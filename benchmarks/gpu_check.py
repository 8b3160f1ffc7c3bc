"""GPU check (run on a lent H200 only; never part of the tests).

1. Parity: modelopt's own CUDA fake quant (Triton NVFP4 kernel, MX CUDA extension) against this
   package's CPU kernel on the same random tensors: bit-exact match count.
2. QAT step overhead on the GPU: NVFP4 QAT (modelopt, weights+inputs) vs BF16 training step of a
   Llama-style model, and peak memory, measured side by side in one run.
3. Fake-quant throughput: modelopt CUDA NVFP4 vs a device copy; our CPU kernel vs modelopt's
   pure-torch NVFP4QTensor on the host CPU.

Writes JSON to $OUT/gpu_results.json (or ./gpu_results.json).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.getcwd())
RESULTS: dict = {"device": None, "parity": [], "errors": []}


def log(*a):
    print(*a, flush=True)


def parity():
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    import nemo_fp4qat  # noqa: F401  (installs the CPU hook; CUDA tensors still go to modelopt)

    fmts = {
        "nvfp4": dict(num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}),
        "mxfp4": dict(num_bits=(2, 1), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)}),
        "mxfp6_e2m3": dict(num_bits=(2, 3), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)}),
        "mxfp6_e3m2": dict(num_bits=(3, 2), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)}),
        "mxfp8": dict(num_bits=(4, 3), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)}),
    }
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, attrs in fmts.items():
        for dtype in (torch.float32, torch.bfloat16):
            for shape in ((256, 4096), (33, 160), (4, 8, 96)):
                for mag in (1e-2, 1.0, 50.0):
                    rec = {"format": name, "dtype": str(dtype), "shape": list(shape), "mag": mag}
                    try:
                        x = (
                            torch.randn(shape, generator=g)
                            * mag
                            * torch.rand(shape[0], *[1] * (len(shape) - 1), generator=g)
                        ).to(dtype)
                        q = TensorQuantizer(QuantizerAttributeConfig(**attrs))
                        if name == "nvfp4":
                            q.amax = x.float().abs().amax() * 0.9  # some saturation too
                        y_gpu = q.cuda()(x.cuda()).cpu()
                        y_cpu = q.cpu()(x)
                        same = (y_gpu == y_cpu) | (torch.isnan(y_gpu) & torch.isnan(y_cpu))
                        rec.update(
                            numel=x.numel(),
                            mismatches=int((~same).sum()),
                            max_abs_diff=float((y_gpu.float() - y_cpu.float()).abs().max()),
                        )
                    except Exception as e:  # record and go on
                        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    RESULTS["parity"].append(rec)
                    log("parity", rec)


def time_cuda(fn, warm=3, reps=10):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def throughput():
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    from nemo_fp4qat.numerics.fake_quant import fake_quant_mx, fake_quant_nvfp4

    x = torch.randn(4096, 4096, device="cuda")
    q = TensorQuantizer(
        QuantizerAttributeConfig(num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)})
    ).cuda()
    q.amax = x.abs().amax()
    n = x.numel()
    RESULTS["gpu_fakequant_nvfp4_elems_per_s"] = n / time_cuda(lambda: q(x))
    RESULTS["gpu_copy_elems_per_s"] = n / time_cuda(lambda: x.clone())
    xc = x.cpu()
    amax = xc.abs().amax()

    def t_cpu(fn, reps=3):
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps

    RESULTS["host_cpu_threads"] = torch.get_num_threads()
    RESULTS["cpu_copy_elems_per_s"] = n / t_cpu(lambda: xc.clone())
    RESULTS["cpu_ours_nvfp4_elems_per_s"] = n / t_cpu(lambda: fake_quant_nvfp4(xc, amax))
    RESULTS["cpu_ours_mxfp4_elems_per_s"] = n / t_cpu(lambda: fake_quant_mx(xc, (2, 1)))
    RESULTS["cpu_modelopt_nvfp4qtensor_elems_per_s"] = n / t_cpu(lambda: NVFP4QTensor.quantize(xc, 16))
    log({k: v for k, v in RESULTS.items() if k.endswith("per_s")})


def qat_step_overhead():
    import modelopt.torch.quantization as mtq
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
    tokens = torch.randint(0, 32000, (4, 1024), device="cuda")
    out = {}
    for variant in ("bf16", "nvfp4_qat"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
        if variant == "nvfp4_qat":
            mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(tokens[:2, :256]))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(model=model, opt=opt):
            loss = model(tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        torch.cuda.reset_peak_memory_stats()
        dt = time_cuda(step, warm=3, reps=10)
        out[variant] = {"step_s": dt, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
        log(variant, out[variant])
        del model, opt
        torch.cuda.empty_cache()
    out["step_time_ratio_qat_over_bf16"] = out["nvfp4_qat"]["step_s"] / out["bf16"]["step_s"]
    out["peak_mem_ratio_qat_over_bf16"] = out["nvfp4_qat"]["peak_mem_gib"] / out["bf16"]["peak_mem_gib"]
    out["model"] = "Llama 8x2048 (GQA 16/4), ffn 5632, vocab 32000, batch 4x1024 tokens, AdamW"
    RESULTS["qat_step"] = out


def main():
    import modelopt

    RESULTS["device"] = torch.cuda.get_device_name(0)
    RESULTS["torch"] = torch.__version__
    RESULTS["modelopt"] = modelopt.__version__
    for part in (parity, throughput, qat_step_overhead):
        t = time.time()
        try:
            part()
        except Exception:
            RESULTS["errors"].append(f"{part.__name__}: {traceback.format_exc()[-1500:]}")
            log(RESULTS["errors"][-1])
        log(f"{part.__name__} took {time.time() - t:.1f}s")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "gpu_results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    bad = [r for r in RESULTS["parity"] if r.get("mismatches") or r.get("error")]
    log(f"parity: {len(RESULTS['parity'])} cases, {len(bad)} with mismatches/errors")


if __name__ == "__main__":
    main()
