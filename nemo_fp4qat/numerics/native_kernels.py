"""Native (C, OpenMP) versions of the CPU fake-quant kernels, compiled on first use.

The pure-PyTorch kernels in :mod:`nemo_fp4qat.numerics.fake_quant` make ~15 passes over memory; this C
version makes one, which is what makes CPU QAT usable. Written by hand because no library ships
CPU NVFP4/MX fake quantization; it is plain C with no PyTorch headers, so it builds in well under a
second with the system C compiler and is loaded with ``ctypes``. It computes exactly what the
PyTorch path computes (IEEE float32, round-half-to-even, no FMA contraction), which the tests check.

If no compiler is available or the build fails, everything falls back to the PyTorch path.
``NEMO_FP4QAT_NATIVE=0`` disables it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["native_available", "native_mx", "native_nvfp4", "use_vector_path", "vector_path"]

log = logging.getLogger("nemo_fp4qat")

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline int32_t f2i(float f) { int32_t i; memcpy(&i, &f, 4); return i; }
static inline float i2f(int32_t i) { float f; memcpy(&f, &i, 4); return f; }
/* exact 2**k for normal k; callers keep k in [-126, 127] */
static inline float pow2i(int32_t k) { return i2f((k + 127) << 23); }

/* Round non-negative a (not NaN) to a minifloat with m mantissa bits, min normal exponent emin,
   largest value fmax: nearest, ties to even. Scale a into [0, 2**(m+1)) by an exact power of two,
   round with the 1.5*2**23 trick (round-half-to-even in the default FP mode), scale back. */
static inline float round_minifloat(float a, int32_t m, int32_t emin, float fmax) {
    int32_t e = ((f2i(a) >> 23) & 0xFF) - 127;
    e = e < emin ? emin : e;
    e = e > 120 ? 120 : e;              /* only reached for a >= fmax, whose result is discarded */
    int32_t shift = e - m;
    float r = a * pow2i(-shift);
    r = (r + 12582912.0f) - 12582912.0f;
    r = r * pow2i(shift);
    return (a >= fmax) ? fmax : r;
}

static inline float block_amax(const float* x, int64_t len) {
    float bmax = 0.f;
    #pragma omp simd reduction(max:bmax)
    for (int64_t i = 0; i < len; ++i) { float a = fabsf(x[i]); bmax = (a > bmax) ? a : bmax; } /* NaN ignored */
    return bmax;
}

static inline void nvfp4_elements(const float* xs, float* ys, int64_t len, float s) {
    #pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
        float v = xs[i];
        float q = round_minifloat(fabsf(v) / s, 1, 0, 6.f) * s;
        float o = (v >= 0.f) ? q : -q;
        ys[i] = (v != v) ? v : o;
    }
}

static inline float nvfp4_scale(float bmax, float gs, int gs_valid) {
    float s = 1.f;
    if (gs_valid) {
        float ratio = bmax / (6.0f * gs);
        if (!(ratio <= 448.f)) ratio = 448.f;
        s = round_minifloat(ratio, 3, -6, 448.f) * gs;
    }
    return (s < 1e-5f) ? 1.f : s;
}

static inline void nvfp4_block(const float* xs, float* ys, int64_t len, float gs, int gs_valid) {
    nvfp4_elements(xs, ys, len, nvfp4_scale(block_amax(xs, len), gs, gs_valid));
}

/* NVFP4's usual case, rows of whole 16-element blocks, as one run of blocks in chunks of 64: first their
   amaxes (constant trip count, unrolled), then their scales in one loop over blocks (which the compiler
   vectorizes: 8 blocks per instruction instead of a scalar dependency chain per block), then the
   elements. 2.2x faster than block by block, bit-identical (same operations, same order per value). */
#define CHUNK 64
static void nvfp4_run16(const float* x, float* y, int64_t nblk, float gs, int gs_valid) {
    float bm[CHUNK], sc[CHUNK];
    for (int64_t c0 = 0; c0 < nblk; c0 += CHUNK) {
        int64_t m = (nblk - c0 < CHUNK) ? (nblk - c0) : CHUNK;
        const float* xc = x + c0 * 16;
        float* yc = y + c0 * 16;
        for (int64_t k = 0; k < m; ++k) bm[k] = block_amax(xc + k * 16, 16);
        #pragma omp simd
        for (int64_t k = 0; k < m; ++k) sc[k] = nvfp4_scale(bm[k], gs, gs_valid);
        for (int64_t k = 0; k < m; ++k) nvfp4_elements(xc + k * 16, yc + k * 16, 16, sc[k]);
    }
}

/* exponent of the E8M0 unscale 2**ceil(log2(bmax / fmax)) (no rounding up for exact powers of two); 0 for a
   zero or infinite block amax */
static inline int32_t mx_unscale_exponent(float bmax, float fmax) {
    if (bmax == 0.f || isinf(bmax)) return 0;
    int32_t bits = f2i(bmax / fmax);
    int32_t ef = (bits >> 23) & 0xFF, sig = bits & 0x7FFFFF;
    int up = sig > 0 && ef != 0xFE && !(ef == 0 && sig <= 0x400000);
    return up ? ef - 126 : ef - 127;
}

static inline void mx_block(const float* xs, float* ys, int64_t len, int mbits, int emin, float fmax) {
    int32_t ue = mx_unscale_exponent(block_amax(xs, len), fmax);
    float scale = ldexpf(1.f, -ue), unscale = ldexpf(1.f, ue);
    #pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
        float v = xs[i];
        float q = round_minifloat(fabsf(v) * scale, mbits, emin, fmax) * unscale;
        float o = (v < 0.f) ? -q : q;
        ys[i] = (v != v) ? v : o;
    }
}

/* ---- AVX2 versions of the two hot loops (NVFP4 rows of 16-element blocks; MX rows of whole blocks of a
   multiple of 8 elements). Intrinsics, not auto-vectorisation: the block max needs a transposed
   horizontal reduction and the per-element rounding the same integer exponent arithmetic as
   round_minifloat, which gcc does not vectorise across blocks on its own. They do the same float32
   operations per value in the same order as the scalar code above (which stays the reference and the
   fallback), so results are bit-identical; the AVX2 code is compiled for that ISA only and chosen at
   run time when the CPU has it. ---- */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#define AVX2 __attribute__((target("avx2")))

/* round_minifloat on 8 lanes in float operations only. p = max(2**e, 2**emin) is the binade read off the
   exponent bits (and_ps); adding big = 1.5 * 2**(23 - m) * p rounds a to a multiple of p * 2**-m with ties to
   even (big's ulp is that quantum), and subtracting it back is exact: the same value round_minifloat's
   exact scale-round-unscale gives. Saturation is min_ps(r, fmax): r <= fmax whenever a < fmax (fmax is
   representable), and where big overflows (a >= 2**105, or a = Inf) r is NaN, which min_ps also maps to fmax
   (it returns its second operand when one is NaN); a NaN a gives fmax too, which callers replace by the input. */
AVX2 static inline __m256 v_round_minifloat(__m256 a, int32_t m, int32_t emin, float fmax) {
    __m256 p = _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7F800000)));
    p = _mm256_max_ps(p, _mm256_set1_ps(pow2i(emin)));
    __m256 big = _mm256_mul_ps(p, _mm256_set1_ps(1.5f * pow2i(23 - m)));
    __m256 r = _mm256_sub_ps(_mm256_add_ps(a, big), big);
    return _mm256_min_ps(r, _mm256_set1_ps(fmax));
}

/* |v| with NaN lanes read as 0 by the max that follows: max_ps(a, b) is (a > b) ? a : b, as block_amax. */
AVX2 static inline __m256 v_abs(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

/* The 8 lane maxima of m[0..7] as one vector (lane k = max of m[k]); inputs are never NaN. */
AVX2 static inline __m256 v_hmax8(const __m256* m) {
    __m256 a01 = _mm256_max_ps(_mm256_unpacklo_ps(m[0], m[1]), _mm256_unpackhi_ps(m[0], m[1]));
    __m256 a23 = _mm256_max_ps(_mm256_unpacklo_ps(m[2], m[3]), _mm256_unpackhi_ps(m[2], m[3]));
    __m256 a45 = _mm256_max_ps(_mm256_unpacklo_ps(m[4], m[5]), _mm256_unpackhi_ps(m[4], m[5]));
    __m256 a67 = _mm256_max_ps(_mm256_unpacklo_ps(m[6], m[7]), _mm256_unpackhi_ps(m[6], m[7]));
    __m256 q03 = _mm256_max_ps(_mm256_shuffle_ps(a01, a23, 0x44), _mm256_shuffle_ps(a01, a23, 0xEE));
    __m256 q47 = _mm256_max_ps(_mm256_shuffle_ps(a45, a67, 0x44), _mm256_shuffle_ps(a45, a67, 0xEE));
    return _mm256_max_ps(_mm256_permute2f128_ps(q03, q47, 0x20), _mm256_permute2f128_ps(q03, q47, 0x31));
}

AVX2 static inline float v_hmax1(__m256 m) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}

/* NVFP4 elements of one 8-lane vector with block scale s: as nvfp4_elements. */
AVX2 static inline __m256 v_nvfp4(__m256 v, __m256 s) {
    __m256 q = _mm256_mul_ps(v_round_minifloat(_mm256_div_ps(v_abs(v), s), 1, 0, 6.f), s);
    __m256 o = _mm256_blendv_ps(_mm256_xor_ps(q, _mm256_set1_ps(-0.f)), q,
                                _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ));
    return _mm256_blendv_ps(o, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

/* nvfp4_run16 eight blocks at a time: their amaxes, then their eight scales as one vector (the same
   float32 operations as nvfp4_scale), then the elements. Blocks left over (fewer than 8) go scalar. */
AVX2 static void nvfp4_run16_avx2(const float* x, float* y, int64_t nblk, float gs, int gs_valid) {
    const __m256 zero = _mm256_setzero_ps();
    int64_t k0 = 0;
    for (; k0 + 8 <= nblk; k0 += 8) {
        const float* xc = x + k0 * 16;
        float* yc = y + k0 * 16;
        __m256 m[8];
        for (int k = 0; k < 8; ++k) {
            __m256 a = _mm256_max_ps(v_abs(_mm256_loadu_ps(xc + 16 * k)), zero);
            m[k] = _mm256_max_ps(v_abs(_mm256_loadu_ps(xc + 16 * k + 8)), a);
        }
        __m256 bmax = v_hmax8(m), s;
        if (gs_valid) {
            /* nvfp4_scale's clamp of ratio to 448 is v_round_minifloat's own saturation here */
            __m256 ratio = _mm256_div_ps(bmax, _mm256_set1_ps(6.0f * gs));
            s = _mm256_mul_ps(v_round_minifloat(ratio, 3, -6, 448.f), _mm256_set1_ps(gs));
        } else {
            s = _mm256_set1_ps(1.f);
        }
        s = _mm256_blendv_ps(s, _mm256_set1_ps(1.f), _mm256_cmp_ps(s, _mm256_set1_ps(1e-5f), _CMP_LT_OQ));
        float sc[8];
        _mm256_storeu_ps(sc, s);
        for (int k = 0; k < 8; ++k) {
            __m256 sk = _mm256_set1_ps(sc[k]);
            __m256 v0 = _mm256_loadu_ps(xc + 16 * k), v1 = _mm256_loadu_ps(xc + 16 * k + 8);
            _mm256_storeu_ps(yc + 16 * k, v_nvfp4(v0, sk));
            _mm256_storeu_ps(yc + 16 * k + 8, v_nvfp4(v1, sk));
        }
    }
    if (k0 < nblk) nvfp4_run16(x + k0 * 16, y + k0 * 16, nblk - k0, gs, gs_valid);
}

/* mx_block for a block of a multiple of 8 elements. */
AVX2 static void mx_block_avx2(const float* xs, float* ys, int64_t len, int mbits, int emin, float fmax) {
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < len; i += 8) m = _mm256_max_ps(v_abs(_mm256_loadu_ps(xs + i)), m);
    int32_t ue = mx_unscale_exponent(v_hmax1(m), fmax);
    __m256 scale = _mm256_set1_ps(ldexpf(1.f, -ue)), unscale = _mm256_set1_ps(ldexpf(1.f, ue));
    for (int64_t i = 0; i < len; i += 8) {
        __m256 v = _mm256_loadu_ps(xs + i);
        __m256 q = _mm256_mul_ps(v_round_minifloat(_mm256_mul_ps(v_abs(v), scale), mbits, emin, fmax), unscale);
        __m256 o = _mm256_blendv_ps(q, _mm256_xor_ps(q, _mm256_set1_ps(-0.f)),
                                    _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
        _mm256_storeu_ps(ys + i, _mm256_blendv_ps(o, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    }
}
#endif

/* 1 when the AVX2 path exists in this build and the CPU runs it. */
int vector_path_available(void) {
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

/* Rows of whole blocks (the usual case) are one run of blocks: block t starts at t * block, so no
   per-block 64-bit integer division (about 12% of the time of a 16-element block). */
#define FOR_EACH_BLOCK(CALL)                                                                   \
    int64_t nb = (n + block - 1) / block;                                                      \
    if (n % block == 0) {                                                                      \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                     \
        for (int64_t t = 0; t < rows * nb; ++t) {                                              \
            const float* xs = x + t * block; float* ys = y + t * block; int64_t len = block;   \
            CALL;                                                                              \
        }                                                                                      \
    } else {                                                                                   \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                     \
        for (int64_t r = 0; r < rows; ++r)                                                     \
            for (int64_t b0 = 0; b0 < n; b0 += block) {                                        \
                const float* xs = x + r * n + b0; float* ys = y + r * n + b0;                  \
                int64_t len = (n - b0 < block) ? (n - b0) : block;                             \
                CALL;                                                                          \
            }                                                                                  \
    }

/* x and y may be the same buffer (in place): every block is read whole before it is written.
   vector: 1 uses the AVX2 path where vector_path_available(), 0 the scalar reference. */
void nvfp4_fake_quant(const float* x, float* y, int64_t rows, int64_t n, int64_t block,
                      float gs, int gs_valid, int nthreads, int vector) {
    if (block == 16 && n % 16 == 0) {
        int64_t nblk = rows * (n / 16), per = (nblk + nthreads - 1) / nthreads;
        per = (per + 7) / 8 * 8;  /* whole chunks of 8 blocks per thread */
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int t = 0; t < nthreads; ++t) {
            int64_t b0 = t * per, b1 = (b0 + per < nblk) ? (b0 + per) : nblk;
            if (b0 >= b1) continue;
#ifdef HAVE_AVX2_PATH
            if (vector) { nvfp4_run16_avx2(x + b0 * 16, y + b0 * 16, b1 - b0, gs, gs_valid); continue; }
#endif
            nvfp4_run16(x + b0 * 16, y + b0 * 16, b1 - b0, gs, gs_valid);
        }
        return;
    }
    FOR_EACH_BLOCK(nvfp4_block(xs, ys, len, gs, gs_valid))
}

void mx_fake_quant(const float* x, float* y, int64_t rows, int64_t n, int64_t block,
                   int mbits, int emin, float fmax, int nthreads, int vector) {
#ifdef HAVE_AVX2_PATH
    if (vector && block % 8 == 0 && n % block == 0) {
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")
        for (int64_t t = 0; t < rows * (n / block); ++t)
            mx_block_avx2(x + t * block, y + t * block, block, mbits, emin, fmax);
        return;
    }
#endif
    FOR_EACH_BLOCK(mx_block(xs, ys, len, mbits, emin, fmax))
}
"""

