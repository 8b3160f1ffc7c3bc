"""CPU fake-quant throughput on a 4096x4096 fp32 tensor, side by side in one run.

References: a plain copy of the tensor (``clone``: allocation + copy, the memory-bound ceiling for
an op that returns a new tensor; ``copy_`` into a preallocated buffer is shown too) and modelopt's
own pure-torch NVFP4 path (``NVFP4QTensor.quantize`` + ``dequantize``).
Targets (issue 2): >= 25% of the copy rate, >= 10x modelopt's pure-torch path.
"""

from __future__ import annotations

import torch
from common import best_of, machine, write_result

from nemo_fp4qat.numerics import fake_quant as cfq
from nemo_fp4qat.numerics.cpu_shims import modelopt_export_on_cpu


def main() -> dict:
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    torch.manual_seed(0)
    x = torch.randn(4096, 4096)
    amax = x.abs().amax()
    n = x.numel()
    buf = torch.empty_like(x)

    def modelopt_qdq():
        with modelopt_export_on_cpu():
            q, s, s2 = NVFP4QTensor.quantize(x, 16)
        return q.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16})

    rows = {
        "copy (clone: alloc + copy)": lambda: x.clone(),
        "copy_ into preallocated": lambda: buf.copy_(x),
        "modelopt NVFP4QTensor quantize+dequantize": modelopt_qdq,
    }
    for name, fn in [("NVFP4", lambda: cfq.fake_quant_nvfp4(x, amax)), ("MXFP4", lambda: cfq.fake_quant_mx(x, (2, 1)))]:
        rows[f"nemo_fp4qat {name} (native C)"] = fn

        def torch_path(fn=fn):
            with cfq.use_native(False):
                return fn()

        rows[f"nemo_fp4qat {name} (pure torch)"] = torch_path
    rates = {k: n / best_of(fn, reps=3) for k, fn in rows.items()}
    copy = rates["copy (clone: alloc + copy)"]
    mo = rates["modelopt NVFP4QTensor quantize+dequantize"]
    lines = [
        "## CPU fake-quant throughput (4096x4096 fp32)",
        "",
        f"Machine: {machine()}.",
        "",
        "| implementation | M elements/s | / copy (clone) | / modelopt pure-torch |",
        "|---|---:|---:|---:|",
    ]
    for k, r in rates.items():
        lines.append(f"| {k} | {r / 1e6:.0f} | {r / copy:.2f} | {r / mo:.1f} |")
    nv = rates["nemo_fp4qat NVFP4 (native C)"]
    lines += [
        "",
        f"Targets: NVFP4 native >= 0.25 x copy: **{nv / copy:.2f}** ({'met' if nv / copy >= 0.25 else 'NOT met'}); "
        f">= 10 x modelopt pure-torch: **{nv / mo:.1f}** ({'met' if nv / mo >= 10 else 'NOT met'}).",
        "",
    ]
    md = "\n".join(lines)
    data = {"rates_elems_per_s": rates, "machine": machine()}
    write_result("cpu_fakequant", md, data)
    print(md)
    return data


if __name__ == "__main__":
    main()
