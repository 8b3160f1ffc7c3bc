"""Calibration data: which rows of which batches go through the model, truncated how, kept where; how a
batch is fed to the model; the config's rules; and modelopt's max calibration on those batches against the
amax computed here in float64."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

from nemo_fp4qat import QATController
from nemo_fp4qat.qat.calibration.calibrate import (
    CalibrationConfig,
    collect_batches,
    default_forward,
    forward_batches,
    run_calibration,
)

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")


def _counting(batches):
    """The batches as a generator that records how many were pulled."""
    pulled = []

    def gen():
        for b in batches:
            pulled.append(b)
            yield b

    return gen(), pulled


def test_rows_are_taken_until_the_sample_count_and_no_batch_more_is_pulled():
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(4, 6, generator=g) for _ in range(5)]
    it, pulled = _counting(src)
    out = collect_batches(it, 10)
    assert [b.shape[0] for b in out] == [4, 4, 2]
    assert len(pulled) == 3  # the fourth batch was never asked for
    assert torch.equal(torch.cat(out), torch.cat(src)[:10])
    it, pulled = _counting(src)
    assert [b.shape[0] for b in collect_batches(it, 8)] == [4, 4] and len(pulled) == 2  # an exact fit


def test_one_row_needs_one_batch_and_a_row_count_below_a_batch_cuts_it():
    src = [torch.arange(12.0).reshape(3, 4), torch.ones(3, 4)]
    out = collect_batches(iter(src), 1)
    assert len(out) == 1 and torch.equal(out[0], src[0][:1])


def test_seq_len_truncates_token_dimensions_of_every_tensor_but_not_per_row_vectors():
    ids = torch.arange(2 * 9).reshape(2, 9)
    batch = {"input_ids": ids, "attention_mask": torch.ones(2, 9, dtype=torch.long), "lengths": torch.tensor([9, 7]),
             "step": torch.tensor(3)}  # fmt: skip
    (out,) = collect_batches([batch], 2, seq_len=5)
    assert torch.equal(out["input_ids"], ids[:, :5]) and out["attention_mask"].shape == (2, 5)
    assert torch.equal(out["lengths"], batch["lengths"])  # 1-D: one value per row, not per token
    assert torch.equal(out["step"], batch["step"])  # 0-D: kept as is
    (short,) = collect_batches([ids], 2, seq_len=20)
    assert torch.equal(short, ids)  # shorter than seq_len: unchanged


def test_dict_and_pair_batches_keep_their_structure_and_are_cut_together():
    x, y = torch.randn(4, 3), torch.arange(4)
    (pair,) = collect_batches([(x, y)], 3)
    assert isinstance(pair, tuple) and torch.equal(pair[0], x[:3]) and torch.equal(pair[1], y[:3])
    (lst,) = collect_batches([[x, y]], 2)
    assert isinstance(lst, list) and torch.equal(lst[1], y[:2])
    # the row count of a dict is its first tensor with a dimension (a leading scalar does not count)
    (d,) = collect_batches([{"scale": torch.tensor(2.0), "x": x}], 3)
    assert d["x"].shape == (3, 3) and torch.equal(d["scale"], torch.tensor(2.0))
    out = collect_batches([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)], 2)
    assert [float(t) for t in out] == [1.0, 2.0]  # a 0-d batch is one row
    out = collect_batches([{"meta": "no tensor"}, {"meta": "again"}], 2)
    assert len(out) == 2  # a batch without a tensor counts as one row


def test_kept_batches_are_detached_copies_on_the_cpu():
    x = torch.randn(2, 3, requires_grad=True)
    (out,) = collect_batches([x * 2], 2)
    assert not out.requires_grad and out.device.type == "cpu"
    assert torch.equal(out, (x * 2).detach())


def test_no_batch_at_all_is_an_error_that_says_so():
    with pytest.raises(ValueError, match=r"^Calibration data is empty: the dataloader yielded no batch\.$"):
        collect_batches(iter([]), 4)


class _Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.calls: list[tuple] = []

    def forward(self, x=None, **kwargs):
        self.calls.append((x, kwargs, torch.is_grad_enabled()))
        return self.lin(x if x is not None else kwargs["input_ids"])


def test_default_forward_feeds_dicts_as_keywords_pairs_by_their_input_and_tensors_as_they_are():
    m, x = _Recorder(), torch.randn(2, 3)
    default_forward(m, {"input_ids": x})
    default_forward(m, (x, torch.zeros(2)))
    default_forward(m, [x, torch.zeros(2)])
    default_forward(m, x)
    (a, kw, _), (b, _, _), (c, _, _), (d, _, _) = m.calls
    assert a is None and kw["input_ids"] is x
    assert b is x and c is x and d is x


def test_a_model_without_parameters_is_fed_on_the_cpu():
    seen = []
    forward_batches(nn.ReLU(), [torch.randn(2, 3)], lambda m, b: seen.append(m(b).device))
    assert seen == [torch.device("cpu")]


def test_forward_batches_runs_every_batch_without_gradients():
    m = _Recorder()
    forward_batches(m, [torch.randn(2, 3), torch.randn(1, 3)], default_forward)
    assert [c[0].shape[0] for c in m.calls] == [2, 1]
    assert not any(grad for _, _, grad in m.calls)
    assert torch.is_grad_enabled()  # restored afterwards


def test_max_calibration_sets_each_amax_to_the_max_magnitude_seen():
    pytest.importorskip("modelopt")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    QATController(policy={"name": "t", "rules": [], "default": "fp8"}).prepare(m)
    batches = [torch.randn(4, 16) * 3, torch.randn(2, 16)]
    run_calibration(m, batches, None)
    assert m[0].input_quantizer.amax is None  # no algorithm: nothing calibrated
    run_calibration(m, batches, "max")
    x = torch.cat(batches).double()
    hidden = torch.relu(x @ m[0].weight.double().T + m[0].bias.double())
    expect = {"0.input_quantizer": x.abs().max(), "0.weight_quantizer": m[0].weight.double().abs().max(),
              "2.weight_quantizer": m[2].weight.double().abs().max()}  # fmt: skip
    for name, want in expect.items():
        got = dict(m.named_modules())[name].amax.double()
        assert torch.allclose(got, want, rtol=1e-6), name
    from modelopt.torch.quantization.mode import CalibrateModeRegistry

    if "mse_calibrate" in CalibrateModeRegistry:  # modelopt >= 0.4x (the nemo env's 0.37 has no MSE calibration)
        max_weight_amax = m[0].weight_quantizer.amax.clone()
        run_calibration(m, batches, "mse")  # the algorithm asked for runs, not modelopt's default
        assert not torch.equal(m[0].weight_quantizer.amax, max_weight_amax)
    # layer 2's input went through layer 0 as calibrated: FP8-quantized; its amax is within FP8's rounding
    got2 = m[2].input_quantizer.amax.double()
    assert torch.allclose(got2, hidden.abs().max(), rtol=0.07)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_samples": 0}, "num_samples must be a positive int, got 0"),
        ({"num_samples": 12.0}, "num_samples must be a positive int, got 12.0"),
        ({"seq_len": 0}, "seq_len must be a positive int or null, got 0"),
        ({"seq_len": "long"}, "seq_len must be a positive int or null, got 'long'"),
        ({"block_scale_search": 1.0}, r"block_scale_search must be true/false .* in \(0, 1\)"),
        ({"block_scale_search": 0}, r"block_scale_search must be true/false"),
        ({"block_scale_search": "yes"}, r"block_scale_search must be true/false"),
    ],
)
def test_bad_calibration_fields_are_refused_with_the_value(fields, message):
    with pytest.raises(ValueError, match=message):
        CalibrationConfig(**{"num_samples": 128, **fields})


def test_sample_counts_outside_100_to_500_warn_at_the_callers_line_and_inside_do_not(recwarn):
    for n in (100, 256, 500):
        CalibrationConfig(num_samples=n)
    assert not [w for w in recwarn if "representative samples" in str(w.message)]
    for n in (1, 99, 501):
        message = f"^Calibrating on {n} samples; 100-500 representative samples are recommended for stable amax\\.$"
        with pytest.warns(UserWarning, match=message) as caught:
            CalibrationConfig(num_samples=n)
        # points at the line that built the config (under mutmut its trampoline is one frame more: not checked)
        assert caught[0].filename == __file__ or "mutmut" in caught[0].filename
    assert CalibrationConfig(num_samples=128, block_scale_search=True).block_scale_search is True
    assert CalibrationConfig(num_samples=128, block_scale_search=0.5).block_scale_search == 0.5
    assert CalibrationConfig(num_samples=128, seq_len=1).seq_len == 1


def test_smoothing_is_resolved_into_its_config():
    from nemo_fp4qat.qat.calibration.smoothing import SmoothingConfig

    assert CalibrationConfig(num_samples=128, smoothing=0.6).smoothing == SmoothingConfig(alpha=0.6)
    assert CalibrationConfig(num_samples=128).smoothing is None


def test_resolve_spec_reads_counts_dicts_and_configs():
    assert CalibrationConfig.resolve_spec(None) == CalibrationConfig()
    cfg = CalibrationConfig(num_samples=300)
    assert CalibrationConfig.resolve_spec(cfg) is cfg
    assert CalibrationConfig.resolve_spec(256).num_samples == 256
    got = CalibrationConfig.resolve_spec({"_target_": "x", "num_samples": 200, "seq_len": 64})
    assert (got.num_samples, got.seq_len) == (200, 64)
    # any mapping (an OmegaConf DictConfig from a YAML file is one), not only a dict
    assert CalibrationConfig.resolve_spec(types.MappingProxyType({"num_samples": 300})).num_samples == 300
    with pytest.raises(ValueError) as info:
        CalibrationConfig.resolve_spec(True)
    assert str(info.value) == (
        "calibration=True is not understood; give a sample count (e.g. calibration=256), a dict of "
        "CalibrationConfig fields (e.g. {'num_samples': 256}) or a CalibrationConfig."
    )
    with pytest.raises(
        ValueError,
        match=r"Unknown calibration field\(s\) 'samples' \(did you mean 'num_samples'\?\); "
        r"CalibrationConfig has: num_samples",
    ):
        CalibrationConfig.resolve_spec({"samples": 3})