# IEEE float32 as written: no FMA contraction, no fast-math reassociation. -fno-trapping-math only lets gcc
# if-convert the element loops (it refuses while FP exceptions are observable), which vectorizes them: 3-4x
# faster per element, bit-identical results (FP exception flags are never read here).
_CFLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-fno-fast-math",
           "-fno-trapping-math")  # fmt: skip

_LIB: ctypes.CDLL | None = None
_TRIED = False


def _cache_dir() -> Path:
    base = os.environ.get("NEMO_FP4QAT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nemo_fp4qat")
    return Path(base)


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("nemo_fp4qat: no C compiler found; using the PyTorch CPU kernels")
        return None
    digest = hashlib.sha256((_SOURCE + " ".join(_CFLAGS)).encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    lib_path = out_dir / f"fakequant_{digest}.so"
    if not lib_path.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "fakequant.c"
            src.write_text(_SOURCE)
            tmp_so = Path(tmp) / "fakequant.so"
            cmd = [cc, *_CFLAGS, str(src), "-o", str(tmp_so), "-lm"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                log.warning("nemo_fp4qat: native kernel build failed (%s); using PyTorch kernels", proc.stderr[-500:])
                return None
            os.replace(tmp_so, lib_path)  # atomic: concurrent builders never see a partial file
    lib = ctypes.CDLL(str(lib_path))
    i64, f32, i32, vp = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
    lib.nvfp4_fake_quant.argtypes = [vp, vp, i64, i64, i64, f32, i32, i32, i32]
    lib.mx_fake_quant.argtypes = [vp, vp, i64, i64, i64, i32, i32, f32, i32, i32]
    lib.vector_path_available.restype = i32
    return lib


def _lib() -> ctypes.CDLL | None:
    global _LIB, _TRIED
    if not _TRIED:
        _TRIED = True
        if os.environ.get("NEMO_FP4QAT_NATIVE", "1") != "0":
            try:
                _LIB = _build()
            except OSError as e:  # pragma: no cover - unusual platforms
                log.warning("nemo_fp4qat: native kernels unavailable (%s)", e)
                _LIB = None
    return _LIB


def native_available() -> bool:
    return _lib() is not None


@functools.lru_cache(maxsize=1)
def _cpu_has_vector_path() -> bool:
    lib = _lib()
    return lib is not None and bool(lib.vector_path_available())


def vector_path() -> str | None:
    """The vectorised kernel path this CPU runs (``"avx2"``), or ``None`` (the scalar path is used)."""
    return "avx2" if _VECTOR_ENABLED and _cpu_has_vector_path() else None


_VECTOR_ENABLED = os.environ.get("NEMO_FP4QAT_NATIVE_VECTOR", "1") != "0"


@contextlib.contextmanager
def use_vector_path(enabled: bool) -> Iterator[None]:
    """Allow (default) or forbid the vectorised path inside the block; forbidding it runs the scalar reference."""
    global _VECTOR_ENABLED
    old, _VECTOR_ENABLED = _VECTOR_ENABLED, enabled
    try:
        yield
    finally:
        _VECTOR_ENABLED = old


def _rows_cols(x: torch.Tensor) -> tuple[int, int]:
    n = x.shape[-1] if x.dim() else 1
    return (x.numel() // n if n else 0), n


def _output(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    assert x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu"
    if out is None:
        return torch.empty_like(x)
    if out.dtype != torch.float32 or not out.is_contiguous() or out.device.type != "cpu" or out.shape != x.shape:
        raise ValueError(
            f"out must be a contiguous float32 CPU tensor of x's shape {tuple(x.shape)}; got {out.dtype} "
            f"{tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()}). Pass out=None to allocate."
        )
    return out


def native_nvfp4(
    x: torch.Tensor, gs: float, gs_valid: bool, block: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """NVFP4 fake quant of a contiguous float32 CPU tensor (``gs`` = amax / (6*448) in float32).

    ``out`` (a contiguous float32 tensor of ``x``'s shape, ``x`` itself included) receives the result
    without an allocation; otherwise a new tensor is returned.
    """
    lib = _lib()
    assert lib is not None
    y = _output(x, out)
    rows, n = _rows_cols(x)
    vec = int(vector_path() is not None)
    lib.nvfp4_fake_quant(x.data_ptr(), y.data_ptr(), rows, n, block, gs, int(gs_valid), torch.get_num_threads(), vec)
    return y


def native_mx(
    x: torch.Tensor, mbits: int, emin: int, fmax: float, block: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """MX fake quant (E8M0 block scale) of a contiguous float32 CPU tensor; ``out`` as for :func:`native_nvfp4`."""
    lib = _lib()
    assert lib is not None
    y = _output(x, out)
    rows, n = _rows_cols(x)
    vec = int(vector_path() is not None)
    lib.mx_fake_quant(x.data_ptr(), y.data_ptr(), rows, n, block, mbits, emin, fmax, torch.get_num_threads(), vec)
    return y
