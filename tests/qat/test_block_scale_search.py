"""Minimum-error NVFP4 block scales applied as a weight clip (#17).

The search is checked against a float64 brute force over the E4M3 scale codes (``reference_numerics``,
no code shared with the package), with the clipped weight quantized by modelopt's own export path
(``NVFP4QTensor``): the exporter must derive the searched scale from the clipped weights alone. The
controller applies it once per layer and format, to NVFP4 weights only.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from two_ranks import run_two_ranks

from nemo_fp4qat import QATController
from nemo_fp4qat.numerics.cpu_shims import modelopt_export_on_cpu
from nemo_fp4qat.numerics.fake_quant import fake_quant_nvfp4
from nemo_fp4qat.qat.calibration.block_scale_search import search_nvfp4_block_clip
from nemo_fp4qat.qat.calibration.calibrate import CalibrationConfig

from reference_numerics import minifloat_values, round_ref
from tiny_models import VOCAB, tiny_llama

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")

E4M3 = minifloat_values(4, 3)


def _weight(rows: int, blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    heavy = torch.randn(rows, 16 * blocks, generator=g) / torch.rand(rows, 16 * blocks, generator=g).clamp(min=0.05)
    return heavy * 0.02  # outliers in most blocks, as trained weights have


def _reference_block_errors(
    w: torch.Tensor, min_ratio: float, cw: torch.Tensor | None
) -> tuple[np.ndarray, np.ndarray]:
    """float64: each block's error (weighted per input channel by ``cw``) under the max rule and the least error
    over E4M3 scales in [min_ratio * s_max, s_max] (the block holding the tensor's max: its max-rule error only)."""
    x = w.double().numpy().reshape(w.shape[0], -1, 16)
    c = np.ones(w.shape[1]) if cw is None else cw.double().numpy()
    c = c.reshape(-1, 16)
    gs = np.float64(np.float32(np.float32(np.abs(x).max()) / np.float32(6 * 448)))
    max_rule, best = np.zeros(x.shape[:2]), np.zeros(x.shape[:2])
    top = np.abs(x).max()
    for r in range(x.shape[0]):
        for b in range(x.shape[1]):
            blk = np.abs(x[r, b])
            s_max = round_ref(np.array([blk.max() / 6 / gs]), 4, 3)[0]

            def err(s: float, blk: np.ndarray = blk, cb: np.ndarray = c[b]) -> float:
                return float((cb * (round_ref(blk / (s * gs), 2, 1) * s * gs - blk) ** 2).sum())

            max_rule[r, b] = err(s_max)
            cands = [s for s in E4M3 if min_ratio * s_max <= s <= s_max and s * gs >= 1e-5]
            best[r, b] = max_rule[r, b] if blk.max() == top else min(err(s) for s in cands)
    return max_rule, best


def _export_dequantized(clipped: torch.Tensor) -> torch.Tensor:
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    with modelopt_export_on_cpu():
        q, s, s2 = NVFP4QTensor.quantize(clipped, 16)
    return q.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16})


def _export_block_errors(clipped: torch.Tensor, w: torch.Tensor, cw: torch.Tensor | None) -> np.ndarray:
    """Each block's (weighted) error of what modelopt's exporter writes for ``clipped``, against the original."""
    deq = _export_dequantized(clipped)
    c = torch.ones(w.shape[1], dtype=torch.float64) if cw is None else cw.double()
    return ((deq.double() - w.double()).square() * c).reshape(w.shape[0], -1, 16).sum(-1).numpy()


@pytest.mark.parametrize(("seed", "min_ratio", "weighted"), [(0, 0.5, False), (1, 0.75, False), (2, 0.75, True),
                                                            (3, 0.5, True)])  # fmt: skip
def test_searched_scales_are_the_least_error_e4m3_codes_and_the_exporter_derives_them(seed, min_ratio, weighted):
    w = _weight(6, 5, seed)
    # per-input-channel weights of the error (a layer input's mean square), spread over two decades
    cw = 10 ** (2 * torch.rand(w.shape[1], generator=torch.Generator().manual_seed(seed + 50))) if weighted else None
    clipped, summary = search_nvfp4_block_clip(w, w.abs().amax(), 16, min_ratio, cw)
    max_rule, best = _reference_block_errors(w, min_ratio, cw)
    exported = _export_block_errors(clipped, w, cw)
    np.testing.assert_allclose(exported, best, rtol=1e-5, atol=1e-12)
    assert (best < max_rule * (1 - 1e-9)).sum() == summary.clipped > 0  # blocks whose scale the search lowered
    assert summary.blocks == 30
    np.testing.assert_allclose(summary.error_max_rule, max_rule.sum() / w.numel(), rtol=1e-5)
    np.testing.assert_allclose(summary.error_searched, best.sum() / w.numel(), rtol=1e-5)
    # the tensor max is kept (a per-tensor amax recomputed from the weights is the one searched with), and the
    # training fake quant computes the same as the exporter
    assert clipped.abs().max() == w.abs().max()
    torch.testing.assert_close(fake_quant_nvfp4(clipped, w.abs().amax()), _export_dequantized(clipped))


