"""CPU fake quant vs independent references: float64 rounding, modelopt's own NVFP4QTensor."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from nemo_fp4qat.numerics import fake_quant as cfq
from nemo_fp4qat.numerics import native_kernels
from nemo_fp4qat.numerics.cpu_shims import modelopt_export_on_cpu

from reference_numerics import e8m0_exponent_ref, minifloat_values, mx_ref, nvfp4_ref, round_ref, tie_blocks

pytestmark = pytest.mark.twice("the CPU backend installs over modelopt 0.37's quantizer functions (not 0.47's)")

ELEMENTS = [(2, 1), (2, 3), (3, 2), (4, 3)]


@pytest.fixture(params=["native", "torch"], autouse=True)
def impl(request):
    """Every test runs against both kernels: the compiled C one and the pure-PyTorch one."""
    if request.param == "native" and not native_kernels.native_available():
        pytest.skip("no C compiler: native kernels unavailable")
    with cfq.use_native(request.param == "native"):
        yield request.param


def test_native_kernels_build_where_a_compiler_exists():
    if shutil.which("cc") or shutil.which("gcc"):
        assert native_kernels.native_available()


def _same(a: torch.Tensor, b: np.ndarray) -> bool:
    return np.array_equal(a.numpy().astype(np.float64), np.asarray(b, np.float64), equal_nan=True)


@pytest.mark.parametrize("element", ELEMENTS)
def test_rounding_every_value_and_every_midpoint(element):
    vals = minifloat_values(*element)
    mids = (vals[:-1] + vals[1:]) / 2  # exact ties
    probes = np.concatenate([vals, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf)])
    probes = np.concatenate([probes, [vals[-1] * 1.5, np.inf, np.nan, 1e-30, 0.0]]).astype(np.float32)
    got = cfq.round_to_minifloat(torch.from_numpy(probes), element)
    assert _same(got, round_ref(probes.astype(np.float64), *element))


@pytest.mark.parametrize("element", ELEMENTS)
@settings(max_examples=40, deadline=None)
@given(v=arrays(np.float32, st.integers(1, 300), elements=st.floats(0, 1e4, width=32)))
def test_rounding_random(element, v):
    assert _same(cfq.round_to_minifloat(torch.from_numpy(v), element), round_ref(v.astype(np.float64), *element))


@settings(max_examples=60, deadline=None)
@given(a=arrays(np.float32, st.integers(1, 64), elements=st.floats(0, 3.0000000054977558e38, width=32)))
def test_e8m0_scale_rule(a):
    for element in ELEMENTS:
        emax = float(minifloat_values(*element)[-1])
        got = cfq._e8m0_unscale_exponent(torch.from_numpy(a), emax)
        assert np.array_equal(got.numpy(), e8m0_exponent_ref(a, emax))


def _matrices(min_cols=1, max_cols=80):
    shapes = st.tuples(st.integers(1, 6), st.integers(min_cols, max_cols))
    mags = st.sampled_from([1e-3, 1.0, 30.0, 1e4])
    return shapes, mags


@pytest.mark.parametrize("element", ELEMENTS)
@settings(max_examples=25, deadline=None)
@given(shape=_matrices()[0], mag=_matrices()[1], seed=st.integers(0, 2**31 - 1))
def test_mx_matches_float64_reference(element, shape, mag, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * mag * torch.rand(shape[0], 1, generator=g)
    assert _same(cfq.fake_quant_mx(x, element, 32), mx_ref(x.numpy(), element, 32))


@settings(max_examples=40, deadline=None)
@given(shape=_matrices()[0], mag=_matrices()[1], seed=st.integers(0, 2**31 - 1))
def test_nvfp4_matches_float32_reference(shape, mag, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * mag
    amax = float(x.abs().max()) * 1.25
    assert _same(cfq.fake_quant_nvfp4(x, torch.tensor(amax), 16), nvfp4_ref(x.numpy(), amax, 16))


@pytest.mark.parametrize("cols", [96, 50, 7])
def test_rows_of_whole_blocks_and_ragged_rows(cols):
    """The C kernel walks rows of whole blocks as one run of blocks and ragged rows block by block: both
    layouts (and a row shorter than one block) give the references' values, block for block."""
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(5, cols, generator=g) * torch.logspace(-3, 3, 5).reshape(5, 1)  # per-row magnitudes
    amax = float(x.abs().max())
    assert _same(cfq.fake_quant_nvfp4(x, torch.tensor(amax), 16), nvfp4_ref(x.numpy(), amax, 16))
    for element in ELEMENTS:
        assert _same(cfq.fake_quant_mx(x, element, 32), mx_ref(x.numpy(), element, 32))


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 8),
    blocks=st.integers(1, 8),
    mag=st.sampled_from([0.05, 1.0, 100.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_nvfp4_bit_exact_vs_modelopt_nvfp4qtensor(rows, blocks, mag, seed):
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16 * blocks, generator=g) * mag
    with modelopt_export_on_cpu():
        q, s, s2 = NVFP4QTensor.quantize(x, 16)
    ref = q.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16})
    assert torch.equal(cfq.fake_quant_nvfp4(x, x.abs().amax(), 16), ref)


