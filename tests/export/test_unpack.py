"""The plugin's unpacker (``nemo_fp4qat.export.unpack``) on hand-built tensors, against references built
here from the formats' definitions (E2M1 / E4M3 tables from ``reference_numerics``, E8M0 = 2**(s-127),
two's-complement nibbles), in float64 with explicit loops: every code, every quant_algo name a
checkpoint may carry, 3-D (expert-stacked) tensors, and the errors a malformed layer gets.

The export tests reach these functions only through modelopt's exports of a few formats; mutation
testing (``benchmarks/results/mutation.md``) found the MX paths, the algorithm names and the messages
unpinned.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from nemo_fp4qat.export.unpack import dequantize_linear, e8m0_to_float, unpack_e2m1_codes

from reference_numerics import e2m1_code_value, minifloat_values

pytestmark = pytest.mark.twice("modelopt 0.37's exporters write what NeMo's export path deploys")

E4M3 = minifloat_values(4, 3)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _packed(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=_gen(seed))


def _ref_fp4(packed: torch.Tensor, scale_of: callable) -> np.ndarray:
    """[..., n/2] bytes -> [..., n]: element 2j from byte j's low nibble, 2j+1 from its high nibble."""
    p = packed.numpy()
    out = np.zeros((*p.shape[:-1], p.shape[-1] * 2))
    for idx in itertools.product(*map(range, p.shape)):
        *lead, j = idx
        byte = int(p[idx])
        for k, code in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
            out[(*lead, k)] = e2m1_code_value(code) * scale_of((*lead, k))
    return out


def test_e2m1_codes_come_from_both_nibbles_of_every_byte():
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(2, 4, 32)  # 3-D: leading dims kept
    codes = unpack_e2m1_codes(every_byte)
    assert codes.shape == (2, 4, 64)
    for b in range(256):
        i, j, k = b // 128, (b // 32) % 4, b % 32
        assert (int(codes[i, j, 2 * k]), int(codes[i, j, 2 * k + 1])) == (b & 0xF, b >> 4)