def test_bf16_weights_clip_to_the_same_codes():
    w = _weight(4, 8, 3)
    clipped, _ = search_nvfp4_block_clip(w.bfloat16(), w.bfloat16().abs().amax())
    ref, _ = search_nvfp4_block_clip(w.bfloat16().float(), w.bfloat16().float().abs().amax())
    assert clipped.dtype == torch.bfloat16
    amax = w.bfloat16().float().abs().amax()
    assert torch.equal(fake_quant_nvfp4(clipped.float(), amax), fake_quant_nvfp4(ref, amax))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(4)]


def _calibrated(search, schedule="direct", batches=None) -> tuple[QATController, torch.nn.Module]:
    model = tiny_llama(seed=2)
    ctl = QATController(policy="default", schedule=schedule, forward_fn=lambda m, b: m(b),
                        calibration={"num_samples": 6, "block_scale_search": search})  # fmt: skip
    ctl.prepare(model)
    ctl.calibrate(model, _batches() if batches is None else batches)
    return ctl, model


def _input_mean_squares(model: torch.nn.Module, names: set[str], batches) -> dict[str, torch.Tensor]:
    """Each layer's input mean square per channel over ``batches``, float64, by plain forward pre-hooks."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    mods = dict(model.named_modules())
    hooks = [mods[n].register_forward_pre_hook(lambda _m, a, n=n: seen[n].append(a[0].detach().double()))
             for n in names]  # fmt: skip
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    return {n: torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]).square().mean(0) for n, xs in seen.items()}


def test_calibration_clips_nvfp4_weights_once_and_nothing_else():
    """The default policy: each NVFP4 MLP weight is clipped to the blocks' least output-weighted error (each
    input channel weighted by its mean square on the calibration batches, measured here on the model without
    the search); FP8 attention, embeddings and norms are untouched; a second calibrate (a resume) does not clip
    the clipped weights again."""
    ctl, model = _calibrated(True)
    _, plain = _calibrated(False)
    mlp = {n for n, _ in model.named_modules() if n.endswith(("gate_proj", "up_proj", "down_proj"))}
    assert set(ctl.block_clips) == mlp and all(c.clipped > 0 for c in ctl.block_clips.values())
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, plain.state_dict()[k])}
    assert changed == {f"{n}.weight" for n in mlp}
    moments = _input_mean_squares(plain, mlp, _batches())
    mods, plain_mods = dict(model.named_modules()), dict(plain.named_modules())
    for n in mlp:
        w, amax = plain_mods[n].weight.detach(), plain_mods[n].weight_quantizer._amax
        expected, _ = search_nvfp4_block_clip(w, amax, 16, 0.75, moments[n].float())
        assert torch.equal(mods[n].weight.detach(), expected), n
        unweighted, _ = search_nvfp4_block_clip(w, amax, 16, 0.75)
        assert not torch.equal(expected, unweighted)  # the weighting changed the choice
    snapshot = copy.deepcopy(model.state_dict())
    ctl.calibrate(model)
    assert all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())


def test_a_disabled_nvfp4_weight_quantizer_is_not_searched():
    """A layer whose NVFP4 weight quantizer is switched off trains and deploys unquantized: no clip."""
    from nemo_fp4qat.qat.calibration.block_scale_search import clip_nvfp4_weights

    _, model = _calibrated(False)
    mods = dict(model.named_modules())
    off = "model.layers.0.mlp.down_proj"
    mods[off].weight_quantizer.disable()
    before = mods[off].weight.detach().clone()
    found = clip_nvfp4_weights(model)
    assert off not in found and "model.layers.1.mlp.down_proj" in found
    assert torch.equal(mods[off].weight.detach(), before)


def test_a_progressive_run_searches_at_the_switch_to_nvfp4():
    schedule = {"stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "nvfp4"}]}
    ctl, model = _calibrated(True, schedule)
    assert ctl.block_clips == {}  # FP8 weights: nothing to search
    before = copy.deepcopy(model.state_dict())
    ctl.step(model, 0)
    ctl.step(model, 1)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    ctl.step(model, 2)
    mlp = {n for n, _ in model.named_modules() if n.endswith(("gate_proj", "up_proj", "down_proj"))}
    assert set(ctl.block_clips) == mlp
    after = copy.deepcopy(model.state_dict())
    ctl.step(model, 3)  # no switch: no second search
    assert all(torch.equal(v, after[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("bad", [1.5, 0.0, "yes", None])
def test_a_bad_setting_names_the_fix(bad):
    with pytest.raises(ValueError, match=r"block_scale_search must be true/false or the lowest block scale.*\(0, 1\)"):
        CalibrationConfig(num_samples=128, block_scale_search=bad)
    assert CalibrationConfig(num_samples=128, block_scale_search=0.6).block_scale_search == 0.6


def _dp_worker(rank: int, init: str, out: dict) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        model = tiny_llama(seed=2)  # the same replica on both ranks, calibrated on different samples
        ctl = QATController(policy="default", schedule="direct", forward_fn=lambda m, b: m(b),
                            calibration={"num_samples": 6, "block_scale_search": True})  # fmt: skip
        ctl.prepare(model)
        ctl.calibrate(model, _batches()[rank::2])
        out[rank] = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("proj.weight")}
    finally:
        dist.destroy_process_group()


def test_data_parallel_ranks_clip_alike(tmp_path):
    """Two gloo ranks calibrating on different batches must clip their replicas identically (else the replicas
    drift apart): the input moments are summed over the ranks, as one process calibrating on both ranks'
    batches measures them (rank 0 in the test process: tests/two_ranks.py)."""
    res = run_two_ranks(_dp_worker, f"file://{tmp_path / 'store'}")
    r0, r1 = res[0], res[1]
    _, alone = _calibrated(True)  # one process, every batch
    _, rank0_alone = _calibrated(True, batches=_batches()[0::2])
    for k, v in r0.items():
        assert torch.equal(v, r1[k]), k
        assert torch.equal(v, alone.state_dict()[k]), k
    assert any(not torch.equal(v, rank0_alone.state_dict()[k]) for k, v in r0.items())  # the sums mattered


def test_small_block_scales_reach_the_smallest_e4m3_codes():
    """Blocks far below the tensor's max get scale codes among E4M3's subnormals (down to code 1): the search
    goes there too, and still matches the float64 brute force."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(4, 96, generator=g) * 1e-3
    w[0, 0] = 100.0  # the tensor max: global scale 100 / 2688, so 1e-3 blocks sit at codes 1-3
    clipped, summary = search_nvfp4_block_clip(w, w.abs().amax(), 16, 0.05)
    max_rule, best = _reference_block_errors(w, 0.05, None)
    np.testing.assert_allclose(_export_block_errors(clipped, w, None), best, rtol=1e-5, atol=1e-15)
    assert summary.clipped == (best < max_rule * (1 - 1e-9)).sum() > 0


