"""Cross-rank amax sync on two real gloo processes: MAX of every per-tensor and per-channel amax, and a
clear error (not a hang) when the ranks hold different quantizers."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from two_ranks import run_two_ranks

# core environment only: plain-torch ranks; under modelopt 0.37 the sync is tested by the NeMo two-process runs


def _model(rank: int, mismatch: bool) -> nn.Module:
    from nemo_fp4qat import QATController
    from nemo_fp4qat.qat.calibration.calibrate import run_calibration

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
    # layer 0: INT8 weight-only, per-output-channel amax; layer 1: FP8 weights + inputs, per-tensor amax
    policy = {"name": "t", "rules": [{"patterns": ["1"], "weight": "fp8"}], "default": "int8_wo"}
    QATController(policy=policy).prepare(m)
    run_calibration(m, [torch.randn(4, 16)], "max", lambda mm, b: mm(b))  # modelopt syncs these already
    g = torch.Generator().manual_seed(100 + rank)
    for q in m.modules():
        if getattr(q, "_amax", None) is not None:  # amax that drifted apart per rank (e.g. weights recomputed)
            q.amax = torch.rand(q.amax.shape, generator=g) + 0.5
    if mismatch and rank == 1:
        m[1].input_quantizer.reset_amax()  # this rank lost a quantizer's amax
    return m


def _amaxes(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: q.amax.clone() for n, q in m.named_modules() if getattr(q, "_amax", None) is not None}


def _tensor_parallel(rank: int) -> dict:
    """Both layers as tensor-parallel shards (modelopt's parallel state names a 2-rank TP group): layer 0's
    per-channel amax holds this rank's output channels and must stay; layer 1's per-tensor amaxes are synced.
    Then with a TP group of one rank (TP size 1: every rank holds every channel) all three are synced."""
    from modelopt.torch.utils.distributed import ParallelState

    from nemo_fp4qat.qat.calibration.calibrate import sync_amax_across_ranks

    m = _model(rank, mismatch=False)
    for layer in m:
        layer._parallel_state = ParallelState(data_parallel_group=None, tensor_parallel_group=None)  # None: world
    before = _amaxes(m)
    n = sync_amax_across_ranks(m)
    singles = [dist.new_group([r]) for r in range(2)]  # every rank creates every group, in the same order
    one = _model(rank, mismatch=False)
    for layer in one:
        layer._parallel_state = ParallelState(data_parallel_group=None, tensor_parallel_group=singles[rank])
    return {"n": n, "before": before, "after": _amaxes(m), "n_tp1": sync_amax_across_ranks(one)}


def _worker(rank: int, init: str, mode: str, out: dict) -> None:
    from nemo_fp4qat.qat.calibration.calibrate import sync_amax_across_ranks

    # a timeout, so a rank whose peer left raises instead of waiting forever in the collective
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        m = _model(rank, mismatch=(mode == "mismatch"))
        before = _amaxes(m)
        try:
            n = sync_amax_across_ranks(m)
        except RuntimeError as e:
            out[rank] = {"error": str(e)}
            return
        out[rank] = {"n": n, "before": before, "after": _amaxes(m), "tp": _tensor_parallel(rank),
                     "empty": sync_amax_across_ranks(nn.Linear(2, 2))}  # fmt: skip
    finally:
        dist.destroy_process_group()


def _run(tmp_path, mode):
    return run_two_ranks(_worker, f"file://{tmp_path / 'store'}", mode)


def test_amax_becomes_the_max_over_ranks_and_a_tensor_parallel_shard_keeps_its_channels(tmp_path):
    """One two-rank run (the sync runs inside the test itself, where mutmut attributes what it reaches)."""
    pytest.importorskip("modelopt")
    res = _run(tmp_path, "same")
    r0, r1 = res[0], res[1]
    assert r0["n"] == r1["n"] == len(r0["before"]) == 3  # layer 0 weight, layer 1 weight and input
    for name in r0["before"]:
        expect = torch.maximum(r0["before"][name], r1["before"][name])
        assert not torch.equal(r0["before"][name], r1["before"][name])  # the ranks really differed
        assert torch.equal(r0["after"][name], expect) and torch.equal(r1["after"][name], expect)
    assert r0["before"]["0.weight_quantizer"].numel() == 8  # per-channel amax took part too
    assert r0["empty"] == r1["empty"] == 0  # nothing to sync: no collective, nothing counted
    # layer 0 as a tensor-parallel shard: its per-channel amax stays, the per-tensor ones are synced
    t0, t1 = r0["tp"], r1["tp"]
    assert t0["n"] == t1["n"] == 2
    assert t0["n_tp1"] == t1["n_tp1"] == 3  # a TP group of one rank shards nothing: all three synced
    for t in (t0, t1):
        assert torch.equal(t["after"]["0.weight_quantizer"], t["before"]["0.weight_quantizer"])
    for name in ("1.weight_quantizer", "1.input_quantizer"):
        expect = torch.maximum(t0["before"][name], t1["before"][name])
        assert torch.equal(t0["after"][name], expect) and torch.equal(t1["after"][name], expect)


def test_without_a_process_group_the_sync_is_a_no_op():
    pytest.importorskip("modelopt")
    from nemo_fp4qat.qat.calibration.calibrate import sync_amax_across_ranks

    assert not dist.is_initialized()
    m = _model(0, mismatch=False)
    before = _amaxes(m)
    assert sync_amax_across_ranks(m) == 0
    after = _amaxes(m)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_ranks_with_different_quantizers_get_an_error_naming_the_cause(tmp_path):
    pytest.importorskip("modelopt")
    res = _run(tmp_path, "mismatch")
    for r in (0, 1):
        assert "hold different quantizer amax buffers" in res[r]["error"]
        assert res[r]["error"].endswith(
            "Every rank must prepare and calibrate the same model with the same policy and schedule."
        )
    # rank 1 lost layer 1's input amax: the message counts the buffers and names the one that differs
    assert res[0]["error"].startswith(
        "Rank 0 and rank 1 of its group hold different quantizer amax buffers (3 vs 2; first differences "
        "[('1.input_quantizer', ())])."
    )