@settings(max_examples=60, deadline=None)
@given(
    amax=st.one_of(st.floats(1e-30, 1e30), st.sampled_from([0.0, math.inf, math.nan, 3.4e38, 1e-45, 1e39])),
    form=st.sampled_from(["float", "int", "0-d", "vector"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_nvfp4_global_scale_in_python_floats_equals_the_tensor_arithmetic(amax, form, seed):
    """amax / (6*448) is computed in Python floats; it must round as float32 tensors do, for any amax form."""
    g = torch.Generator().manual_seed(seed)
    mag = amax / 3 if math.isfinite(amax) and 0 < amax < 1e30 else 1.0
    x = torch.randn(4, 48, generator=g) * mag
    if form == "int" and not (math.isfinite(amax) and amax < 1e18):
        form = "float"
    given_amax = {"float": amax, "int": int(amax) if form == "int" else None, "0-d": torch.tensor(amax),
                  "vector": torch.tensor([amax / 2, amax])}[form]  # fmt: skip
    # the expected global scale by torch float32 tensor arithmetic, independently of the Python floats
    gs = torch.tensor(float(given_amax) if form != "vector" else amax, dtype=torch.float32) / (6.0 * 448.0)
    with cfq.use_native(False):
        expected = cfq.fake_quant_nvfp4(x, None, 16, global_scale=gs)
    assert torch.equal(cfq.fake_quant_nvfp4(x, given_amax, 16).view(torch.int32), expected.view(torch.int32))


def test_special_values():
    x = torch.tensor([[0.0] * 16, [1.0, -2.0, float("inf")] + [0.5] * 13, [float("nan"), 3.0] + [1.0] * 14])
    y = cfq.fake_quant_mx(x, (2, 1), 16)
    assert torch.equal(y[0], torch.zeros(16))  # zero block: no division by zero
    assert torch.isnan(y[2, 0]) and torch.isfinite(y[2, 1:]).all()  # NaN propagates, block intact
    assert y[1, 2] == 6.0  # Inf block: scale 1, saturates
    assert _same(y, mx_ref(x.numpy(), (2, 1), 16))
    z = cfq.fake_quant_nvfp4(x, torch.tensor(3.0), 16)
    assert _same(z, nvfp4_ref(x.numpy(), 3.0, 16))
    assert torch.equal(cfq.fake_quant_nvfp4(torch.zeros(2, 16), torch.tensor(0.0)), torch.zeros(2, 16))


def test_subnormal_inputs_mx():
    x = torch.tensor([[1e-40, -3e-39, 2e-45, 0.0] * 8])
    assert _same(cfq.fake_quant_mx(x, (4, 3), 32), mx_ref(x.numpy(), (4, 3), 32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_compute_in_fp32(dtype):
    x = (torch.randn(4, 64) * 3).to(dtype)
    y = cfq.fake_quant_nvfp4(x, x.float().abs().amax())
    assert y.dtype == dtype
    ref = nvfp4_ref(x.float().numpy(), float(x.float().abs().amax()))
    assert torch.equal(y, torch.from_numpy(ref).to(dtype))


def test_nvfp4_small_scales_follow_the_cuda_kernel_not_nvfp4qtensor():
    """Documented divergence: the Triton kernel (which we follow) uses scale 1 for block scales
    below 1e-5; NVFP4QTensor (export) keeps them. Tiny tensors therefore fake-quantize to zero."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    x = torch.randn(2, 32) * 1e-5
    ours = cfq.fake_quant_nvfp4(x, x.abs().amax())
    with modelopt_export_on_cpu():
        q, s, s2 = NVFP4QTensor.quantize(x, 16)
    export = q.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16})
    assert torch.count_nonzero(ours) == 0 and torch.count_nonzero(export) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("element", ELEMENTS, ids=lambda e: f"E{e[0]}M{e[1]}")
def test_mx_block_kernel_rounds_ties_to_even(impl, element, dtype):
    """Through the block kernel a user runs (the C one by default): every tie of every MX element
    format, in every input dtype, against the float64 reference's round-half-to-even."""
    x = tie_blocks(element, 32, dtype)
    got = cfq.fake_quant_mx(x, element, 32)
    assert got.dtype == dtype
    assert _same(got.float(), mx_ref(x.float().numpy(), element, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_nvfp4_block_kernel_rounds_ties_to_even(impl, dtype):
    """NVFP4 with global amax 6 x 448 and block amax 6: both scales are exactly 1, so every E2M1 tie
    reaches the rounding unchanged; checked against the float64 reference and modelopt's NVFP4QTensor."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    x = tie_blocks((2, 1), 16, dtype)
    got = cfq.fake_quant_nvfp4(x, torch.tensor(6.0 * 448.0), 16)
    assert got.dtype == dtype
    assert _same(got.float(), nvfp4_ref(x.float().numpy(), 6.0 * 448.0, 16))
    half_up = np.floor(np.abs(x.float().numpy()) * 2 + 0.5) / 2  # the broken rule this test must reject
    assert not _same(got.float().abs(), np.minimum(half_up, 6.0))
    with modelopt_export_on_cpu():
        xf = x.float()
        q, s, s2 = NVFP4QTensor.quantize(xf, 16, weights_scaling_factor_2=torch.tensor(1.0))
    ref = q.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16})
    assert torch.equal(got.float(), ref)
