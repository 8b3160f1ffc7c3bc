"""Independent float64 / numpy references for the formats (no code shared with the package).

Values of each element format are enumerated from its definition (sign, exponent bias, subnormals,
E4M3's single NaN code) and rounding picks the nearest value, ties to the even code.
"""

from __future__ import annotations

import math

import numpy as np
import torch

FORMATS = {(2, 1), (2, 3), (3, 2), (4, 3)}


def minifloat_values(e_bits: int, m_bits: int) -> np.ndarray:
    """All non-negative finite values in code order (code i <-> values[i])."""
    bias = 2 ** (e_bits - 1) - 1
    vals = []
    for e in range(2**e_bits):
        for m in range(2**m_bits):
            if (e_bits, m_bits) == (4, 3) and e == 15 and m == 7:
                continue  # E4M3fn: S.1111.111 is NaN
            if e == 0:
                vals.append(m / 2**m_bits * 2.0 ** (1 - bias))
            else:
                vals.append((1 + m / 2**m_bits) * 2.0 ** (e - bias))
    return np.array(vals, dtype=np.float64)


def e2m1_code_value(code: int) -> float:
    """The value of a 4-bit E2M1 code as checkpoints store it: bits 0-2 index the magnitudes, bit 3 is the sign."""
    v = float(_E2M1[code & 7])
    return -v if code & 8 else v


_E2M1 = minifloat_values(2, 1)


def round_ref(v: np.ndarray, e_bits: int, m_bits: int) -> np.ndarray:
    """Round |v| (float64) to the format: nearest, ties to even code, saturating; NaN stays NaN."""
    vals = minifloat_values(e_bits, m_bits)
    v = np.asarray(v, dtype=np.float64)
    out = np.empty_like(v)
    flat, res = v.reshape(-1), out.reshape(-1)
    for k, x in enumerate(flat):
        if math.isnan(x):
            res[k] = math.nan
            continue
        if x >= vals[-1]:
            res[k] = vals[-1]
            continue
        i = int(np.searchsorted(vals, x))  # vals[i-1] < x <= vals[i]
        if vals[i] == x:
            res[k] = x
            continue
        lo, hi = vals[i - 1], vals[i]
        if x - lo < hi - x:
            res[k] = lo
        elif hi - x < x - lo:
            res[k] = hi
        else:
            res[k] = lo if (i - 1) % 2 == 0 else hi
    return out


def e8m0_exponent_ref(block_amax_f32: np.ndarray, elem_max: float) -> np.ndarray:
    """modelopt's MX scale exponent: ceil(log2(amax/elem_max)) of the float32 ratio, with the CUDA
    kernel's edge cases (no round-up at the top binade; float32-subnormal ratios)."""
    ratios = (np.asarray(block_amax_f32, dtype=np.float32) / np.float32(elem_max)).astype(np.float32)
    out = np.empty(ratios.shape, dtype=np.int64)
    for k, r in enumerate(ratios.reshape(-1).astype(np.float64)):
        if r == 0:
            out.reshape(-1)[k] = -127
            continue
        if r < 2.0**-126:  # float32 subnormal
            out.reshape(-1)[k] = -127 if r <= 2.0**-127 else -126
            continue
        m, e = math.frexp(r)  # r = m * 2**e, m in [0.5, 1)
        floor_log2 = e - 1
        exact = m == 0.5
        if exact or floor_log2 == 127:
            out.reshape(-1)[k] = floor_log2
        else:
            out.reshape(-1)[k] = floor_log2 + 1
    return out


def mx_ref(x: np.ndarray, element: tuple[int, int], block: int) -> np.ndarray:
    """MX fake quant (float64 except the float32 ratio the kernel forms)."""
    elem_max = float(minifloat_values(*element)[-1])
    x = np.asarray(x, dtype=np.float32)
    shape = x.shape
    n = shape[-1]
    rows = x.reshape(-1, n).astype(np.float64)
    pad = (-n) % block
    rows = np.pad(rows, ((0, 0), (0, pad)))
    blocks = rows.reshape(rows.shape[0], -1, block)
    absb = np.abs(blocks)
    amax = np.nanmax(np.where(np.isnan(absb), 0, absb), axis=-1, keepdims=True)
    ue = e8m0_exponent_ref(amax.astype(np.float32), elem_max).astype(np.float64)
    ue = np.where((amax == 0) | np.isinf(amax), 0.0, ue)
    q = round_ref(absb * 2.0**-ue, *element) * 2.0**ue
    y = np.where(blocks < 0, -q, q)
    y = np.where(np.isnan(blocks), np.nan, y)
    return y.reshape(rows.shape)[:, :n].reshape(shape)


def nvfp4_ref(x: np.ndarray, amax: float, block: int = 16) -> np.ndarray:
    """NVFP4 fake quant with numpy float32 arithmetic for the scale chain (as the kernel)."""
    x = np.asarray(x, dtype=np.float32)
    shape = x.shape
    n = shape[-1]
    rows = x.reshape(-1, n)
    pad = (-n) % block
    rows = np.pad(rows, ((0, 0), (0, pad)))
    blocks = rows.reshape(rows.shape[0], -1, block)
    absb = np.abs(blocks)
    gs = np.float32(amax) / np.float32(6.0 * 448.0)
    bmax = np.where(np.isnan(absb), np.float32(0), absb).max(axis=-1, keepdims=True)
    ratio = np.minimum(bmax / (np.float32(6.0) * gs), np.float32(448.0)).astype(np.float32)
    s = (round_ref(ratio.astype(np.float64), 4, 3).astype(np.float32) * gs).astype(np.float32)
    s = np.where(s < np.float32(1e-5), np.float32(1.0), s).astype(np.float32)
    scaled = (absb / s).astype(np.float32)
    q = (round_ref(scaled.astype(np.float64), 2, 1).astype(np.float32) * s).astype(np.float32)
    y = np.where(blocks >= 0, q, -q)
    y = np.where(np.isnan(blocks), np.nan, y)
    return y.reshape(rows.shape)[:, :n].reshape(shape)


def tie_blocks(element: tuple[int, int], block: int, dtype: torch.dtype) -> torch.Tensor:
    """Blocks whose scale is exactly 1 (each starts with the format's largest value) holding every
    midpoint between neighbouring values (exact ties) and, in float32, the floats either side of them,
    in both signs; only values the dtype holds exactly."""
    vals = minifloat_values(*element)
    mids = (vals[:-1] + vals[1:]) / 2
    probes = np.concatenate(
        [mids, np.nextafter(mids.astype(np.float32), 0), np.nextafter(mids.astype(np.float32), 1e9)]
    )
    probes = np.concatenate([probes, -probes]).astype(np.float32)
    t = torch.from_numpy(probes)
    t = t[t.to(dtype).float() == t]  # exactly representable in the input dtype
    per = block - 1
    n_blocks = -(-len(t) // per)
    rows = torch.zeros(n_blocks, block)
    rows[:, 0] = float(vals[-1])  # block amax = the largest value: scale 1
    body = torch.zeros(n_blocks * per)
    body[: len(t)] = t
    rows[:, 1:] = body.view(n_blocks, per)
    return rows.to(dtype)
