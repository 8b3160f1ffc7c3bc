"""GPTQ after calibration (``CalibrationConfig.gptq``): modelopt's own GPTQ is the peer, the layer-output error the
reference, the export the proof that what was rounded deploys."""

from __future__ import annotations

import copy

import pytest
import torch

from nemo_fp4qat import QATController
from nemo_fp4qat.export import ExportConfig, export_checkpoint, validate_export
from nemo_fp4qat.qat.calibration.calibrate import CalibrationConfig
from nemo_fp4qat.qat.calibration.gptq import GPTQConfig, apply_gptq
from nemo_fp4qat.qat.config import QATConfig
from nemo_fp4qat.specs import ConfigError

from tiny_models import VOCAB, tiny_llama

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")


def _has_gptq() -> bool:
    try:
        from modelopt.torch.quantization.utils.calib_utils import GPTQHelper  # noqa: F401
    except ImportError:
        return False
    return True


needs_gptq = pytest.mark.skipif(not _has_gptq(), reason="GPTQ needs modelopt >= 0.47 (core and Bridge environments)")


def _model(seed: int = 0) -> torch.nn.Module:
    model = tiny_llama(seed=seed, hidden=64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # off the initialisation, with some outlier input channels, as trained weights have
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model


def _batches(seed: int = 1, n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 32), generator=g) for _ in range(n)]


def _forward(m, b):
    return m(b)


@needs_gptq
@pytest.mark.parametrize("fmt", ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG", "MXFP8_DEFAULT_CFG", "INT8_WEIGHT_ONLY_CFG"])
def test_gptq_on_max_scales_rounds_the_weights_as_modelopts_own_gptq_algorithm(fmt, monkeypatch):
    """On max-calibrated quantizers of each format, :func:`apply_gptq` gives the weights modelopt's ``gptq`` algorithm
    gives: the plugin runs modelopt's per-layer helper on the scales calibration left (quantizing only each GPTQ
    block's columns, which these formats allow), modelopt calibrates max itself and quantizes the whole matrix."""
    import modelopt.torch.quantization as mtq

    import nemo_fp4qat.qat.calibration.gptq as gptq_module

    sliced = []
    alike = gptq_module._slices_alike
    monkeypatch.setattr(gptq_module, "_slices_alike", lambda q, b: sliced.append(alike(q, b)) or sliced[-1])
    direct = []  # per layer: whether the column loop calls modelopt's op without the quantizer module around it
    pick = gptq_module._direct_quantize
    monkeypatch.setattr(gptq_module, "_direct_quantize", lambda q, x: direct.append(pick(q, x) is not q) or pick(q, x))
    batches = _batches()
    cfg = copy.deepcopy(getattr(mtq, fmt))
    ours, peer = _model(), _model()
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}

    def loop(m):
        for b in batches:
            m(b)

    mtq.quantize(ours, {**cfg, "algorithm": "max"}, forward_loop=loop)
    assert apply_gptq(ours, batches, _forward, GPTQConfig()) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    mtq.quantize(peer, {**cfg, "algorithm": {"method": "gptq", "perc_damp": 0.01, "block_size": 128}},
                 forward_loop=loop)  # fmt: skip
    moved = 0
    for (n, p), (_, q) in zip(ours.named_parameters(), peer.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=n)
        moved += int(not torch.equal(p, before[n]))
    assert moved == 14  # every quantized linear's weight, nothing else
    assert sliced == [True] * 14  # the block-slice update ran on every layer
    assert direct == [fmt != "INT8_WEIGHT_ONLY_CFG"] * 14  # INT8: modelopt's integer op, through the quantizer


@needs_gptq
def test_gptq_lowers_every_layers_output_error_against_round_to_nearest():
    """The reference: per layer, ``|| X W^T - X Q(W)^T ||`` on the calibration inputs (the layer's quantized input,
    as GPTQ's Hessian sees it) is lower after GPTQ than with the same scales rounded to nearest."""
    batches = _batches(n=8)
    rtn, gptq = _model(), _model()
    cal = {"num_samples": 16}
    for m, extra in ((rtn, {}), (gptq, {"gptq": True})):
        ctl = QATController(policy="default", schedule="direct", calibration={**cal, **extra}, forward_fn=_forward)
        ctl.prepare(m)
        ctl.calibrate(m, batches)
    float_model = _model()
    inputs: dict[str, list[torch.Tensor]] = {}
    quantized = [(n, mod) for n, mod in rtn.named_modules()
                 if hasattr(mod, "weight_quantizer") and mod.weight_quantizer.is_enabled]  # fmt: skip
    hooks = [mod.register_forward_pre_hook(lambda mod, a, n=n: inputs.setdefault(n, []).append(a[0].detach()))
             for n, mod in quantized]  # fmt: skip
    with torch.no_grad():
        for b in batches:
            rtn(b)
    for h in hooks:
        h.remove()
    mods = {k: dict(m.named_modules()) for k, m in (("rtn", rtn), ("gptq", gptq), ("float", float_model))}
    better = 0
    for name, xs in inputs.items():
        x = torch.cat([mods["rtn"][name].input_quantizer(t).reshape(-1, t.shape[-1]) for t in xs])
        ref = x @ mods["float"][name].weight.T
        err = {}
        for k in ("rtn", "gptq"):
            m = mods[k][name]
            with torch.no_grad():
                err[k] = float((x @ m.weight_quantizer(m.weight).T - ref).pow(2).mean())
        assert err["gptq"] < err["rtn"], (name, err)
        better += 1
    assert better == 14


