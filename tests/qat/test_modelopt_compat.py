"""The one translation layer to modelopt 0.37 (dict, merge) and 0.47 (list, replace)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nemo_fp4qat.numerics.formats import get_format
from nemo_fp4qat.qat.modelopt_compat import apply_quant_cfg, build_quant_cfg, modelopt_version, uses_list_config

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")

mtq = pytest.importorskip("modelopt.torch.quantization")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))


def test_config_shape_follows_the_installed_version():
    cfg = build_quant_cfg(
        {"0": (get_format("nvfp4"), get_format("fp8")), "1": (get_format("bf16"), get_format("bf16"))}
    )
    if uses_list_config():
        assert modelopt_version().release[:2] >= (0, 40)
        assert cfg["quant_cfg"][0] == {"quantizer_name": "*", "enable": False}
        w = next(e for e in cfg["quant_cfg"] if e["quantizer_name"] == "0.weight_quantizer")
        assert w["cfg"]["num_bits"] == (2, 1) and w["enable"] is True
    else:
        assert cfg["quant_cfg"]["default"] == {"enable": False}
        assert cfg["quant_cfg"]["0.input_quantizer"]["num_bits"] == (4, 3)
        assert cfg["quant_cfg"]["0.input_quantizer"]["block_sizes"] is None
    assert cfg["algorithm"] == "max"


def test_switching_nvfp4_to_fp8_leaves_no_stale_block_sizes():
    m = _model()
    nv = build_quant_cfg({"0": (get_format("nvfp4"), get_format("nvfp4"))})
    mtq.quantize(m, nv, lambda mm: mm(torch.randn(4, 32)))
    assert m[0].weight_quantizer.block_sizes is not None
    fp8 = build_quant_cfg({"0": (get_format("fp8"), get_format("fp8"))})
    apply_quant_cfg(m, fp8["quant_cfg"])
    assert m[0].weight_quantizer.num_bits == (4, 3) and not m[0].weight_quantizer.block_sizes
    assert not m[1].weight_quantizer.is_enabled


def test_the_037_merge_trap_exists_where_we_guard_against_it():
    """A partial config (no block_sizes) keeps NVFP4's blocks under 0.37 and drops them under 0.47."""
    m = _model()
    mtq.quantize(
        m, build_quant_cfg({"0": (get_format("nvfp4"), get_format("nvfp4"))}), lambda mm: mm(torch.randn(4, 32))
    )
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg

    partial = {"num_bits": (4, 3), "axis": None}
    if uses_list_config():
        set_quantizer_by_cfg(m, [{"quantizer_name": "0.weight_quantizer", "cfg": partial}])
        assert not m[0].weight_quantizer.block_sizes
    else:
        set_quantizer_by_cfg(m, {"0.weight_quantizer": partial})
        assert m[0].weight_quantizer.block_sizes  # stale: why we always emit complete attributes