@pytest.mark.parametrize("algo", ["NVFP4", "nvfp4", "W4A8_NVFP4_FP8"])
def test_nvfp4_expert_stack(algo):
    """[experts, out, in/2] codes, an E4M3 scale per 16 elements, one fp32 scale: product taken in fp32."""
    w = _packed((2, 3, 16), 0)
    scale = (torch.rand(2, 3, 2, generator=_gen(1)) * 40 + 0.01).to(torch.float8_e4m3fn)
    s2 = torch.tensor(0.0123, dtype=torch.float32)
    got = dequantize_linear({"weight": w, "weight_scale": scale, "weight_scale_2": s2}, algo)
    sf = scale.float().numpy()
    ref = _ref_fp4(w, lambda i: float(np.float32(sf[(*i[:-1], i[-1] // 16)]) * np.float32(s2.item())))
    assert got.dtype == torch.float64 and got.shape == (2, 3, 32)
    np.testing.assert_array_equal(got.numpy(), ref)


@pytest.mark.parametrize("algo", ["MXFP4", "mxfp4", "W4A16_MXFP4"])
def test_mxfp4_e8m0_scales(algo):
    w = _packed((2, 3, 32), 2)
    scale = torch.randint(100, 150, (2, 3, 2), dtype=torch.uint8, generator=_gen(3))
    scale[0, 0, 0] = 255  # E8M0 NaN
    got = dequantize_linear({"weight": w, "weight_scale": scale}, algo)
    s = scale.numpy()

    def scale_of(i):
        e = int(s[(*i[:-1], i[-1] // 32)])
        return np.nan if e == 255 else 2.0 ** (e - 127)

    assert got.dtype == torch.float64
    np.testing.assert_array_equal(got.numpy(), _ref_fp4(w, scale_of))


@pytest.mark.parametrize("algo", ["MXFP8", "mxfp8"])
def test_mxfp8_e8m0_scales(algo):
    x = torch.randn(2, 3, 64, generator=_gen(4)) * 100
    w = x.to(torch.float8_e4m3fn)
    scale = torch.randint(110, 140, (2, 3, 2), dtype=torch.uint8, generator=_gen(5))
    got = dequantize_linear({"weight": w, "weight_scale": scale}, algo)
    wf, s = w.float().numpy().astype(np.float64), scale.numpy().astype(np.float64)
    ref = wf * 2.0 ** (np.repeat(s, 32, axis=-1) - 127)
    assert set(np.abs(wf).ravel()) <= set(E4M3)  # the weights are E4M3 values
    np.testing.assert_array_equal(got.numpy(), ref)


@pytest.mark.parametrize(
    ("algo", "dtype"),
    [("FP8", torch.float8_e4m3fn), ("fp8", torch.float8_e4m3fn), ("INT8", torch.int8), ("int8", torch.int8),
     ("W8A16", torch.int8), ("W8A8_SQ_PER_CHANNEL", torch.int8)],
)  # fmt: skip
@pytest.mark.parametrize("per", ["tensor", "channel"])
def test_per_tensor_and_per_channel_scales(algo, dtype, per):
    x = torch.randn(2, 48, generator=_gen(6)) * 50
    w = x.to(dtype) if dtype != torch.int8 else x.round().clamp(-127, 127).to(torch.int8)
    scale = torch.tensor([0.37]) if per == "tensor" else torch.tensor([0.37, 1.9])  # 2 rows, 2 scales
    got = dequantize_linear({"weight": w, "weight_scale": scale}, algo)
    ref = w.float().numpy().astype(np.float64) * scale.double().numpy().reshape(-1, 1)
    assert got.dtype == torch.float64 and got.shape == (2, 48)
    np.testing.assert_array_equal(got.numpy(), ref)


@pytest.mark.parametrize("algo", ["W4A16_AWQ", "w4a16_awq", "W4A8_AWQ"])
@pytest.mark.parametrize("stored", [torch.uint8, torch.int8])
def test_int4_awq_every_nibble_and_group_scales(algo, stored):
    """Rows 2j (low nibble) and 2j+1 (high nibble), two's complement (8..15 are -8..-1)."""
    b = torch.arange(256, dtype=torch.uint8).reshape(2, 128)  # every byte, so every nibble pair
    scale = torch.rand(4, 2, generator=_gen(7)) + 0.5  # [out, in / group 64]
    w = b if stored == torch.uint8 else b.view(torch.int8)
    got = dequantize_linear({"weight": w, "weight_scale": scale}, algo)
    ref = np.zeros((4, 128))
    for j, c in itertools.product(range(2), range(128)):
        byte = int(b[j, c])
        for row, nib in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
            ref[row, c] = (nib - 16 if nib >= 8 else nib) * float(scale[row, c // 64].double())
    assert got.dtype == torch.float64
    np.testing.assert_array_equal(got.numpy(), ref)


@pytest.mark.parametrize("algo", [None, "", "NO_QUANT", "no_quant", "NONE", "none"])
def test_unquantized_layers_come_back_in_float64(algo):
    w = torch.randn(3, 5, generator=_gen(8), dtype=torch.bfloat16)
    got = dequantize_linear({"weight": w}, algo)
    assert got.dtype == torch.float64 and torch.equal(got, w.double())


def test_malformed_layers_are_refused_by_name():
    fp4 = _packed((2, 8), 9)
    with pytest.raises(TypeError, match=r"^packed FP4 weights must be uint8, got torch.int8$"):
        unpack_e2m1_codes(fp4.view(torch.int8))
    with pytest.raises(TypeError, match=r"^E8M0 scales must be uint8, got torch.float32$"):
        e8m0_to_float(torch.ones(2, 1))
    with pytest.raises(TypeError, match=r"^NVFP4 weight_scale must be float8_e4m3fn, got torch.float32$"):
        dequantize_linear({"weight": fp4, "weight_scale": torch.ones(2, 1), "weight_scale_2": torch.ones(())}, "NVFP4")
    with pytest.raises(ValueError, match=r"^scale has 3 blocks per row, which does not divide 16 elements$"):
        dequantize_linear({"weight": fp4, "weight_scale": torch.ones(2, 3, dtype=torch.uint8)}, "MXFP4")
    with pytest.raises(ValueError, match=r"^scale has 3 blocks per row, which does not divide 16 elements$"):
        bad = torch.ones(2, 5, 3).to(torch.float8_e4m3fn)  # 3-D: the last dim counts the blocks
        dequantize_linear({"weight": _packed((2, 5, 8), 9), "weight_scale": bad, "weight_scale_2": torch.ones(())},
                          "NVFP4")  # fmt: skip
    with pytest.raises(TypeError, match=r"^MXFP8 weight must be float8_e4m3fn, got torch.float32$"):
        dequantize_linear({"weight": torch.ones(2, 32), "weight_scale": torch.ones(2, 1, dtype=torch.uint8)}, "MXFP8")
    with pytest.raises(TypeError, match=r"^FP8 weight must be torch.float8_e4m3fn, got torch.float32$"):
        dequantize_linear({"weight": torch.ones(2, 4), "weight_scale": torch.ones(1)}, "FP8")
    with pytest.raises(TypeError, match=r"^INT8 weight must be torch.int8, got torch.float32$"):
        dequantize_linear({"weight": torch.ones(2, 4), "weight_scale": torch.ones(2)}, "W8A16")
    with pytest.raises(TypeError, match=r"^INT4 AWQ weight must be uint8 \(or int8 in TRT-LLM checkpoints\), got "
                       r"torch.float32$"):  # fmt: skip
        dequantize_linear({"weight": torch.ones(2, 4), "weight_scale": torch.ones(4, 1)}, "W4A16_AWQ")
    with pytest.raises(KeyError, match=r"NVFP4 layer is missing tensor 'weight_scale_2'"):
        dequantize_linear({"weight": fp4, "weight_scale": torch.ones(2, 1).to(torch.float8_e4m3fn)}, "nvfp4")
    with pytest.raises(ValueError, match=r"^No unpacker for quant_algo 'w4a4_foo'$"):
        dequantize_linear({"weight": fp4}, "w4a4_foo")
