"""The validator's numeric check (`export/weight_check.compare_weights`) on hand-built NVFP4 layers: packed
E2M1 codes with E4M3 block scales whose trained counterpart is written here from the codes in float64 (the
format's definition), not from the code under test. What it must do: accept exactly the trained grid
point, count and name any other code (also in a block whose scale product is exactly 1), excuse only the
all-zero blocks below the training kernel's minimum scale (and say so), and keep its counts across layers."""

from __future__ import annotations

import pytest
import torch

from nemo_fp4qat.export.validation_report import ValidationReport
from nemo_fp4qat.export.weight_check import compare_weights

from reference_numerics import e2m1_code_value

pytestmark = pytest.mark.twice("modelopt 0.37's exporters write what NeMo's export path deploys")


def _layer(codes: torch.Tensor, scales: list[list[float]], gs: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """NVFP4 tensors of ``codes`` [rows, 16 * blocks] (E4M3-exact block ``scales``, global scale ``gs``) and the
    trained weight they encode, in float64."""
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    sc = torch.tensor(scales, dtype=torch.float64)
    assert torch.equal(sc.to(torch.float8_e4m3fn).double(), sc)  # the test's scales are E4M3 values
    vals = torch.tensor([[e2m1_code_value(int(c)) for c in row] for row in codes], dtype=torch.float64)
    ref = vals * sc.repeat_interleave(16, dim=1) * gs
    t = {"weight": packed, "weight_scale": sc.to(torch.float8_e4m3fn), "weight_scale_2": torch.tensor(gs)}
    return t, ref


def _codes(rows: int, blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (rows, 16 * blocks), generator=g, dtype=torch.uint8)


def _report() -> ValidationReport:
    return ValidationReport(path="x", kind="hf", quant_algo="NVFP4", kv_cache_quant_algo=None, runtime="trtllm")


def test_the_trained_grid_points_pass_and_counts_add_up_over_layers():
    rep = _report()
    for seed in (0, 1):
        t, ref = _layer(_codes(4, 3, seed), [[1.0, 2.5, 448.0]] * 4, gs=0.01)
        compare_weights(rep, f"layer{seed}", "NVFP4", t, ref)
    assert rep.ok, rep.errors
    assert rep.numeric["layers_compared"] == 2 and rep.numeric["fp4_codes_compared"] == 2 * 4 * 48
    assert rep.numeric["fp4_codes_different"] == 0 and rep.numeric["max_rel_error"] <= 2e-6


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_a_code_one_step_away_is_counted_and_named(scale):
    """Also when the block's scale product is exactly 1 (a check that skipped scale-1 blocks would pass it)."""
    codes = _codes(2, 2, 3)
    codes[codes % 8 == 0] = 1  # no +-0 codes: a +-1 change is always a different value
    t, ref = _layer(codes, [[scale, scale]] * 2, gs=1.0)
    bad = codes.clone()
    bad[1, 5] = bad[1, 5] ^ 1  # flip the mantissa bit: the neighbouring grid point
    bad[0, 20] = bad[0, 20] ^ 1
    t_bad, _ = _layer(bad, [[scale, scale]] * 2, gs=1.0)
    rep = _report()
    compare_weights(rep, "ok", "NVFP4", t, ref)
    compare_weights(rep, "m", "NVFP4", t_bad, ref)
    compare_weights(rep, "n", "NVFP4", t_bad, ref)  # counts add up over layers
    assert rep.numeric["fp4_codes_different"] == 4 and rep.numeric["fp4_codes_compared"] == 3 * 64
    assert [(p.tensor, p.message) for p in rep.errors] == [
        (f"{m}.weight", "2 of 64 FP4 codes differ from the trained fake-quant weights.") for m in "mn"
    ]


def test_a_scale_off_by_a_little_fails_the_relative_error_check():
    t, ref = _layer(_codes(2, 2, 4), [[2.0, 2.0]] * 2, gs=0.5)
    rep = _report()
    compare_weights(rep, "m", "NVFP4", t, ref * (1 + 5e-6))  # same codes, values 5e-6 off
    assert rep.numeric["fp4_codes_different"] == 0
    assert len(rep.errors) == 1 and rep.errors[0].tensor == "m.weight"
    assert "max rel error 5e-06, allowed 2e-06" in rep.errors[0].message
    assert rep.numeric["max_rel_error"] == pytest.approx(5e-6, rel=1e-3)
    compare_weights(rep, "exact", "NVFP4", t, ref)  # the report keeps the largest error over layers
    assert rep.numeric["max_rel_error"] == pytest.approx(5e-6, rel=1e-3) and len(rep.errors) == 1


def test_unpack_failures_and_shape_mismatches_are_named():
    t, ref = _layer(_codes(2, 1, 5), [[1.0], [1.0]], gs=1.0)
    rep = _report()
    compare_weights(rep, "a", "NVFP4", {"weight": t["weight"]}, ref)  # no scales
    compare_weights(rep, "b", "NVFP4", t, ref[:, :8])
    assert [p.tensor for p in rep.errors] == ["a.weight", "b.weight"]
    assert rep.errors[0].message.startswith("cannot be unpacked as NVFP4: ")
    assert rep.errors[1].message == "unpacks to shape (2, 16) but the model's weight is (2, 8)."
    assert "layers_compared" not in rep.numeric


GS = 2.0**-7  # the training floor is then max(1e-5, 2**-9 * gs) = 2**-16, an exact E4M3 x gs product


def test_only_all_zero_blocks_at_or_below_the_training_floor_are_excused():
    """Block 0: scale 2**-9 (x gs = 2**-16, the floor), zero in training, non-zero codes: excused. Block 1: the
    same but scale 2**-8, above the floor: an error. Block 2: at the floor but not zero in training: compared
    (and right). Row 1: the floor block agrees with training (codes 0): nothing to excuse."""
    codes = _codes(2, 3, 6)
    codes[codes % 8 == 0] = 2  # no +-0 codes: every code of a block that is 0 in training differs
    codes[1, :16] = 0
    scales = [[2.0**-9, 2.0**-8, 2.0**-9], [2.0**-9, 1.0, 1.0]]
    t, ref = _layer(codes, scales, GS)
    ref[0, :32] = 0.0  # what training's kernel gives blocks whose scale is below its minimum
    rep = _report()
    compare_weights(rep, "m", "NVFP4", t, ref)
    assert rep.numeric["fp4_tiny_blocks_excused"] == 1
    assert rep.numeric["fp4_codes_different"] == 16  # block 1's
    assert [p.tensor for p in rep.errors] == ["m.weight"]
    assert [(p.tensor, p.message) for p in rep.warnings] == [
        (
            "m.weight",
            "1 block(s) of values below 9.2e-05 are 0 in training (modelopt's kernel scale rule) but kept by "
            "modelopt's exporter; the difference is below that bound.",
        )
    ]
    # a second layer adds to the count
    t2, ref2 = _layer(codes[:1], scales[:1], GS)
    ref2[0, :16] = 0.0
    compare_weights(rep, "n", "NVFP4", t2, ref2)
    assert rep.numeric["fp4_tiny_blocks_excused"] == 2


def test_the_reference_is_the_fake_quantized_weight_in_its_training_dtype_and_none_without_a_quantizer():
    """HF model exported to a TensorRT-LLM checkpoint: qkv is [q; k; v] of the fake-quantized weights, in the
    dtype training computed them in (the comparison allows that dtype's rounding); a layer of the given model that
    has no weight quantizer (a model
    that does not match the export) has no reference instead of failing the validation with an exception."""
    from nemo_fp4qat.export.weight_check import model_reference

    from tiny_models import calibrated_tiny_llama

    model = calibrated_tiny_llama("nvfp4")
    mods = dict(model.named_modules())
    attn = "model.layers.0.self_attn"
    with torch.no_grad():
        want = torch.cat([mods[f"{attn}.{p}_proj"].weight_quantizer(mods[f"{attn}.{p}_proj"].weight) for p in "qkv"], 0)
    ref = model_reference(mods, "transformer.layers.0.attention.qkv", "trtllm", {}, set())
    assert ref.dtype == torch.float32 and torch.equal(ref, want)
    assert model_reference(mods, f"{attn}.q_proj", "hf", {}, set()).dtype == torch.float32
    mods[f"{attn}.v_proj"] = torch.nn.Linear(4, 4)  # no quantizer
    assert model_reference(mods, "transformer.layers.0.attention.qkv", "trtllm", {}, set()) is None
    assert model_reference(mods, f"{attn}.v_proj", "hf", {}, set()) is None


def test_a_changed_smoothing_scale_is_detected_to_one_part_in_a_million():
    """The exporter re-smoothed a layer when its pre_quant_scale is not the trained one (then its weights were
    requantized and are not compared); equal scales, or no smoothing at all, are not re-smoothing."""
    from nemo_fp4qat.export.weight_check import resmoothed

    g = torch.Generator().manual_seed(7)
    trained = torch.rand(64, generator=g, dtype=torch.float64) + 0.5
    mod = torch.nn.Module()
    mod.input_quantizer = torch.nn.Module()
    mod.input_quantizer._pre_quant_scale = trained.float()
    mods = {"m": mod}
    assert not resmoothed(mods, "m", {"pre_quant_scale": trained.float().clone()})
    assert resmoothed(mods, "m", {"pre_quant_scale": (trained * (1 + 3e-6)).float()})
    assert resmoothed(mods, "m", {})  # the exporter dropped it (folded into the norm)
    plain = torch.nn.Module()
    plain.input_quantizer = torch.nn.Module()  # a quantizer with no smoothing scale
    assert not resmoothed({"p": plain}, "p", {}) and not resmoothed({}, "absent", {})
