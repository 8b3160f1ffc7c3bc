"""The exact CUDA NVFP4 kernel (Triton), run on CPU tensors by triton's interpreter.

The kernel is written in IEEE float32 arithmetic and integer bit operations only, so the interpreter
computes what the GPU computes; these tests hold it bit for bit to the C kernel, the pure-PyTorch kernel,
the float64 reference and modelopt's exporter (``NVFP4QTensor``), over the GPU check's cases, every tie of
E2M1, special values and every input dtype. ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before
triton is imported.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton", reason="the exact CUDA NVFP4 kernel is tested where triton is installed")
assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported"

from nemo_fp4qat.numerics import cpu_backend, kernel_choice  # noqa: E402
from nemo_fp4qat.numerics import fake_quant as cfq  # noqa: E402
from nemo_fp4qat.numerics.cpu_shims import modelopt_export_on_cpu  # noqa: E402
from nemo_fp4qat.numerics.triton_nvfp4 import triton_nvfp4  # noqa: E402

from reference_numerics import nvfp4_ref, tie_blocks  # noqa: E402

pytestmark = pytest.mark.twice("the CPU backend installs over modelopt 0.37's quantizer functions (not 0.47's)")

# What the H200 machine carries: its interpreter is the one these tests hold the kernel to.
TRITON_PINNED = "3.6.0"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same bit patterns (so -0 and +0 differ), any NaN equal to any NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    return bool(((a.view(view) == b.view(view)) | (a.isnan() & b.isnan())).all())


def _kernels(x: torch.Tensor, amax) -> dict[str, torch.Tensor]:
    out = {"triton": triton_nvfp4(x, amax)}
    with cfq.use_native(True):
        out["c"] = cfq.fake_quant_nvfp4(x, amax)
    with cfq.use_native(False):
        out["torch"] = cfq.fake_quant_nvfp4(x, amax)
    return out


def test_triton_is_the_gpu_machines_version():
    assert triton.__version__ == TRITON_PINNED, (
        f"triton {triton.__version__}: these interpreter tests are pinned to {TRITON_PINNED}, the GPU machine's; "
        "change requirements/core.txt and this pin together"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(256, 4096), (33, 160), (4, 8, 96)], ids=str)
@pytest.mark.parametrize("mag", [1e-2, 1.0, 50.0])
def test_gpu_check_cases_bit_exact(dtype, shape, mag):
    """benchmarks/gpu_check.py's NVFP4 cases (amax 0.9 x the tensor's: some saturation), where modelopt's own
    Triton kernel differed from its exporter on the H200: equal to the C and torch kernels and the reference."""
    g = torch.Generator().manual_seed(hash((shape, mag)) % 2**31)
    x = (torch.randn(shape, generator=g) * mag * torch.rand(shape[0], *[1] * (len(shape) - 1), generator=g)).to(dtype)
    amax = x.float().abs().amax() * 0.9
    got = _kernels(x, amax)
    assert got["triton"].dtype == dtype
    assert _bits_equal(got["triton"], got["c"]) and _bits_equal(got["triton"], got["torch"])
    ref = torch.from_numpy(nvfp4_ref(x.float().numpy(), float(amax))).to(dtype)
    assert _bits_equal(got["triton"], ref)


@pytest.mark.parametrize("mag", [0.05, 1.0, 100.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_equals_modelopt_exporter(mag, dtype):
    """What modelopt's exporter writes (NVFP4QTensor, quantized then dequantized) is what the kernel trains on."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    g = torch.Generator().manual_seed(int(mag * 100))
    x = (torch.randn(24, 16 * 12, generator=g) * mag).to(dtype).float()
    with modelopt_export_on_cpu():
        q, s, s2 = NVFP4QTensor.quantize(x, 16)
    export = q.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16})
    assert torch.equal(triton_nvfp4(x, x.abs().amax()), export)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_e2m1_tie_rounds_to_even(dtype):
    """Global amax 6 x 448 and block amax 6 make both scales 1: every E2M1 midpoint (and the floats beside it)
    reaches the rounding as is; half-up rounding, which modelopt's kernel compare chain could be mistaken for,
    is rejected."""
    x = tie_blocks((2, 1), 16, dtype)
    got = triton_nvfp4(x, torch.tensor(6.0 * 448.0))
    assert _bits_equal(got, torch.from_numpy(nvfp4_ref(x.float().numpy(), 6.0 * 448.0)).to(dtype))
    half_up = np.minimum(np.floor(np.abs(x.float().numpy()) * 2 + 0.5) / 2, 6.0)
    assert not np.array_equal(got.float().abs().numpy(), half_up)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_e4m3_scale_ties_and_binade_edges(dtype):
    """Block amaxes whose ratio to 6 x gs sits on an E4M3 tie, beside it, at E4M3's subnormal edge and
    above 448 (saturating): the block scale rounds as the reference does."""
    e4m3 = [2.0**-9, 2.0**-7, 2.0**-6, 1.0, 1.0625, 1.125, 1.1875, 17.0, 18.0, 240.0, 248.0, 256.0, 448.0, 464.0, 1e4]
    ratios = []
    for v in e4m3:
        ratios += [v, float(np.nextafter(np.float32(v), 0)), float(np.nextafter(np.float32(v), 1e9))]
    gs = 1.0  # amax = 2688: the block amax is 6 x the ratio exactly
    rows = torch.zeros(len(ratios), 16)
    rows[:, 0] = torch.tensor(ratios) * 6.0
    rows[:, 1:] = torch.linspace(-1, 1, 15) * rows[:, :1] * 0.93
    x = rows.to(dtype)
    got = triton_nvfp4(x, torch.tensor(2688.0 * gs))
    assert _bits_equal(got, torch.from_numpy(nvfp4_ref(x.float().numpy(), 2688.0)).to(dtype))
    assert _bits_equal(got, _kernels(x, torch.tensor(2688.0))["c"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("amax", ["own", "none", 0.0, math.inf, math.nan, "vector", 1e-30])
def test_special_values_and_amaxes(dtype, amax):
    """NaN stays NaN, +-Inf saturate, -0 and negatives rounding to zero keep their sign as the C kernel does,
    float32 subnormals, and amaxes that give no usable per-tensor scale (every block scale 1)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 50, generator=g) * 3
    x[0, :8] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, -1e-3, 1e-3, -0.1])
    x[1, :4] = torch.tensor([1e-40, -1e-42, 2.0**-126, -(2.0**-149)])
    x = x.to(dtype)
    finite = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0).abs()
    a = {"own": finite.amax(), "none": None, "vector": finite.amax(dim=1)}.get(amax, amax)
    a = torch.tensor(a) if isinstance(a, float) else a
    got = _kernels(x, a)
    assert _bits_equal(got["triton"], got["c"]) and _bits_equal(got["triton"], got["torch"])
    assert got["triton"][0, 0].isnan()


def test_exact_kernel_is_what_cuda_tensors_get(monkeypatch):
    """The op modelopt calls for a non-CPU tensor goes to the exact kernel by default and to modelopt's own
    Triton kernel when set back (modelopt's op then refuses this CPU tensor: it only takes CUDA tensors)."""
    import modelopt.torch.quantization  # noqa: F401  (the backend wraps modelopt's op)

    assert cpu_backend.install_cpu_backend()
    x = torch.randn(8, 64) * 2
    amax = x.abs().amax()
    nvfp4_bits = (4, 2, 8, 4)
    assert cpu_backend.cuda_nvfp4_kernel() == "exact"
    got = cpu_backend._cuda_dynamic_block_quantize(x, 16, amax, *nvfp4_bits)
    assert torch.equal(got, cfq.fake_quant_nvfp4(x, amax))
    previous = cpu_backend.set_cuda_nvfp4_kernel("modelopt")
    try:
        with pytest.raises(AssertionError):
            cpu_backend._cuda_dynamic_block_quantize(x, 16, amax, *nvfp4_bits)
    finally:
        cpu_backend.set_cuda_nvfp4_kernel(previous)
    with pytest.raises(AssertionError):  # MXFP4 on CUDA is always modelopt's (already bit-exact there)
        cpu_backend._cuda_dynamic_block_quantize(x, 32, None, 4, 2, 8, 8)


def test_kernel_choice_is_checked_and_read_from_the_environment(monkeypatch):
    monkeypatch.setattr(kernel_choice, "_CUDA_NVFP4_KERNEL", None)  # no setting in force: the environment decides
    with pytest.raises(ValueError, match=r"'exact'.*'modelopt'"):
        cpu_backend.set_cuda_nvfp4_kernel("fast")
    monkeypatch.setenv("NEMO_FP4QAT_CUDA_NVFP4", "modelopt")
    assert cpu_backend.cuda_nvfp4_kernel() == "modelopt"
    monkeypatch.setenv("NEMO_FP4QAT_CUDA_NVFP4", "exactly")
    with pytest.raises(ValueError, match="NEMO_FP4QAT_CUDA_NVFP4"):
        cpu_backend.cuda_nvfp4_kernel()


def test_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="fake_quant_nvfp4"):
        triton_nvfp4(torch.ones(16), None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="power-of-two"):
        triton_nvfp4(torch.ones(24), None, block_size=12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_pass_in_the_tensors_own_dtype(dtype, monkeypatch):
    """The kernel reads and writes the tensor in its own dtype (bfloat16 as its bits) and reads a calibrated
    float32 amax where it lies, with no float32 copy or padded copy of the tensor; rows whose width is not a
    multiple of 16 and non-contiguous inputs give what the C kernel gives."""
    from nemo_fp4qat.numerics import triton_nvfp4 as tn

    launches = []
    real = tn._kernel()

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append(args)
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(tn, "_kernel", lambda: Spy())
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 37, 50, generator=g) * 4).to(dtype)
    amax = x.float().abs().amax().reshape(1) * 0.8
    got = triton_nvfp4(x, amax)
    xa, ya, aa = launches[-1][:3]
    assert xa.dtype == (torch.int16 if dtype == torch.bfloat16 else dtype) and xa.numel() == x.numel()
    assert ya.dtype == xa.dtype and aa is amax
    assert _bits_equal(got, _kernels(x, amax)["c"])
    xt = x.transpose(1, 2)  # non-contiguous: blocks along its own last dimension
    assert _bits_equal(triton_nvfp4(xt, amax), _kernels(xt.contiguous(), amax)["c"])