@needs_gptq
@pytest.mark.parametrize("weight_scale", ["max", "mse", "local_hessian"])
def test_a_gptq_start_exports_and_validates_code_for_code(tmp_path, weight_scale):
    """QAT from a GPTQ start on each kind of NVFP4 weight scale (max: dynamic; MSE and local-Hessian: static block
    scales that GPTQ rounds on), then the unified HF export: the validator finds the exported codes equal to the
    trained model's fake quant (the rounded weights are what deploys)."""
    model = _model()
    cal = {"num_samples": 8, "gptq": True, "weight_scale": weight_scale}
    ctl = QATController(policy="default", schedule="direct", calibration=cal, forward_fn=_forward)
    ctl.prepare(model)
    ctl.calibrate(model, _batches())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for b in _batches(seed=2, n=2):  # a few QAT steps: the rounded weights move off the grid and back through Q
        out = model(b, labels=b)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    out = export_checkpoint(model, tmp_path / "hf", ExportConfig(kind="hf"))
    report = validate_export(out, model=model)
    assert report.ok, report.format() if hasattr(report, "format") else report


def test_gptq_settings_that_cannot_run_are_refused_by_name(monkeypatch):
    with pytest.raises(ConfigError, match="block_size must be a positive multiple of 16"):
        GPTQConfig(block_size=100)
    with pytest.raises(ConfigError, match="perc_damp"):
        GPTQConfig(perc_damp=0)
    with pytest.raises(ConfigError, match="gptq=.* is not understood"):
        CalibrationConfig(gptq="yes")
    if _has_gptq():
        with pytest.raises(ConfigError, match="keep one"):
            CalibrationConfig(gptq=True, block_scale_search=True)
        with pytest.raises(ConfigError, match="use one of them"):
            QATConfig(calibration={"gptq": True}, learned_scales="post")
        assert CalibrationConfig(gptq={"perc_damp": 0.05}).gptq == GPTQConfig(perc_damp=0.05)
    else:  # modelopt 0.37 (the nemo environment): refused by name, with the version that has it
        with pytest.raises(ConfigError, match=r"needs modelopt >= 0\.47"):
            CalibrationConfig(gptq=True)


def _gptq_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {n: m.weight_quantizer(m.weight).detach().clone() for n, m in model.named_modules()
                if hasattr(m, "weight_quantizer") and m.weight_quantizer.is_enabled}  # fmt: skip


def _calibrated(batches: list[torch.Tensor]) -> torch.nn.Module:
    model = _model()
    ctl = QATController(policy="default", schedule="direct", calibration={"num_samples": 16}, forward_fn=_forward)
    ctl.prepare(model)
    ctl.calibrate(model, batches)
    return model


def _data_parallel_gptq_worker(rank: int, init: str, out: dict) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        batches = _batches(n=8)
        model = _calibrated(batches)  # the same scales on both ranks (every batch, amax synced)
        apply_gptq(model, batches[rank::2], _forward, GPTQConfig())  # each rank its half of the data
        out[rank] = _gptq_weights(model)
    finally:
        dist.destroy_process_group()


@needs_gptq
def test_data_parallel_ranks_round_with_the_hessian_of_all_their_data(tmp_path):
    """Two data-parallel ranks, each with half of the calibration batches, average their Hessians (weighted by
    tokens): both round every weight alike, as one process with all the batches does (up to float32 summation
    order), and unlike a rank alone with its half."""
    from two_ranks import run_two_ranks

    ranks = run_two_ranks(_data_parallel_gptq_worker, f"file://{tmp_path / 'store'}")
    batches = _batches(n=8)
    whole = _calibrated(batches)
    apply_gptq(whole, batches, _forward, GPTQConfig())
    half = _calibrated(batches)
    apply_gptq(half, batches[0::2], _forward, GPTQConfig())
    want, alone = _gptq_weights(whole), _gptq_weights(half)
    assert len(want) == 14 and ranks[0].keys() == ranks[1].keys() == want.keys()

    def moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return sum(int((a[k] != b[k]).sum()) for k in a) / sum(t.numel() for t in a.values())

    assert moved(ranks[0], ranks[1]) == 0.0
    assert moved(ranks[0], want) < 0.001 < moved(alone, want), (moved(ranks[0], want), moved(alone, want))
