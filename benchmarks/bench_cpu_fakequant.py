"""CPU fake-quant throughput on a 4096x4096 fp32 tensor, side by side in one run.

Reference of record: ``copy_`` of the tensor into a preallocated buffer, the memory-bound limit for an
op that writes into the output it is given. The kernels are measured the same way (``out=`` a
preallocated tensor), with the vectorised and the scalar native paths side by side; ``clone``
(allocation + copy) and the allocating kernels show what a fresh output costs, and modelopt's own
pure-torch NVFP4 path (``NVFP4QTensor.quantize`` + ``dequantize``) is the peer.
Targets: NVFP4 and MXFP4 native into a preallocated output >= 0.5 x the preallocated copy (issue 37);
>= 10x modelopt's pure-torch path (issue 2).
"""

from __future__ import annotations

import torch
from common import best_of, machine, write_result

from nemo_fp4qat.numerics import fake_quant as cfq
from nemo_fp4qat.numerics import native_kernels
from nemo_fp4qat.numerics.cpu_shims import modelopt_export_on_cpu

COPY = "copy_ into preallocated (reference)"


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

    def scalar(fn):
        def run():
            with native_kernels.use_vector_path(False):
                return fn()

        return run

    def pure_torch(fn):
        def run():
            with cfq.use_native(False):
                return fn()

        return run

    vec = native_kernels.vector_path() or "none on this CPU"
    rows = {COPY: lambda: buf.copy_(x), "copy (clone: alloc + copy)": lambda: x.clone()}
    kernels = {
        "NVFP4": lambda **kw: cfq.fake_quant_nvfp4(x, amax, **kw),
        "MXFP4": lambda **kw: cfq.fake_quant_mx(x, (2, 1), **kw),
    }
    for name, fn in kernels.items():
        rows[f"{name} native, vectorised ({vec}), into out"] = lambda fn=fn: fn(out=buf)
        rows[f"{name} native, scalar, into out"] = scalar(lambda fn=fn: fn(out=buf))
        rows[f"{name} native, vectorised, new output"] = fn
        rows[f"{name} pure torch, new output"] = pure_torch(fn)
    rows["modelopt NVFP4QTensor quantize+dequantize"] = modelopt_qdq
    rates = {k: n / best_of(fn, reps=5) for k, fn in rows.items()}
    copy = rates[COPY]
    mo = rates["modelopt NVFP4QTensor quantize+dequantize"]
    lines = [
        "## CPU fake-quant throughput (4096x4096 fp32)",
        "",
        f"Machine: {machine()}. Best of 5 per row, all rows in one process.",
        "",
        "| implementation | M elements/s | / copy_ into preallocated | / modelopt pure-torch |",
        "|---|---:|---:|---:|",
    ]
    for k, r in rates.items():
        lines.append(f"| {k} | {r / 1e6:.0f} | {r / copy:.2f} | {r / mo:.1f} |")
    nv, mx = (rates[f"{f} native, vectorised ({vec}), into out"] for f in ("NVFP4", "MXFP4"))
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    lines += [
        "",
        f"Targets: NVFP4 native into out >= 0.5 x copy_: **{nv / copy:.2f}** ({met(nv / copy >= 0.5)}); "
        f"MXFP4: **{mx / copy:.2f}** ({met(mx / copy >= 0.5)}); "
        f"NVFP4 >= 10 x modelopt pure-torch: **{nv / mo:.1f}** ({met(nv / mo >= 10)}).",
        "",
    ]
    md = "\n".join(lines)
    data = {"rates_elems_per_s": rates, "machine": machine(), "vector_path": vec,
            "nvfp4_over_copy": nv / copy, "mxfp4_over_copy": mx / copy}  # fmt: skip
    write_result("cpu_fakequant", md, data)
    print(md)
    return data


if __name__ == "__main__":
    main()
