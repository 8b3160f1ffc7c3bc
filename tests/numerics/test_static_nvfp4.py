"""Static per-block NVFP4 and LSQ's FP4 cast on the CPU (:mod:`nemo_fp4qat.numerics.static_nvfp4`): modelopt >= 0.46
runs them as Triton kernels on CUDA only. Checked against a float64 reference written from the formats' definitions,
against modelopt's own Triton kernels in triton's interpreter, and for modelopt's gradients (its autograd functions
keep their backward passes)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from nemo_fp4qat.numerics.static_nvfp4 import fp4_cast, static_nvfp4_fake_quant

pytestmark = pytest.mark.twice("the CPU backend installs over modelopt 0.37's quantizer functions (not 0.47's)")

tq = pytest.importorskip("modelopt.torch.quantization.tensor_quant")
if not hasattr(tq, "StaticBlockwiseFP4FakeQuantFunction"):
    pytest.skip("modelopt < 0.46 has no static NVFP4 / LSQ", allow_module_level=True)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _e4m3_grid() -> torch.Tensor:
    vals = [m / 8 * 2.0**-6 for m in range(8)]  # subnormals
    vals += [(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8)]
    return torch.tensor(sorted(v for v in set(vals) if v <= 448.0), dtype=torch.float64)


E4M3 = _e4m3_grid()


def _nearest_even(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """``|v|`` to the nearest grid value, ties to the even index (the even code), saturating at the grid's top."""
    a = v.abs().clamp(max=float(grid[-1]))
    d = (a[..., None] - grid).abs()
    best = d.min(-1, keepdim=True).values
    ties = d == best
    idx = torch.where(ties.sum(-1) > 1, torch.argmax((ties & (torch.arange(len(grid)) % 2 == 0)).int(), -1),
                      torch.argmin(d, -1))  # fmt: skip
    return grid[idx]


def _reference_static(x: torch.Tensor, amax: torch.Tensor, gamax: torch.Tensor) -> torch.Tensor:
    """float64: block scale amax/6 rounded to E4M3 in units of (gamax/6)/448, elements to E2M1 of |x|/scale."""
    unit = float(gamax) / 6 / 448
    s = _nearest_even(amax.double().reshape(-1, 1) / 6 / unit, E4M3) * unit
    xb = x.double().reshape(amax.numel(), -1)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = _nearest_even(xb / safe, E2M1) * safe * torch.where(xb >= 0, 1.0, -1.0)
    return torch.where(s == 0, torch.zeros_like(q), q).reshape(x.shape)


