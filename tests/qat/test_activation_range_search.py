"""The benchmark's activation range search (#17's learned-range lever): the multiplier it keeps per layer is
the one a brute force over the same grid finds (computed here with the float64 error of the reference NVFP4
fake quant, not modelopt's quantizer), fused siblings share one, and the model is left without hooks."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

from nemo_fp4qat import QATController
from nemo_fp4qat.numerics.fake_quant import fake_quant_nvfp4
from nemo_fp4qat.qat.policy.fused_siblings import find_fused_siblings

from paths import ROOT
from tiny_models import VOCAB, tiny_llama

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")


def _benchmark_module(name: str):
    """A benchmark helper module, loaded from its file (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_search = _benchmark_module("activation_range_search")
GRID, search_activation_ranges = _search.GRID, _search.search_activation_ranges


def _calibrated():
    model = tiny_llama(hidden=64)
    with torch.no_grad():  # outlier channels, so the range is worth choosing; q_proj and gate_proj barely weigh
        model.model.embed_tokens.weight[:, :4] *= 20  # them, so their output errors (what the search minimises)
        for layer in model.model.layers:  # disagree with their fused siblings' and with the input's own error
            layer.self_attn.q_proj.weight[:, :4] *= 1e-3
            layer.mlp.gate_proj.weight[:, :4] *= 1e-3
    batches = [torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ctl = QATController(policy="fp_embeddings", schedule="direct", calibration=2, forward_fn=lambda m, b: m(b))
    ctl.prepare(model)
    ctl.calibrate(model, batches[:2])
    return model, batches


def _quantized_linears(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.input_quantizer.is_enabled}


def _err(x: torch.Tensor, amax: torch.Tensor, w: torch.Tensor) -> float:
    return float(F.linear((fake_quant_nvfp4(x, amax) - x).double(), w).pow(2).sum())


def _brute_force(model, batches) -> dict[str, int]:
    """Index into GRID of the least summed output error per layer group (fused siblings summed)."""
    linears = _quantized_linears(model)
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in linears}
    hooks = [
        m.register_forward_pre_hook(lambda mod, a, n=n: inputs[n].append(a[0].detach())) for n, m in linears.items()
    ]
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    err = {}
    for n, m in linears.items():
        a0, w = m.input_quantizer.amax.detach().clone(), m.weight.detach().double()
        err[n] = torch.tensor([sum(_err(x, a0 * c, w) for x in inputs[n]) for c in GRID])
    groups = [g for g in find_fused_siblings(model) if g[0] in linears]
    grouped = {n for g in groups for n in g}
    groups += [[n] for n in linears if n not in grouped]
    return {n: int(torch.argmin(sum(err[m] for m in g))) for g in groups for n in g}


def test_search_keeps_the_brute_force_multiplier_and_ties_siblings():
    model, batches = _calibrated()
    before = {n: m.input_quantizer.amax.clone() for n, m in _quantized_linears(model).items()}
    expect = _brute_force(model, batches)
    chosen = search_activation_ranges(model, batches, lambda m, b: m(b))
    assert chosen.keys() == expect.keys() and len(chosen) == 14  # 2 layers x 7 linears
    assert {n: GRID.index(c) for n, c in chosen.items()} == expect
    assert len(set(chosen.values())) > 1, "every layer chose one multiplier: the test no longer tells layers apart"
    modules = dict(model.named_modules())
    for n, c in chosen.items():
        assert torch.equal(modules[n].input_quantizer.amax, before[n] * c)
        assert not modules[n]._forward_pre_hooks
    for group in find_fused_siblings(model):
        assert len({chosen[n] for n in group}) == 1


def test_a_grid_of_one_leaves_the_ranges_as_calibrated():
    model, batches = _calibrated()
    before = {n: m.input_quantizer.amax.clone() for n, m in _quantized_linears(model).items()}
    chosen = search_activation_ranges(model, batches, lambda m, b: m(b), grid=(1.0,))
    assert set(chosen.values()) == {1.0}
    assert all(torch.equal(m.input_quantizer.amax, before[n]) for n, m in model.named_modules() if n in chosen)
