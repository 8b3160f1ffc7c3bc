"""The pure-PyTorch fake quant's edges, each against an independent reference (numpy's float32 powers of two,
the float64 references, and the C kernel bit for bit): exact powers of two down to the subnormals, the
E8M0 scale rule at every binade edge, 0-d/1-d/3-d inputs, a block whose max is exactly 1, a dynamic amax,
the 1e-5 block-scale floor, signed zeros, and the dispatch between the two kernels."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nemo_fp4qat.numerics import fake_quant as cfq
from nemo_fp4qat.numerics import native_kernels

from reference_numerics import e8m0_exponent_ref, mx_ref, nvfp4_ref

pytestmark = pytest.mark.twice("the CPU backend installs over modelopt 0.37's quantizer functions (not 0.47's)")

ELEMENTS = [(2, 1), (2, 3), (3, 2), (4, 3)]
IMPLS = [False, True] if native_kernels.native_available() else [False]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().contiguous().view(torch.int32).numpy()


def test_pow2_is_exact_from_the_smallest_subnormal_to_the_largest_power():
    exps = torch.arange(-149, 128)  # int64, as a caller may pass: the helper converts
    ref = np.ldexp(np.float32(1.0), exps.numpy()).astype(np.float32)
    assert np.array_equal(cfq._pow2(exps).numpy().view(np.int32), ref.view(np.int32))
    assert np.array_equal(cfq._pow2(exps.to(torch.int32)).numpy().view(np.int32), ref.view(np.int32))


def test_e8m0_scale_exponent_at_every_binade_edge():
    """Powers of two and their float32 neighbours, subnormal ratios included (2**-127 itself does not round
    up, one ulp above it does) and the top binade (no round-up past 2**127)."""
    k = np.arange(-149, 128)
    p = np.ldexp(np.float32(1.0), k).astype(np.float32)
    probes = np.concatenate([p, np.nextafter(p, np.float32(np.inf)), np.nextafter(p, np.float32(0)),
                             np.float32([0.0, 3.0e38, 3.4028235e38])]).astype(np.float32)  # fmt: skip
    probes = probes[np.isfinite(probes)]
    for elem_max in (1.0, 6.0, 7.5, 28.0, 448.0):
        got = cfq._e8m0_unscale_exponent(torch.from_numpy(probes), elem_max).numpy()
        assert np.array_equal(got, e8m0_exponent_ref(probes, elem_max)), elem_max


@pytest.mark.parametrize("native", IMPLS, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("shape", [(), (40,), (2, 3, 40)], ids=["0-d", "1-d", "3-d"])
def test_any_rank_quantizes_in_blocks_along_the_last_dimension(native, shape):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=g) * 3
    flat = x.reshape(-1, x.shape[-1] if x.dim() else 1).numpy()
    amax = float(x.abs().max()) * 1.5
    with cfq.use_native(native):
        y = cfq.fake_quant_nvfp4(x, torch.tensor(amax), 16)
        assert y.shape == x.shape
        assert np.array_equal(y.reshape(flat.shape).numpy(), nvfp4_ref(flat, amax, 16))
        for element in ELEMENTS:
            y = cfq.fake_quant_mx(x, element)  # the default block is MX's 32
            assert y.shape == x.shape
            assert np.array_equal(y.reshape(flat.shape).numpy(), mx_ref(flat, element, 32)), element


@pytest.mark.parametrize("native", IMPLS, ids=lambda n: "native" if n else "torch")
def test_a_block_whose_max_is_exactly_one_gets_its_own_scale(native):
    x = torch.tensor([[1.0, 0.3, -0.7, 0.05] * 8, [0.3, 1.0, -1.0, 0.2] * 8])
    with cfq.use_native(native):
        for element in ELEMENTS:
            assert np.array_equal(cfq.fake_quant_mx(x, element, 32).numpy(), mx_ref(x.numpy(), element, 32))


@pytest.mark.parametrize("native", IMPLS, ids=lambda n: "native" if n else "torch")
def test_a_nan_in_a_block_of_small_values_does_not_set_its_scale(native):
    x = torch.full((1, 32), 0.01)
    x[0, 3], x[0, 9] = float("nan"), -0.02
    with cfq.use_native(native):
        y = cfq.fake_quant_nvfp4(x, torch.tensor(0.02), 16)
        assert np.array_equal(y.numpy(), nvfp4_ref(x.numpy(), 0.02, 16), equal_nan=True)
        for element in ELEMENTS:
            assert np.array_equal(cfq.fake_quant_mx(x, element).numpy(), mx_ref(x.numpy(), element, 32),
                                  equal_nan=True)  # fmt: skip


@pytest.mark.parametrize("native", IMPLS, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("shape", [(3, 5, 7), (1, 16), (33,)])
def test_without_an_amax_the_tensor_sets_its_own(native, shape):
    """``amax=None``: the per-tensor amax is the tensor's max magnitude (NaN ignored), any shape."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[-1])
    x.view(-1)[1] = float("nan")
    amax = float(np.nanmax(np.abs(x.numpy())))
    flat = x.reshape(-1, shape[-1]).numpy()
    with cfq.use_native(native):
        y = cfq.fake_quant_nvfp4(x, None, 16)
    assert np.array_equal(y.reshape(flat.shape).numpy(), nvfp4_ref(flat, amax, 16), equal_nan=True)


