"""Per-tensor quantization-quality metrics (pure functions, no Lightning).

Every metric is computed in float64 from a tensor and its fake-quantized version, so the monitor,
reports and tests agree on one definition.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["quantization_error", "weight_statistics"]


def quantization_error(x: torch.Tensor, qx: torch.Tensor) -> dict[str, float]:
    """``rel_err = ||Q(x) - x|| / ||x||`` and ``sqnr_db = 20 log10(||x|| / ||Q(x) - x||)``."""
    xd, qd = x.detach().double(), qx.detach().double()
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
    nonfinite = int((~torch.isfinite(wd)).sum())
    f = wd[torch.isfinite(wd)]
    n = max(1, f.numel())
    mean = float(f.mean()) if f.numel() else 0.0
    std = float(f.std(unbiased=False)) if f.numel() else 0.0
    kurt = float(((f - mean) ** 4).mean() / std**4) if std > 0 else 0.0
    nonzero = wd != 0
    flushed = (qd == 0) & nonzero & torch.isfinite(wd)
    out: dict[str, Any] = {
        "mean": mean,
        "std": std,
        "absmax": float(f.abs().max()) if f.numel() else 0.0,
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
