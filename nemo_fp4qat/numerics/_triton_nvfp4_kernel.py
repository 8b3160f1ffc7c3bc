"""The Triton kernel behind :mod:`nemo_fp4qat.numerics.triton_nvfp4` (imported only when it is first used).

IEEE float32 arithmetic and integer bit operations only: no bf16 / fp8 float casts, round-to-nearest
division, negation by the sign bit, and no multiply whose result is then added (other than exact
power-of-two scalings), so FMA contraction cannot change a result.

One pass per tensor in its own dtype: the elements are read as float32 / bfloat16 / float16 and written back in
the same dtype, so no float32 copy of the tensor exists outside the registers. bfloat16 travels as its 16 bits
(``int16``) and is widened and rounded (to nearest, ties to even, as torch's cast) by bit operations: triton's
interpreter, on which the kernel is tested, truncates a float32 -> bfloat16 cast where the GPU rounds.
"""

import triton
import triton.language as tl

# element dtypes (the ``DTYPE`` constant): float32, bfloat16 as its int16 bits, float16
F32: tl.constexpr = 0
BF16_BITS: tl.constexpr = 1
F16: tl.constexpr = 2


@triton.jit
def _pow2(k):
    # exact 2**k as float32 for normal k, from the bit pattern
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_minifloat(a, M: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr):
    # Round non-negative, non-NaN float32 ``a`` to the minifloat with M mantissa bits and minimum normal
    # exponent EMIN: nearest, ties to even, saturating at FMAX. ``a`` is scaled into [0, 2**(M+1)) by an exact
    # power of two, rounded by integer truncation and the exact remainder, and scaled back.
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.minimum(tl.maximum(e, EMIN), 120)
    shift = e - M
    r = a * _pow2(-shift)
    r = tl.where(r < 16777216.0, r, 0.0)  # reached only for a >= FMAX (replaced below); keeps the cast defined
    t = r.to(tl.int32)
    frac = r - t.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((t & 1) == 1))
    q = (t + up.to(tl.int32)).to(tl.float32) * _pow2(shift)
    return tl.where(a >= FMAX, FMAX, q)


@triton.jit
def _widen(raw, DTYPE: tl.constexpr):
    # the loaded elements as float32 (exact for every input dtype)
    if DTYPE == BF16_BITS:
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return raw.to(tl.float32)


@triton.jit
def _narrow(y, DTYPE: tl.constexpr):
    # float32 results in the stored dtype, rounded to nearest, ties to even (NaN stays a quiet NaN)
    if DTYPE == BF16_BITS:
        u = y.to(tl.int32, bitcast=True)
        rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16) & 0xFFFF
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        return tl.where(nan, 0x7FC0, rounded).to(tl.int16)
    elif DTYPE == F16:
        return y.to(tl.float16)
    else:
        return y


@triton.jit
def nvfp4_fake_quant_kernel(
    x_ptr, y_ptr, amax_ptr, n_cols, blocks_per_row, nblk, BLOCK: tl.constexpr, BPP: tl.constexpr,
    DTYPE: tl.constexpr,
):  # fmt: skip
    """``y = NVFP4(x)`` for a contiguous ``(rows, n_cols)`` tensor, blocks of ``BLOCK`` along each row (a partial
    last block of a row reads zeros past its end); ``BPP`` blocks per program, ``nblk`` blocks in all."""
    pid = tl.program_id(0)
    blk = pid * BPP + tl.arange(0, BPP)
    row = blk // blocks_per_row
    col = (blk % blocks_per_row) * BLOCK
    cols = col[:, None] + tl.arange(0, BLOCK)[None, :]
    offs = row.to(tl.int64)[:, None] * n_cols + cols
    mask = (blk[:, None] < nblk) & (cols < n_cols)
    x = _widen(tl.load(x_ptr + offs, mask=mask, other=0), DTYPE)
    amax = tl.load(amax_ptr).to(tl.float32)
    gs = tl.math.div_rn(amax, 2688.0)  # amax / (6 * 448)
    valid = (gs > 0.0) & (gs < float("inf"))
    gs_safe = tl.where(valid, gs, 1.0)
    a = tl.abs(x)
    a = tl.where(a == a, a, 0.0)  # a NaN element neither sets the block amax nor reaches the rounding
    bmax = tl.max(a, axis=1)
    ratio = tl.math.div_rn(bmax, 6.0 * gs_safe)
    ratio = tl.where(ratio <= 448.0, ratio, 448.0)
    s = _round_minifloat(ratio, 3, -6, 448.0) * gs_safe  # E4M3 block scale times the per-tensor scale
    s = tl.where(valid, s, 1.0)
    s = tl.where(s < 1e-5, 1.0, s)
    s2 = s[:, None]
    q = _round_minifloat(tl.math.div_rn(a, s2), 1, 0, 6.0) * s2
    # negation by the sign bit: triton's unary minus is 0 - q, which gives +0 for q = 0
    neg_q = (q.to(tl.int32, bitcast=True) | -2147483648).to(tl.float32, bitcast=True)
    y = tl.where(x < 0.0, neg_q, q)
    y = tl.where(x == x, y, x)
    tl.store(y_ptr + offs, _narrow(y, DTYPE), mask=mask)