@pytest.mark.parametrize("native", IMPLS, ids=lambda n: "native" if n else "torch")
def test_a_block_scale_of_exactly_1e5_is_kept_and_one_below_becomes_1(native):
    """The CUDA kernel's floor is ``scale < 1e-5`` (float32): a block scale equal to float32(1e-5) is used."""
    gs = float(np.float32(1e-5))
    block = torch.tensor([6.0, 3.0, -2.0, 1.0] * 4) * gs  # E2M1 values times the block scale gs (E4M3 code 1)
    with cfq.use_native(native):
        y = cfq.fake_quant_nvfp4(block.reshape(1, 16), None, 16, global_scale=gs)
        assert torch.equal(y.reshape(16), block)
        below = float(np.nextafter(np.float32(gs), np.float32(0)))
        y = cfq.fake_quant_nvfp4(block.reshape(1, 16), None, 16, global_scale=below)
        assert torch.count_nonzero(y) == 0  # scale 1: every element rounds to 0


def test_both_kernels_agree_bit_for_bit_signed_zeros_and_specials_included():
    if not native_kernels.native_available():
        pytest.skip("no C compiler: native kernels unavailable")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 96, generator=g) * torch.logspace(-40, 30, 96, base=2.0)
    x[0, :16] = 0.0
    x[1, :16] = -0.0
    x[2, 5], x[3, 7], x[4, 40], x[5, 0] = float("nan"), float("inf"), -float("inf"), 1e-42
    x[5, 33:40] = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.0, 0.0, 4.0])
    outs = {}
    for native in (False, True):
        with cfq.use_native(native):
            outs[native] = [cfq.fake_quant_nvfp4(x, torch.tensor(30.0), 16)] + [
                cfq.fake_quant_mx(x, e, 32) for e in ELEMENTS
            ]
    for a, b in zip(outs[False], outs[True], strict=True):
        assert np.array_equal(_bits(a), _bits(b))
    assert (_bits(outs[False][0][0, :16]) == 0).all()  # +0.0 stays +0.0, not -0.0


def test_the_c_kernel_takes_every_non_empty_float_cpu_tensor_and_nothing_else():
    if not native_kernels.native_available():
        pytest.skip("no C compiler: native kernels unavailable")
    with cfq.use_native(True):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert cfq._native_ok(torch.ones(1, dtype=dtype))
        assert not cfq._native_ok(torch.ones(3, dtype=torch.float64))
        assert not cfq._native_ok(torch.ones(3, dtype=torch.int32))
        assert not cfq._native_ok(torch.ones(0))
        assert not cfq._native_ok(torch.ones(3, device="meta"))
    with cfq.use_native(False):
        assert not cfq._native_ok(torch.ones(3))


def test_float32_rounding_of_python_floats_overflows_to_signed_infinity():
    assert cfq._to_f32(1e39) == math.inf and cfq._to_f32(-1e39) == -math.inf
    assert cfq._to_f32(0.1) == float(np.float32(0.1)) and cfq._to_f32(-2.5) == -2.5