def _inputs(seed: int, shape=(24, 64), mag=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * mag
    blocks = x.reshape(-1, 16).abs().amax(-1, keepdim=True)
    amax = blocks * (0.7 + 0.6 * torch.rand(blocks.shape, generator=g))  # a calibrated amax, not the block max
    return x, amax, amax.max()


def test_fp4_cast_is_e2m1_round_to_nearest_even_with_saturation():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 6.5, -100.0, 0.0])
    x = torch.cat([ties, torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 3])
    want = _nearest_even(x.double(), E2M1) * torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(fp4_cast(x).double(), want)
    assert fp4_cast(x, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("mag", [1e-3, 1.0, 300.0])
def test_static_fake_quant_equals_float64_reference(mag):
    x, amax, gamax = _inputs(1, mag=mag)
    got = static_nvfp4_fake_quant(x, amax, gamax)
    want = _reference_static(x, amax, gamax)
    assert torch.allclose(got.double(), want, rtol=2**-22, atol=0), (got.double() - want).abs().max()
    amax_zero = amax.clone()
    amax_zero[3] = 0.0  # a zero block amax: a zero block
    assert torch.equal(static_nvfp4_fake_quant(x, amax_zero, gamax).reshape(-1, 16)[3], torch.zeros(16))


@contextlib.contextmanager
def _modelopt_triton():
    """modelopt's Triton FP4 kernels on CPU tensors in triton's interpreter (tests/conftest.py sets
    TRITON_INTERPRET=1): imported by module name (its package imports them only with CUDA), ``torch.cuda.device`` a
    null context, and CUDA's ``libdevice.isnan`` (no interpreter implementation) as ``x != x``."""
    import importlib
    import types

    kernels = importlib.import_module("modelopt.torch.kernels.quantization.gemm.fp4_kernel")
    common = importlib.import_module("modelopt.torch.kernels.quantization.common.nvfp4_quant")
    original, libdevice = torch.cuda.device, common.libdevice
    torch.cuda.device = lambda *_a, **_k: contextlib.nullcontext()  # type: ignore[assignment]
    common.libdevice = types.SimpleNamespace(isnan=lambda v: v != v)
    try:
        yield kernels
    finally:
        torch.cuda.device = original  # type: ignore[assignment]
        common.libdevice = libdevice


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_max", [448.0, 256.0])  # 256: Four-Over-Six's normalization
def test_equals_modelopts_triton_kernels_in_the_interpreter(dtype, fp8_max):
    """Outputs in float32: the interpreter emulates the bfloat16 store by truncation (the H200 run,
    benchmarks/results/gpu_check.md, compares bfloat16 outputs on the device). modelopt's kernel scales through its
    FP8 fake quant, this package in the exporter's order: with Four-Over-Six's 256 the scales may differ in their
    last bit (the same codes)."""
    pytest.importorskip("triton")
    x, amax, gamax = _inputs(2, mag=5.0)
    x = x.to(dtype)
    cast_in = (torch.randn(33, 16, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    with _modelopt_triton() as k:
        theirs = k.static_blockwise_fp4_fake_quant(x, amax, gamax, True, fp8_max, torch.float32)
        theirs_cast = k.static_blockwise_fp4_cast(cast_in, torch.float32)
    ours = static_nvfp4_fake_quant(x, amax, gamax, True, fp8_max, torch.float32)
    if fp8_max == 448.0:
        assert torch.equal(ours, theirs)
    else:
        assert torch.allclose(ours, theirs, rtol=2**-22, atol=0)
    assert torch.equal(fp4_cast(cast_in, torch.float32), theirs_cast)


@pytest.mark.parametrize("fp8_max", [448.0, 256.0])
def test_block_scales_are_the_exported_checkpoints_to_the_last_bit(fp8_max):
    """The scales training uses are what modelopt's exporter writes for a static quantizer (E4M3 block scale times
    ``weight_scale_2``), multiplied in float32 as a runtime does."""
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import StaticBlockScaleQuantizer, TensorQuantizer
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    from nemo_fp4qat.numerics.static_nvfp4 import static_block_scales

    x, amax, gamax = _inputs(5, shape=(64, 128), mag=3.0)
    bs = {-1: 16, "type": "static", "scale_bits": (4, 3), "four_over_six": fp8_max == 256.0}
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=(2, 1), block_sizes=bs))
    q = StaticBlockScaleQuantizer.from_tensor_quantizer(q, global_amax=gamax)
    q.amax = amax
    ws, ws2 = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(q, x)
    deployed = ws.float() * ws2.float()
    assert torch.equal(static_block_scales(amax, gamax, True, fp8_max).reshape(deployed.shape), deployed)


def test_modelopts_static_op_runs_on_cpu_with_its_straight_through_gradient():
    """modelopt's static op with the pass-through estimator its quantizers use by default (0.47). Its clipped
    variant compares the input with the per-block amax unbroadcast and fails in modelopt itself."""
    x, amax, gamax = _inputs(4)
    x.requires_grad_(True)
    y = tq.static_blockwise_fp4_fake_quant(x, amax, gamax, True, 448.0, None, True)
    assert torch.equal(y.detach(), static_nvfp4_fake_quant(x.detach(), amax, gamax))
    g = torch.randn(x.shape)
    y.backward(g)
    assert torch.equal(x.grad, g), "modelopt's pass-through straight-through estimator"


def test_lsq_gradients_match_a_float64_straight_through_reference():
    """modelopt's LSQ forward on the CPU (``Q(w / s_pre) * s_post`` with FP8 block scales) and its gradients to the
    weight and to both learnable amax, against the same estimator written in float64 autograd."""
    import modelopt.torch.quantization as mtq

    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 32))
    static = {"num_bits": (2, 1), "axis": None, "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}
    lsq = {"method": "lsq", "scale_algorithm": {"method": "max"}, "learnable_amax": ["pre", "post"]}
    cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                         {"quantizer_name": "*weight_quantizer", "cfg": static}], "algorithm": lsq}  # fmt: skip
    mtq.quantize(lin, cfg, forward_loop=lambda m: m(torch.randn(4, 64)))
    q = lin[0].weight_quantizer
    with torch.no_grad():  # learned scales that moved apart
        q._amax_post.mul_(1.05)
        q._amax_pre.mul_(0.97)
    w = lin[0].weight
    g = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    (q(w) * g).sum().backward()

    unit = (q.global_amax.double() / 6) / 448

    def block_scale(amax):
        s = amax.double() / 6
        sq = _nearest_even(s.detach() / unit, E4M3) * unit
        inside = s.detach() <= unit * 448  # modelopt's FP8 cast: clipped straight-through estimator
        return s * inside + (sq - s * inside).detach()

    w64 = w.detach().double().requires_grad_(True)
    pre = q._amax_pre.detach().double().requires_grad_(True)
    post = q._amax_post.detach().double().requires_grad_(True)
    v = w64.reshape(-1, 16) / block_scale(pre)
    cast = _nearest_even(v.detach(), E2M1) * torch.where(v.detach() >= 0, 1.0, -1.0)
    v_ste = v * (v.detach().abs() <= 6) + (cast - v * (v.detach().abs() <= 6)).detach()
    y = (v_ste * block_scale(post)).reshape(w.shape)
    (y * g.double()).sum().backward()
    for got, want in ((w.grad, w64.grad), (q._amax_post.grad, post.grad), (q._amax_pre.grad, pre.grad)):
        assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
