"""The format registry read back from real modelopt quantizers, and the storage it charges.

Each registered format's weight configuration is applied by modelopt (``mtq.quantize``) to a linear;
``format_of_quantizer`` must name the format from the quantizer modelopt built (hand-written
expectations: weight-only and SmoothQuant INT8 store the same weights, so the first is named).
Storage costs are checked against hand-computed bits (elements plus block scales).
"""

from __future__ import annotations

import pytest
import torch.nn as nn

from nemo_fp4qat.numerics.formats import FORMATS, FULL_PRECISION, format_of_quantizer, list_formats
from nemo_fp4qat.qat.modelopt_compat import build_quant_cfg

pytestmark = pytest.mark.twice("the CPU backend installs over modelopt 0.37's quantizer functions (not 0.47's)")

EXPECTED_WEIGHT_FORMAT = {
    "nvfp4": "nvfp4", "mxfp4": "mxfp4", "mxfp6_e2m3": "mxfp6_e2m3", "mxfp6_e3m2": "mxfp6_e3m2",
    "mxfp8": "mxfp8", "fp8": "fp8", "int8_sq": "int8_sq", "int8_wo": "int8_sq", "int4_awq": "int4_awq",
}  # fmt: skip
# bits per stored weight element: element bits + scale bits / block (per-tensor / per-channel scales ~0)
EXPECTED_BITS = {"bf16": 16, "nvfp4": 4 + 8 / 16, "mxfp4": 4 + 8 / 32, "mxfp6_e2m3": 6 + 8 / 32,
                 "mxfp6_e3m2": 6 + 8 / 32, "mxfp8": 8 + 8 / 32, "fp8": 8, "int8_sq": 8, "int8_wo": 8,
                 "int4_awq": 4 + 16 / 128}  # fmt: skip


def test_every_format_is_listed_once_in_registry_order():
    assert [f.name for f in list_formats()] == list(FORMATS) and set(FORMATS) == set(EXPECTED_BITS)


@pytest.mark.parametrize("name", list(EXPECTED_WEIGHT_FORMAT))
def test_format_is_read_back_from_the_quantizer_modelopt_built(name):
    import modelopt.torch.quantization as mtq

    model = nn.Sequential(nn.Linear(256, 64))
    mtq.quantize(model, build_quant_cfg({"0": (name, "bf16")}, algorithm=None), forward_loop=None)
    assert format_of_quantizer(model[0].weight_quantizer).name == EXPECTED_WEIGHT_FORMAT[name]
    assert format_of_quantizer(model[0].input_quantizer) is FULL_PRECISION  # disabled: full precision
    assert format_of_quantizer(None) is FULL_PRECISION


@pytest.mark.parametrize(
    "fmt,change",
    [("fp8", {"num_bits": (3, 2)}),  # FP6 without a block
     # NVFP4's elements and block with MX's E8M0 scales: block and scale must both match, not either
     ("nvfp4", {"block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (8, 0)}}),
     ("mxfp4", {"block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (8, 0)}})],
    ids=["fp6-unblocked", "nvfp4-with-e8m0-scales", "mxfp4-with-16-blocks"],
)  # fmt: skip
def test_a_quantizer_no_format_describes_is_refused_by_name(fmt, change):
    import modelopt.torch.quantization as mtq

    model = nn.Sequential(nn.Linear(64, 64))
    mtq.quantize(model, build_quant_cfg({"0": (fmt, "bf16")}, algorithm=None), forward_loop=None)
    for attr, value in change.items():
        setattr(model[0].weight_quantizer, attr, value)
    with pytest.raises(ValueError, match="matches no registered format; add it to formats.py"):
        format_of_quantizer(model[0].weight_quantizer)


@pytest.mark.parametrize("name", list(EXPECTED_BITS))
def test_storage_counts_elements_and_block_scales(name):
    fmt = FORMATS[name]
    assert fmt.bits_per_element == pytest.approx(EXPECTED_BITS[name])
    assert fmt.weight_bytes(4096) == pytest.approx(4096 * EXPECTED_BITS[name] / 8)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "mxfp8"])
def test_input_blocks_run_along_the_hidden_dimension_of_3d_activations(name):
    """Activations are (batch, sequence, hidden): the block axis of the registered config must be the last
    one, whatever the rank (axis 1 equals axis -1 only for 2-D weights). Checked against the float64 / numpy
    references on what modelopt's input quantizer returns."""
    import modelopt.torch.quantization as mtq
    import numpy as np
    import torch

    from reference_numerics import mx_ref, nvfp4_ref

    model = nn.Sequential(nn.Linear(64, 32))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 64, generator=g) * torch.linspace(0.1, 4, 64)
    mtq.quantize(model, build_quant_cfg({"0": ("bf16", name)}), forward_loop=lambda m: m(x))
    q = model[0].input_quantizer
    with torch.no_grad():
        got = q(x).numpy()
    if name == "nvfp4":
        want = nvfp4_ref(x.numpy(), float(q.amax))
    else:
        want = mx_ref(x.numpy(), {"mxfp4": (2, 1), "mxfp8": (4, 3)}[name], 32)
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_names_are_read_case_and_dash_insensitively_and_aliases_resolve():
    from nemo_fp4qat.numerics.formats import get_format

    assert get_format(" MXFP6-E2M3 ").name == "mxfp6_e2m3"  # spaces, case, '-' for '_'
    assert get_format("fp6").name == "mxfp6_e2m3" and get_format("FP4").name == "nvfp4"  # aliases
    assert get_format("full-precision").name == "bf16"  # an alias written with a dash
    with pytest.raises(TypeError, match="format must be a name or QuantFormat, got int"):
        get_format(4)


def test_unknown_format_names_the_closest_and_every_known_name():
    from nemo_fp4qat.numerics.formats import _ALIASES, get_format

    known = ", ".join(sorted(set(FORMATS) | set(_ALIASES)))
    with pytest.raises(ValueError) as e:
        get_format("nvfp5")
    assert str(e.value) == f"Unknown quantization format 'nvfp5'. Did you mean 'nvfp4'? Known formats: {known}."
    with pytest.raises(ValueError) as e:  # nothing close: no hint (and no IndexError)
        get_format("qqqqqqqq")
    assert str(e.value) == f"Unknown quantization format 'qqqqqqqq'. Known formats: {known}."


def test_quantizer_cfg_per_kind_is_a_fresh_copy():
    from nemo_fp4qat.numerics.formats import get_format

    assert get_format("bf16").quantizer_cfg("weight") == get_format("bf16").quantizer_cfg("input") == {"enable": False}
    awq = get_format("int4_awq")  # weight-only: the input quantizer is off
    assert awq.quantizer_cfg("input") == {"enable": False} and awq.quantizer_cfg("weight")["num_bits"] == 4
    cfg = get_format("nvfp4").quantizer_cfg("weight")
    cfg["block_sizes"][-1] = 99  # a caller editing its copy does not edit the registry
    assert get_format("nvfp4").quantizer_cfg("weight")["block_sizes"][-1] == 16
    with pytest.raises(ValueError, match="kind must be 'weight' or 'input', got 'bias'"):
        get_format("nvfp4").quantizer_cfg("bias")