def test_an_unusable_amax_leaves_the_weight_as_it_is_and_reports_no_clip():
    from nemo_fp4qat.qat.calibration.block_scale_search import BlockClip

    w = _weight(3, 4, 5)
    for weight, amax in ((torch.zeros(3, 64), torch.tensor(0.0)), (w, torch.tensor(0.0)),
                         (w, torch.tensor(float("inf"))), (w, torch.tensor(float("nan")))):  # fmt: skip
        clipped, summary = search_nvfp4_block_clip(weight, amax)
        assert torch.equal(clipped, weight) and clipped is not weight
        assert summary == BlockClip(blocks=12, clipped=0, error_max_rule=0.0, error_searched=0.0)


def test_the_amax_given_is_the_one_searched_with_and_none_means_the_weights_own():
    w = _weight(4, 4, 6)
    own, _ = search_nvfp4_block_clip(w, w.abs().amax(), 16)
    assert torch.equal(search_nvfp4_block_clip(w, None)[0], own)  # also: block 16 is the default
    assert torch.equal(search_nvfp4_block_clip(w, w.abs().amax())[0], own)
    wider, _ = search_nvfp4_block_clip(w, w.abs().amax() * 3)
    assert not torch.equal(wider, own)  # another global scale: other block scales


def test_a_nan_weight_does_not_move_its_blocks_scale():
    """A NaN counts as 0 in its block's search: the block is clipped as if the NaN were 0 (the NaN itself stays)."""
    w = _weight(2, 3, 7)
    amax = w.abs().amax()
    ref, _ = search_nvfp4_block_clip(w, amax)
    changed = (ref != w).reshape(2, 3, 16).any(-1).nonzero()[0].tolist()  # a block the search clipped
    r, b = changed
    blk = w[r, 16 * b : 16 * b + 16].abs()
    i = 16 * b + int(blk.argmin())  # its smallest element (not the clipped max) becomes NaN
    bad, zero = w.clone(), w.clone()
    bad[r, i], zero[r, i] = float("nan"), 0.0
    got, _ = search_nvfp4_block_clip(bad, amax)
    want, _ = search_nvfp4_block_clip(zero, amax)
    assert torch.isnan(got[r, i])
    got[r, i] = 0.0
    assert torch.equal(got, want) and not torch.equal(want[r, 16 * b : 16 * b + 16], zero[r, 16 * b : 16 * b + 16])


