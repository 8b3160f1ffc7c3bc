"""modelopt's normal API on CPU through the backend: formats, gradients, CUDA left alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import nemo_fp4qat
from nemo_fp4qat import get_format
from nemo_fp4qat.numerics import cpu_backend
from nemo_fp4qat.numerics.fake_quant import fake_quant_mx, fake_quant_nvfp4
from nemo_fp4qat.qat.modelopt_compat import modelopt_version

pytestmark = pytest.mark.twice("the CPU backend installs over modelopt 0.37's quantizer functions (not 0.47's)")

mtq = pytest.importorskip("modelopt.torch.quantization")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))


def _data():
    return [torch.randn(8, 64) for _ in range(4)]


def test_import_installs_backend():
    assert nemo_fp4qat.cpu_backend_installed()


def test_mtq_nvfp4_default_cfg_runs_on_cpu_and_matches_kernel():
    m = _mlp()
    data = _data()
    mtq.quantize(m, mtq.NVFP4_DEFAULT_CFG, lambda mm: [mm(d) for d in data])
    x = torch.randn(8, 64)
    lin = m[0]
    expect_in = fake_quant_nvfp4(x, lin.input_quantizer.amax)
    expect_w = fake_quant_nvfp4(lin.weight, lin.weight_quantizer.amax)
    ref = torch.nn.functional.linear(expect_in, expect_w, lin.bias)
    assert torch.equal(lin(x), ref)


@pytest.mark.parametrize(
    "cfg_name,element",
    [("MXFP4_DEFAULT_CFG", (2, 1)), ("MXFP6_DEFAULT_CFG", (3, 2)), ("MXFP8_DEFAULT_CFG", (4, 3))],
)
def test_mtq_mx_configs_run_on_cpu(cfg_name, element):
    m = _mlp()
    mtq.quantize(m, getattr(mtq, cfg_name), None)
    x = torch.randn(8, 64)
    lin = m[0]
    ref = torch.nn.functional.linear(fake_quant_mx(x, element), fake_quant_mx(lin.weight, element), lin.bias)
    assert torch.equal(lin(x), ref)


def test_straight_through_gradient_follows_installed_modelopt():
    m = nn.Linear(64, 8)
    mtq.quantize(m, mtq.NVFP4_DEFAULT_CFG, lambda mm: mm(torch.randn(4, 64)))
    q = m.input_quantizer
    q.amax = torch.tensor(1.0)  # so that some inputs exceed amax
    x = (torch.randn(4, 64) * 2).requires_grad_()
    q(x).sum().backward()
    if q._pass_through_bwd:
        expected = torch.ones_like(x)
    else:  # clipped STE (modelopt 0.37 default)
        expected = (x.detach().abs() <= 1.0).float()
    assert torch.equal(x.grad, expected)
    if modelopt_version().release[:2] >= (0, 47):
        assert q._pass_through_bwd
    else:
        assert not q._pass_through_bwd and (expected == 0).any()


def test_non_cpu_tensors_go_to_modelopts_original_op(monkeypatch):
    """Non-CPU tensors: MX formats always, and NVFP4 when the CUDA kernel is set to modelopt's, reach modelopt's
    own op (NVFP4 by default goes to the exact Triton kernel, tests/numerics/test_triton_nvfp4.py)."""
    seen = []

    def recorder(inputs, *args):
        seen.append((inputs.device.type, args[2:]))
        return inputs

    monkeypatch.setattr(cpu_backend, "_ORIGINAL_OP", recorder)
    x = torch.empty(4, 32, device="meta")
    out = cpu_backend._cpu_dynamic_block_quantize_op(x, 32, None, 4, 2, 8, 8)
    assert seen == [("meta", (4, 2, 8, 8))] and out is x
    previous = cpu_backend.set_cuda_nvfp4_kernel("modelopt")
    try:
        out = cpu_backend._cpu_dynamic_block_quantize_op(x, 16, torch.tensor(1.0), 4, 2, 8, 4)
    finally:
        cpu_backend.set_cuda_nvfp4_kernel(previous)
    assert seen[-1] == ("meta", (4, 2, 8, 4)) and out is x
    cpu_out = cpu_backend._cpu_dynamic_block_quantize_op(torch.randn(4, 16), 16, torch.tensor(1.0), 4, 2, 8, 4)
    assert len(seen) == 2 and cpu_out.shape == (4, 16)


def test_fp8_of_non_cpu_tensors_divides_by_the_exported_scale(monkeypatch):
    """modelopt's FP8 fake quant of a CUDA tensor (its ``fake_e4m3fy`` extension multiplies by 448 / amax) goes to
    ``fake_quant_fp8`` (the exporter's division) by default, and to modelopt's own when the kernel is "modelopt";
    reached through ``_quantize_impl`` (modelopt's CPU / CUDA implementation of its ``quantize_op``), so the patched
    name is the one modelopt calls."""
    from modelopt.torch.quantization import tensor_quant

    seen = []
    monkeypatch.setattr(cpu_backend, "fake_quant_fp8", lambda x, amax: seen.append(("exact", x.device.type)) or x)
    monkeypatch.setattr(cpu_backend, "_ORIGINAL_FP8_IMPL", lambda inputs, amax: seen.append(("modelopt", 0)) or inputs)
    x, amax = torch.empty(4, 32, device="meta"), torch.empty((), device="meta")
    out = tensor_quant._quantize_impl(x, amax, num_bits=8, exponent_bits=4, unsigned=False, narrow_range=False)
    assert seen == [("exact", "meta")] and out is x
    previous = cpu_backend.set_cuda_nvfp4_kernel("modelopt")
    try:
        tensor_quant._quantize_impl(x, amax, num_bits=8, exponent_bits=4, unsigned=False, narrow_range=False)
    finally:
        cpu_backend.set_cuda_nvfp4_kernel(previous)
    assert seen[-1] == ("modelopt", 0)
    cpu_x = torch.randn(4, 32)
    tensor_quant._quantize_impl(cpu_x, torch.tensor(1.0), num_bits=8, exponent_bits=4, narrow_range=False)
    assert len(seen) == 3 and seen[-1] == ("modelopt", 0)  # CPU tensors: modelopt's impl, then fp8_eager (wrapped)


def test_uninstall_restores_modelopt_op():
    from modelopt.torch.quantization import tensor_quant

    cpu_backend.uninstall_cpu_backend()
    try:
        assert tensor_quant.dynamic_block_quantize_op is not cpu_backend._cpu_dynamic_block_quantize_op
        assert tensor_quant.fp8_eager is not cpu_backend._cpu_fp8_eager
        assert tensor_quant.scaled_e4m3_impl is not cpu_backend._exact_scaled_e4m3_impl
        m = _mlp()
        mtq.quantize(m, mtq.NVFP4_DEFAULT_CFG, lambda mm: mm(torch.randn(2, 64)))
        with pytest.raises((AssertionError, RuntimeError)):  # modelopt alone cannot fake-quant NVFP4 on a CPU
            m(torch.randn(2, 64))
    finally:
        cpu_backend.install_cpu_backend()
    assert nemo_fp4qat.cpu_backend_installed()


@pytest.mark.skipif(modelopt_version().release[:2] < (0, 47), reason="register_quant_backend is 0.47+")
def test_named_backend_selectable_in_config():
    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    attrs = {**get_format("nvfp4").quantizer_cfg("weight"), "backend": cpu_backend.BACKEND_NAME}
    attrs.pop("enable")
    cfg["quant_cfg"] = [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": attrs, "enable": True},
    ]
    m = nn.Linear(64, 8)
    mtq.quantize(m, cfg, lambda mm: mm(torch.randn(2, 64)))
    assert m.weight_quantizer.backend == cpu_backend.BACKEND_NAME
    expect = fake_quant_nvfp4(m.weight, m.weight_quantizer.amax)
    assert torch.equal(m.weight_quantizer(m.weight), expect)


# Two amaxes of SmolLM2 q/k/v layers, where modelopt's eager arithmetic rounds some weights one E4M3 step
# away from its exporter; and one where the two happen to agree on these inputs.
@pytest.mark.parametrize(("amax", "eager_differs"), [(1.421875, True), (3.453125, True), (0.7312, False)])
def test_fp8_weights_fake_quantize_exactly_as_modelopt_exports_them(amax, eager_differs):
    """modelopt's FP8 fake quant multiplies by 448/amax; its exporter writes fp8(w / (amax/448)) and
    TensorRT-LLM multiplies the codes by amax/448. Training here must equal the exporter, code for code."""
    from modelopt.torch.export.quant_utils import QUANTIZATION_FP8, to_quantized_weight

    g = torch.Generator().manual_seed(0)
    w = (torch.rand(512, 256, generator=g) * 2 - 1) * amax
    a = torch.tensor(amax)
    scale = a.float() / 448.0  # modelopt's get_scaling_factor: amax / maxbound
    exported = to_quantized_weight(w, scale, QUANTIZATION_FP8).float() * scale
    m = nn.Linear(256, 512, bias=False)
    with torch.no_grad():
        m.weight.copy_(w)
    mtq.quantize(m, {"quant_cfg": _fp8_weight_only_cfg(), "algorithm": "max"}, lambda mm: mm(torch.randn(2, 256)))
    m.weight_quantizer._amax.fill_(amax)
    with torch.no_grad():
        trained = m.weight_quantizer(m.weight)
    assert torch.equal(trained, exported)
    # modelopt's own eager arithmetic (what ran before the backend wrapped it): off by one E4M3 step somewhere
    eager = cpu_backend._ORIGINAL_FP8(w, a)
    assert torch.equal(eager, exported) is not eager_differs


def _fp8_weight_only_cfg():
    from nemo_fp4qat.qat.modelopt_compat import uses_list_config

    fp8 = {"num_bits": (4, 3), "axis": None}
    if uses_list_config():
        return [{"quantizer_name": "*", "enable": False}, {"quantizer_name": "*weight_quantizer", "cfg": fp8}]
    return {"default": {"enable": False}, "*weight_quantizer": fp8}


@pytest.mark.parametrize(("num_bits", "words"), [((5, 2), ["E5M2", "MXFP8 (E4M3)"]), (8, ["MXINT8", "GPU"])])
def test_block_formats_without_a_cpu_kernel_are_refused_naming_the_covered_ones(num_bits, words):
    """MXFP8 with E5M2 elements and MXINT8 (modelopt's MX family, CUDA-only kernels) through modelopt's
    public op on a CPU tensor: an error that names the format and the ones the CPU backend covers."""
    from modelopt.torch.quantization import tensor_quant

    with pytest.raises((ValueError, NotImplementedError)) as e:
        tensor_quant.dynamic_block_quant(torch.randn(4, 32), 32, None, None, num_bits, (8, 0), None, None, False)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "NVFP4" in str(e.value) and "MXFP4" in str(e.value)
