"""The native kernels' vectorised (AVX2) path against their scalar path, bit for bit, and writing into ``out``."""

from __future__ import annotations

import pytest
import torch

from nemo_fp4qat.numerics import fake_quant as cfq
from nemo_fp4qat.numerics import native_kernels

from reference_numerics import nvfp4_ref

needs_vector = pytest.mark.skipif(
    not native_kernels.native_available() or native_kernels.vector_path() is None,
    reason="no vectorised native path on this CPU (no AVX2) or no C compiler",
)
MX = [(1, 0, 6.0), (3, 0, 7.5), (2, -2, 28.0), (3, -6, 448.0)]  # (mantissa bits, emin, max): E2M1 E2M3 E3M2 E4M3


def _bit_sweep(step: int, cols: int) -> torch.Tensor:
    """Every ``step``-th float32 bit pattern (NaNs, Infs, zeros, subnormals, every binade), shuffled into rows."""
    bits = (torch.arange(0, 2**32, step, dtype=torch.int64) - 2**31).to(torch.int32)
    x = bits.view(torch.float32)[torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(0))]
    return x[: x.numel() // cols * cols].reshape(-1, cols).contiguous()


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    sweep = _bit_sweep(65521, 512)
    edges = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45,
                          1.17549435e-38, 3.4028235e38, -3.4028235e38, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0,
                          -0.25, -0.75, -2.5, -5.0, 448.0, 464.0, 480.0, -7.0, 1e-7, 2.0**-9, 2.0**-10])  # fmt: skip
    edge_rows = edges.repeat(16 * 32 // edges.numel() + 1)[: 16 * 32].reshape(4, 128)
    return [
        sweep,
        sweep * 1e-30,
        sweep * 1e30,
        torch.randn(96, 256, generator=g) * torch.logspace(-20, 20, 256),
        edge_rows,
        torch.randn(7, 16 * 13, generator=g),  # 13 blocks a row: whole chunks of 8 blocks plus a scalar tail
    ]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@needs_vector
@pytest.mark.parametrize("case", range(6))
def test_native_vector_nvfp4_equals_scalar_bit_for_bit(case):
    x = _inputs()[case]
    finite = x[torch.isfinite(x)].abs()
    scales = [(float(finite.amax()) / 2688.0, True), (1.0, False), (1e-3, True), (float(finite.median()), True)]
    for gs, valid in scales:
        vec = native_kernels.native_nvfp4(x, gs, valid, 16)
        with native_kernels.use_vector_path(False):
            ref = native_kernels.native_nvfp4(x, gs, valid, 16)
        assert _same_bits(vec, ref), f"gs={gs} valid={valid}"


@needs_vector
@pytest.mark.parametrize("case", range(6))
@pytest.mark.parametrize("fmt", MX, ids=["e2m1", "e2m3", "e3m2", "e4m3"])
def test_native_vector_mx_equals_scalar_bit_for_bit(case, fmt):
    x = _inputs()[case]
    for block in (32, 16, 8):
        vec = native_kernels.native_mx(x, *fmt, block)
        with native_kernels.use_vector_path(False):
            ref = native_kernels.native_mx(x, *fmt, block)
        assert _same_bits(vec, ref), f"block={block}"


@needs_vector
def test_native_vector_nvfp4_equals_float64_reference():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(2)) * 3
    amax = x.abs().amax()
    got = cfq.fake_quant_nvfp4(x, amax)
    assert torch.equal(got, torch.from_numpy(nvfp4_ref(x.numpy(), float(amax), 16)).float())


@pytest.mark.skipif(not native_kernels.native_available(), reason="no C compiler: native kernels unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_fake_quant_writes_into_out(dtype):
    x = (torch.randn(32, 128, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    amax = x.float().abs().amax()
    expected_nv, expected_mx = cfq.fake_quant_nvfp4(x, amax), cfq.fake_quant_mx(x, (2, 1))
    out = torch.full_like(x, 7.0)
    assert cfq.fake_quant_nvfp4(x, amax, out=out) is out
    assert torch.equal(out, expected_nv)
    assert cfq.fake_quant_mx(x, (2, 1), out=out) is out
    assert torch.equal(out, expected_mx)
    inplace = x.clone()  # x itself as out: every block is read before it is written
    assert cfq.fake_quant_nvfp4(inplace, amax, out=inplace) is inplace
    assert torch.equal(inplace, expected_nv)
    with pytest.raises(ValueError, match="shape"):
        cfq.fake_quant_nvfp4(x, amax, out=torch.empty(4, 4, dtype=dtype))


@pytest.mark.skipif(not native_kernels.native_available(), reason="no C compiler: native kernels unavailable")
def test_native_float32_out_is_written_without_allocating():
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(4))
    out, amax = torch.empty_like(x), x.abs().amax()
    ptr = out.data_ptr()
    with torch.autograd.profiler.profile(profile_memory=True) as prof:
        cfq.fake_quant_nvfp4(x, amax, out=out)
    assert not any(e.cpu_memory_usage > 0 for e in prof.function_events if e.name == "aten::empty_like")
    allocated = sum(e.cpu_memory_usage for e in prof.function_events if e.cpu_memory_usage > 0)
    assert out.data_ptr() == ptr
    assert allocated < x.numel() * 4 // 4, f"{allocated} bytes allocated for a {x.numel() * 4}-byte tensor"