def test_a_block_whose_best_scale_is_the_smallest_e4m3_code_gets_it():
    """E4M3's smallest subnormal (code 1) is a candidate: a block exact at that scale, whose max sits in a channel
    the layer's input never uses (error weight ~0), is best clipped from code 2 down to code 1."""
    w = torch.randn(2, 32, generator=torch.Generator().manual_seed(12)) * 0.01
    w[1, 0] = 100.0  # the tensor max, in another block: global scale 100 / 2688
    gs = float(np.float32(np.float32(100.0) / np.float32(6 * 448)))
    s1 = 2.0**-9 * gs  # code 1 times the global scale (exact: a power of two)
    w[0, :16] = torch.tensor([0.5, 1.5, 3.0, -0.5, -1.5, -3.0, 0.5, 1.5, 3.0, 1.0, 0.5, 1.5, 3.0, 2.0, 4.0, 12.0]) * s1
    cw = torch.ones(32)
    cw[15] = 1e-9
    clipped, summary = search_nvfp4_block_clip(w, w.abs().amax(), 16, 0.25, cw)
    max_rule, best = _reference_block_errors(w, 0.25, cw)
    assert best[0, 0] < max_rule[0, 0] * 1e-3  # the brute force's best: code 1 (the block exact there)
    np.testing.assert_allclose(_export_block_errors(clipped, w, cw), best, rtol=1e-5, atol=1e-30)
    assert (best < max_rule * (1 - 1e-9)).sum() == summary.clipped
    assert float(clipped[0, 15]) == float(np.float32(6 * s1))  # clipped to code 1's largest value


def test_rows_that_end_in_a_partial_block_are_searched_as_zero_padded():
    w = _weight(3, 3, 8)[:, :40]  # 2.5 blocks per row
    padded = torch.nn.functional.pad(w, (0, 8))
    got, _ = search_nvfp4_block_clip(w, w.abs().amax())
    ref, _ = search_nvfp4_block_clip(padded, w.abs().amax())
    assert got.shape == w.shape and torch.equal(got, ref[:, :40])


def test_an_uncalibrated_nvfp4_layer_is_skipped_and_the_rest_are_clipped():
    from nemo_fp4qat.qat.calibration.block_scale_search import clip_nvfp4_weights

    _, model = _calibrated(False)
    mods = dict(model.named_modules())
    first = "model.layers.0.mlp.gate_proj"  # the first NVFP4 layer in module order
    mods[first].weight_quantizer.reset_amax()
    before = mods[first].weight.detach().clone()
    found = clip_nvfp4_weights(model)
    mlp = {n for n in mods if n.endswith(("gate_proj", "up_proj", "down_proj"))}
    assert set(found) == mlp - {first}
    assert torch.equal(mods[first].weight.detach(), before)


def test_input_moments_are_each_layers_mean_square_over_every_batch_for_the_layers_asked():
    from nemo_fp4qat.qat.calibration.block_scale_search import input_second_moments

    _, model = _calibrated(False)
    batches = [b[:, : 4 + 3 * i] for i, b in enumerate(_batches())]  # batches of different token counts
    wanted = {"model.layers.1.mlp.down_proj", "model.layers.0.mlp.up_proj"}
    got = input_second_moments(model, batches, lambda m, b: m(b), modules=wanted)
    assert set(got) == wanted
    ref = _input_mean_squares(model, wanted, batches)
    for n in wanted:
        torch.testing.assert_close(got[n], ref[n].float(), rtol=1e-6, atol=0)
