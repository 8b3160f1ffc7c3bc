"""Per-tensor quantization-quality metrics (pure functions, no Lightning).

Every metric is computed in float64 from a tensor and its fake-quantized version, so the monitor,
reports and tests agree on one definition. The monitor runs them on every quantized layer of the model
at each precision switch, so they avoid the copies that dominated their cost: a tensor whose float64
sum is finite has no NaN/Inf (one reduction instead of an elementwise mask and a gathered copy), and
the fourth moment comes from the squared deviations dotted with themselves (no generic ``pow``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["quantization_error", "weight_statistics"]


def _all_finite(t: torch.Tensor) -> bool:
    # NaN and Inf propagate through a sum (Inf - Inf = NaN), and a float64 sum of float32/bf16/fp16
    # values cannot overflow; so a finite sum means every element is finite, at the cost of one reduction
    return t.numel() == 0 or math.isfinite(float(t.sum(dtype=torch.float64)))


def quantization_error(x: torch.Tensor, qx: torch.Tensor) -> dict[str, float]:
    """``rel_err = ||Q(x) - x|| / ||x||`` and ``sqnr_db = 20 log10(||x|| / ||Q(x) - x||)``.

    Elements where ``x`` or ``Q(x)`` is not finite are left out of both norms.
    """
    xd, qd = x.detach().double(), qx.detach().double()
    if not (_all_finite(xd) and _all_finite(qd)):
        finite = torch.isfinite(xd) & torch.isfinite(qd)
        xd, qd = xd[finite], qd[finite]
    sig = float(torch.linalg.vector_norm(xd))
    err = float(torch.linalg.vector_norm(qd - xd))
    rel = err / sig if sig > 0 else (0.0 if err == 0 else math.inf)
    sqnr = math.inf if err == 0 else (20 * math.log10(sig / err) if sig > 0 else -math.inf)
    return {"rel_err": rel, "sqnr_db": sqnr}


def weight_statistics(
    w: torch.Tensor, qw: torch.Tensor, amax: float | None = None, block: int | None = None
) -> dict[str, Any]:
    """Mean, std, absmax, kurtosis, saturation, flush-to-zero, non-finite count, block underflow.

    * ``saturated_frac``: elements beyond the per-tensor amax (clipped by the format's static scale).
    * ``flushed_frac``: non-zero elements that quantize to exactly zero.
    * ``block_underflow_frac`` (block formats): blocks whose every non-zero element became zero.
    """
    wd = w.detach().double().reshape(-1)
    qd = qw.detach().double().reshape(-1)
    if _all_finite(wd):
        f, nonfinite, finite = wd, 0, None
    else:
        finite = torch.isfinite(wd)
        f, nonfinite = wd[finite], int((~finite).sum())
    n = max(1, f.numel())
    mean = float(f.mean()) if f.numel() else 0.0
    d2 = (f - mean).square_()
    var = float(d2.mean()) if f.numel() else 0.0
    std = math.sqrt(var)
    kurt = float(torch.dot(d2, d2)) / n / var**2 if var > 0 else 0.0
    nonzero = wd != 0
    flushed = (qd == 0) & nonzero if finite is None else (qd == 0) & nonzero & finite
    lo, hi = torch.aminmax(f) if f.numel() else (torch.zeros(()), torch.zeros(()))
    out: dict[str, Any] = {
        "mean": mean,
        "std": std,
        "absmax": max(-float(lo), float(hi)) if f.numel() else 0.0,
        "kurtosis": kurt,
        "nonfinite": nonfinite,
        "flushed_frac": float(flushed.sum()) / max(1, int(nonzero.sum())),
        "saturated_frac": float((f.abs() > amax).sum()) / n if amax is not None and amax > 0 else 0.0,
        "block_underflow_frac": 0.0,
    }
    if block and w.shape[-1] % block == 0 and w.numel():
        nzb = nonzero.reshape(-1, block).any(dim=1)
        allzero = ~(qd.reshape(-1, block) != 0).any(dim=1)
        out["block_underflow_frac"] = float((nzb & allzero).sum()) / max(1, int(nzb.sum()))
    return out