def test_formats_without_a_cpu_kernel_are_named_in_the_error():
    x = torch.ones(2, 32)
    with pytest.raises(ValueError, match=r"^No CPU rounding for element format E5M2$"):
        cfq.round_to_minifloat(x, (5, 2))
    with pytest.raises(ValueError, match=r"^MX element format E5M2 has no CPU fake quant; on a CPU use one of: "
                                         r"NVFP4 \(E2M1, E4M3 scales\), MXFP4"):  # fmt: skip
        cfq.fake_quant_mx(x, (5, 2))


@pytest.mark.parametrize("native", IMPLS, ids=lambda n: "native" if n else "torch")
def test_the_block_dispatch_passes_the_quantizers_block_size(native):
    """modelopt's op passes the block size it was configured with: NVFP4 at 8 and MX at 16 are not the defaults."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 48, generator=g) * torch.logspace(-2, 2, 48)
    amax = torch.tensor(float(x.abs().max()))
    with cfq.use_native(native):
        y = cfq.fake_quant_block(x, 8, amax, (2, 1), (4, 3))
        assert np.array_equal(y.numpy(), nvfp4_ref(x.numpy(), float(amax), 8))
        y = cfq.fake_quant_block(x, 16, None, (2, 3), (8, 0))
        assert np.array_equal(y.numpy(), mx_ref(x.numpy(), (2, 3), 16))


def test_a_block_format_without_a_kernel_is_named_exactly():
    message = (r"^No CPU fake quant for elements E3M2 with scale E4M3; on a CPU use one of: "
               r"NVFP4 \(E2M1, E4M3 scales\), MXFP4 .*; or run on a GPU\.$")  # fmt: skip
    with pytest.raises(NotImplementedError, match=message):
        cfq.fake_quant_block(torch.ones(2, 16), 16, None, (3, 2), (4, 3))


def _fp8_ref(x: torch.Tensor, scale: float) -> np.ndarray:
    """E4M3 of x / scale (float32 division), saturated at 448, times scale: float64 rounding on the E4M3 grid."""
    from reference_numerics import round_ref

    v = (x.float() / torch.tensor(scale, dtype=torch.float32)).numpy().astype(np.float64)
    q = np.sign(v) * np.minimum(round_ref(np.abs(v), 4, 3), 448.0)
    return (q.astype(np.float32) * np.float32(scale)).astype(np.float32)


def test_fp8_uses_a_float32_scale_of_amax_over_448_whatever_the_amax_dtype_and_keeps_the_input_dtype():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 24, generator=g) * 3
    amax = torch.tensor(5.3)
    scale = float(torch.tensor(5.3, dtype=torch.float32) / 448.0)
    ref = _fp8_ref(x, scale)
    assert np.array_equal(cfq.fake_quant_fp8(x, amax).numpy(), ref)
    low = amax.bfloat16()  # a bfloat16 amax: its value, divided in float32 (not rounded to bfloat16 again)
    low_scale = float(low.float() / 448.0)
    assert np.array_equal(cfq.fake_quant_fp8(x, low).numpy(), _fp8_ref(x, low_scale))
    half = cfq.fake_quant_fp8(x.bfloat16(), amax)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, torch.from_numpy(_fp8_ref(x.bfloat16(), scale)).bfloat16())
    over = torch.tensor([[-100.0, 100.0, 5.3, -5.3]])  # beyond the amax: saturates at +-amax
    assert torch.equal(cfq.fake_quant_fp8(over, amax), torch.tensor([[-1.0, 1.0, 1.0, -1.0]]) * scale * 448.0)


def test_fp8_amax_at_or_below_2_to_the_minus_24_counts_as_1_as_modelopt_does():
    x = torch.randn(2, 16) * 0.01
    one = cfq.fake_quant_fp8(x, torch.tensor(1.0))
    assert torch.equal(cfq.fake_quant_fp8(x, torch.tensor(2.0**-24)), one)
    assert torch.equal(cfq.fake_quant_fp8(x, torch.tensor(0.0)), one)
    above = float(np.nextafter(np.float32(2.0**-24), np.float32(1)))
    assert not torch.equal(cfq.fake_quant_fp8(x, torch.tensor(above)), one)


def test_fp8_without_amax_or_scale_says_what_it_needs():
    with pytest.raises(ValueError, match=r"^fake_quant_fp8 needs amax \(training\) or scale \(an exported scale\)\.$"):
        cfq.fake_quant_fp8(torch.ones(2))
