"""FP4 QAT through Megatron-Bridge's own training loop (real Megatron-Bridge 0.6.2 on the CPU, gloo).

Each run is a subprocess (``tests/workers/bridge_trainer_worker.py``): Bridge's ``pretrain`` initializes
torch.distributed and megatron's global state once per process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bridge_runs import run_bridge_worker as _run
from export_compare import assert_same_export

# Embedding rows of tokens the batches barely use get gradients near float32 noise, which Adam normalises into
# steps that differ with each shape's summation order (measured on an Intel Xeon: one element of 16384 off by
# 9e-5, three float16 ulps, after TP 2 QAD). A wrong merge of the vocabulary shards moves whole rows by their size.
RARE_TOKEN_ROWS = {"vocab_embedding.weight": 1e-4}

pytestmark = pytest.mark.bridge


def test_bridge_qat_calibrates_switches_resumes_exactly_and_exports(tmp_path):
    # the uninterrupted run is monitored (the resumed runs are not: the monitor must not change training)
    full = _run(tmp_path, "full", tmp_path / "full_ckpt", STEPS=5, SAVE_INTERVAL=100, SWITCH_AT=2,
                EXPORT_DIR=tmp_path / "export", MONITOR=0.05)  # fmt: skip
    # calibrated before the first step, FP8 for steps 1-2, NVFP4 (dynamic E2M1 blocks) from step 3
    assert full["formats"]["1"] == ["(4, 3)", False] and full["formats"]["2"] == ["(4, 3)", False]
    assert full["formats"]["3"] == ["(2, 1)", True] and full["formats"]["5"] == ["(2, 1)", True]
    assert [(h["step"], h["from"], h["to"]) for h in full["history"]][:1] == [(2, "fp8", "nvfp4")]
    assert "calibrated on" in full["log"]
    assert full["fc1_input_amax"] > 0 and full["fc1_weight_amax"] > 0
    assert len(full["losses"]) == 5 and all(v == v for v in full["losses"].values())
    # measured every 2 steps, at the switch (after step 2, seen at step 3) and at the end; FP8's weight error is
    # under the 0.05 threshold, NVFP4's (~0.1) above it: findings from the switch on only
    mon = full["monitor"]
    assert mon["measured"] == [[2, "bf16+fp8"], [3, "bf16+nvfp4"], [4, "bf16+nvfp4"], [5, "bf16+nvfp4"]], mon
    assert mon["findings"] and {p for _, p in mon["findings"]} == {"high_weight_error"}, mon
    assert min(s for s, _ in mon["findings"]) == 3, mon
    report = json.loads(Path(mon["report"]).read_text())
    assert len(report["measurements"]) == 4 and len(report["findings"]) == len(mon["findings"])
    # the end-of-training export is a TensorRT-LLM checkpoint the validator accepts code for code
    export = full["export"]
    assert export["ok"], export["errors"]
    assert export["algo"] == "NVFP4", export  # fp_embeddings: every linear NVFP4, embeddings and output 16-bit
    # 2 layers x (qkv, dense, fc, gate, proj): TensorRT-LLM splits the gated fc1 into fc and gate
    assert sum(a == "NVFP4" for a in export["layers"].values()) == 10, export["layers"]
    # checked against the trained model at export: every FP4 code is the one training used
    assert export["numeric"]["layers_compared"] == 10 and export["numeric"]["fp4_codes_different"] == 0

    # killed after step 3 (checkpoint there), resumed: steps 4-5 as in the uninterrupted run, bit for bit
    ckpt = tmp_path / "ckpt"
    first = _run(tmp_path, "first", ckpt, STEPS=5, SAVE_INTERVAL=3, EXIT_AT=3, SWITCH_AT=2)
    assert sorted(first["losses"]) == ["1", "2", "3"]
    assert (ckpt / "iter_0000003" / "nemo_fp4qat_state.pt").exists()
    resumed = _run(tmp_path, "resumed", ckpt, STEPS=5, SAVE_INTERVAL=100, SWITCH_AT=2)
    assert resumed["resumed"] is True
    assert sorted(resumed["losses"]) == ["4", "5"]
    for step in ("1", "2", "3"):
        assert first["losses"][step] == full["losses"][step]
    for step in ("4", "5"):
        assert resumed["losses"][step] == full["losses"][step], (step, resumed["losses"], full["losses"])
        assert resumed["formats"][step] == full["formats"][step]
    for key in ("fc1_weight_amax", "fc1_input_amax", "fc1_weight_sum"):
        assert resumed[key] == full[key], key


@pytest.mark.slow_bridge
def test_bridge_qad_distils_from_the_loaded_model_and_resumes_from_the_same_teacher(tmp_path):
    full = _run(tmp_path, "full", tmp_path / "full_ckpt", STEPS=5, SAVE_INTERVAL=100, SWITCH_AT=2, QAD=1)
    plain = _run(tmp_path, "plain", tmp_path / "plain_ckpt", STEPS=1, SAVE_INTERVAL=100, SWITCH_AT=2)
    assert "QAD teacher (a copy of the model as loaded, quantizers off)" in full["log"]
    # the loss Bridge reports is the KL to the full-precision copy, not the cross entropy on random tokens
    assert full["losses"]["1"] < 0.05 < 1.0 < plain["losses"]["1"], (full["losses"], plain["losses"])
    assert all(v == v and v >= 0 for v in full["losses"].values())

    ckpt = tmp_path / "ckpt"
    first = _run(tmp_path, "first", ckpt, STEPS=5, SAVE_INTERVAL=3, EXIT_AT=3, SWITCH_AT=2, QAD=1)
    assert (ckpt / "nemo_fp4qat_teacher.pt").exists()
    resumed = _run(tmp_path, "resumed", ckpt, STEPS=5, SAVE_INTERVAL=100, SWITCH_AT=2, QAD=1)
    assert "QAD teacher (restored from" in resumed["log"]
    for step in ("1", "2", "3"):
        assert first["losses"][step] == full["losses"][step]
    for step in ("4", "5"):  # the same teacher (not a copy of the trained student): the same KL, bit for bit
        assert resumed["losses"][step] == full["losses"][step], (step, resumed["losses"], full["losses"])
    assert resumed["fc1_weight_sum"] == full["fc1_weight_sum"]


def test_bridge_qad_at_tensor_parallel_2_matches_tp_1_and_resumes_exactly(tmp_path):
    """QAD at TP=2 (two gloo ranks, the teacher a copy sharded like the student, the KL over vocabulary-parallel
    logits) reports the TP=1 run's losses on the same data within 1e-5 relative; its end-of-training export (the
    shards merged on rank 0) equals the TP=1 run's code for code; killed after step 2 and resumed
    (each rank restoring its own shard of the teacher), steps 3-4 equal the uninterrupted TP=2 run bit for bit."""
    common = dict(STEPS=4, SWITCH_AT=0, QAD=1)  # NVFP4 from the first step: a KL well above float32's noise
    one = _run(tmp_path, "tp1", tmp_path / "tp1_ckpt", SAVE_INTERVAL=100, TP=1, EXPORT_DIR=tmp_path / "e1", **common)
    two = _run(tmp_path, "tp2", tmp_path / "tp2_ckpt", nproc=2, SAVE_INTERVAL=100, TP=2, EXPORT_DIR=tmp_path / "e2",
               **common)  # fmt: skip
    assert (one["tp"], [r["tp"] for r in two["ranks"]]) == (1, [2, 2])
    assert two["ranks"][0]["losses"] == two["ranks"][1]["losses"]  # every rank holds the whole per-token KL
    assert sorted(one["losses"]) == sorted(two["losses"]) == ["1", "2", "3", "4"]
    for step, loss in one["losses"].items():
        assert 0 < loss < 1.0 and abs(two["losses"][step] - loss) <= 1e-5 * loss, (step, one["losses"], two["losses"])
    # the end-of-training export at TP=2: the shards merged on rank 0 (the gated fc1's gate and up rows each)
    assert_same_export(two["export"]["path"], one["export"]["path"], layers=10, atol=RARE_TOKEN_ROWS)

    ckpt = tmp_path / "ckpt"
    first = _run(tmp_path, "first", ckpt, nproc=2, SAVE_INTERVAL=2, EXIT_AT=2, TP=2, **common)
    assert {p.name for p in ckpt.glob("nemo_fp4qat_teacher*.pt")} == {"nemo_fp4qat_teacher.tp0.pt",
                                                                      "nemo_fp4qat_teacher.tp1.pt"}  # fmt: skip
    resumed = _run(tmp_path, "resumed", ckpt, nproc=2, SAVE_INTERVAL=100, TP=2, **common)
    assert "QAD teacher (restored from" in resumed["log"]
    assert first["losses"] == {s: two["losses"][s] for s in ("1", "2")}
    for rank in (0, 1):
        got, want = resumed["ranks"][rank], two["ranks"][rank]
        assert got["losses"] == {s: want["losses"][s] for s in ("3", "4")}, (rank, got["losses"], want["losses"])
        assert got["fc1_weight_sum"] == want["fc1_weight_sum"]


def _last_stage(run):
    """The losses of a run's last pipeline stage (every one of its tensor-parallel ranks reports the same)."""
    ranks = run.get("ranks") or [run]
    last = [r["losses"] for r in ranks if r["losses"]]
    assert last and all(x == last[0] for x in last), last
    return last[0]


@pytest.mark.parametrize(
    ("shape", "reference"),
    # make test keeps Bridge's pipeline-parallel QAT (test_bridge_pipeline_parallel_qat_matches_pp_1...); QAD under
    # pipeline parallelism runs in make test-bridge-all
    [pytest.param({"PP": 2, "TP": 1}, {"PP": 1, "TP": 1}, marks=pytest.mark.slow_bridge),
     pytest.param({"PP": 2, "TP": 2}, {"PP": 1, "TP": 2}, marks=pytest.mark.slow_bridge)],
    ids=["pp2", "tp2xpp2"],
)  # fmt: skip
def test_bridge_qad_under_pipeline_parallelism_matches_one_stage_and_resumes_exactly(tmp_path, shape, reference):
    """QAD at PP=2 (and TP 2 x PP 2): each stage's teacher (a copy of the stage as loaded) runs beside the student's
    stage, handing its hidden states on over its own process group; the last stage's KL equals the one-stage run's
    on the same data within 1e-5 relative at every step; the end-of-training export (stages and shards assembled
    on rank 0) equals the one-stage run's, code for code; killed after step 2 and resumed (each stage restoring its
    own part of the teacher), steps 3-4 equal the uninterrupted run bit for bit on every rank."""
    common = dict(STEPS=4, SWITCH_AT=0, QAD=1)  # NVFP4 from the first step: a KL well above float32's noise
    n = shape["TP"] * shape["PP"]
    one = _run(tmp_path, "one", tmp_path / "one_ckpt", nproc=reference["TP"], SAVE_INTERVAL=100, **reference,
               EXPORT_DIR=tmp_path / "e1", **common)  # fmt: skip
    staged = _run(tmp_path, "staged", tmp_path / "staged_ckpt", nproc=n, SAVE_INTERVAL=100, **shape,
                  EXPORT_DIR=tmp_path / "e2", **common)  # fmt: skip
    assert [(r["tp"], r["pp"]) for r in staged["ranks"]] == [(shape["TP"], 2)] * n
    want, got = _last_stage(one), _last_stage(staged)
    assert sorted(want) == sorted(got) == ["1", "2", "3", "4"]
    for step, loss in want.items():
        assert 0 < loss < 1.0 and abs(got[step] - loss) <= 1e-5 * loss, (step, want, got)
    # the stages (and their tensor-parallel shards) assembled on rank 0
    assert_same_export(staged["export"]["path"], one["export"]["path"], layers=10, atol=RARE_TOKEN_ROWS)

    ckpt = tmp_path / "ckpt"
    _run(tmp_path, "first", ckpt, nproc=n, SAVE_INTERVAL=2, EXIT_AT=2, **shape, **common)
    tp_parts = [f".tp{r}" for r in range(shape["TP"])] if shape["TP"] > 1 else [""]
    assert {p.name for p in ckpt.glob("nemo_fp4qat_teacher*.pt")} == {
        f"nemo_fp4qat_teacher{t}.pp{s}.pt" for t in tp_parts for s in (0, 1)
    }
    resumed = _run(tmp_path, "resumed", ckpt, nproc=n, SAVE_INTERVAL=100, **shape, **common)
    assert "QAD teacher (restored from" in resumed["log"]
    for got_rank, want_rank in zip(resumed["ranks"], staged["ranks"], strict=True):
        assert got_rank["losses"] == {s: v for s, v in want_rank["losses"].items() if int(s) > 2}
        assert got_rank["fc1_weight_sum"] == want_rank["fc1_weight_sum"]


def _export_tensors(path):
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "rank0.safetensors"))


def test_bridge_pipeline_parallel_qat_matches_pp_1_resumes_exactly_and_exports(tmp_path):
    """Pipeline parallelism 2 (two gloo ranks, one layer per stage): calibration through both stages on the run's
    own first micro-batches, inside Bridge's schedule; the FP8 -> NVFP4 switch at the same step on both stages; the
    losses of the PP=1 run on the same data and model within 1e-5 relative; every stage's QAT state saved beside
    the checkpoint and restored by its stage (killed after step 3, steps 4-6 bit for bit); the end-of-training
    export assembled from both stages, validated code for code and equal to the PP=1 run's export; the monitor's
    findings and report cover both stages; a resume at another pipeline size refused by name."""
    # TP=1: every matrix drawn by its whole-model name at any shape. A plain MLP: with the gated one, plain QAT at the
    # tiny model's learning rate drifts by 3e-4 relative at step 6 (PP's summation order moves weights by float32
    # ulps and Adam carries some across NVFP4 rounding boundaries, as under TP); QAD compares gated runs below
    common = dict(STEPS=6, SWITCH_AT=2, TP=1, GATED=0)
    one = _run(tmp_path, "pp1", tmp_path / "pp1_ckpt", SAVE_INTERVAL=100, PP=1, EXPORT_DIR=tmp_path / "e1", **common)
    two = _run(tmp_path, "pp2", tmp_path / "pp2_ckpt", nproc=2, SAVE_INTERVAL=100, PP=2, EXPORT_DIR=tmp_path / "e2",
               MONITOR=0.05, **common)  # fmt: skip
    assert (one["pp"], [r["pp"] for r in two["ranks"]]) == (1, [2, 2])
    two_losses = two["ranks"][1]["losses"]  # the loss is the last stage's
    assert two["ranks"][0]["losses"] == {} and sorted(two_losses) == sorted(one["losses"])
    for step, loss in one["losses"].items():
        assert abs(two_losses[step] - loss) <= 1e-5 * loss, (step, one["losses"], two_losses)
    for rank in two["ranks"]:  # each stage calibrated its own layer, switched at step 2 like the PP=1 run
        assert rank["formats"] == one["formats"] and rank["formats"]["3"] == ["(2, 1)", True]
    # stage 0's layer is the PP=1 run's layer 0; stage 1's is its layer 1 (probed in the PP=1 run as layer 0: only
    # stage 0's amax compares)
    assert abs(two["ranks"][0]["fc1_input_amax"] - one["fc1_input_amax"]) <= 1e-5 * one["fc1_input_amax"]
    # the monitor (on the PP=2 run only: it must not change training): each stage measures its own layer under its
    # whole-model name, every rank learns every stage's findings, rank 0's report holds both stages' layers
    kinds = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    layers = {f"decoder.layers.{i}.{m}" for i in (0, 1) for m in kinds}
    for rank in two["ranks"]:
        assert set(rank["monitor"]["finding_layers"]) == layers, rank["monitor"]  # NVFP4's error > 0.05 everywhere
    report = json.loads(Path(two["monitor"]["report"]).read_text())
    assert all(set(m["layers"]) == layers for m in report["measurements"]), [list(m["layers"]) for m in
                                                                             report["measurements"]]  # fmt: skip
    export = two["export"]
    assert export["ok"], export["errors"]
    assert sum(a == "NVFP4" for a in export["layers"].values()) == 8, export["layers"]  # both stages' layers
    assert export["numeric"]["layers_compared"] == 8 and export["numeric"]["fp4_codes_different"] == 0
    a, b = _export_tensors(one["export"]["path"]), _export_tensors(export["path"])
    assert a.keys() == b.keys()
    codes = [k for k in a if a[k].dtype.is_floating_point is False]
    assert codes and all(int((a[k] != b[k]).sum()) == 0 for k in codes), [k for k in codes if (a[k] != b[k]).any()]

    ckpt = tmp_path / "ckpt"
    first = _run(tmp_path, "first", ckpt, nproc=2, SAVE_INTERVAL=3, EXIT_AT=3, PP=2, **common)
    resumed = _run(tmp_path, "resumed", ckpt, nproc=2, SAVE_INTERVAL=100, PP=2, **common)
    assert resumed["resumed"] is True
    assert first["ranks"][1]["losses"] == {s: two_losses[s] for s in ("1", "2", "3")}
    for rank in (0, 1):
        got, want = resumed["ranks"][rank], two["ranks"][rank]
        assert got["losses"] == {s: v for s, v in want["losses"].items() if int(s) > 3}, rank
        assert got["formats"] == {s: v for s, v in want["formats"].items() if int(s) > 3}, rank
        for key in ("fc1_weight_amax", "fc1_input_amax", "fc1_weight_sum"):
            assert got[key] == want[key], (rank, key)
    with pytest.raises(AssertionError, match="saved with pipeline_model_parallel_size=2 and is being resumed with 1"):
        _run(tmp_path, "other_size", ckpt, SAVE_INTERVAL=100, PP=1, **common)


@pytest.mark.slow_bridge
def test_bridge_tensor_x_pipeline_parallel_qat_matches_one_rank_and_resumes_exactly(tmp_path):
    """TP 2 x PP 2 (four gloo ranks): calibration through both stages, each stage's amax reduced over its
    tensor-parallel pair, the FP8 -> NVFP4 switch at the same step everywhere; the losses equal the TP 2 x PP 1
    run's within 1e-5 relative (against TP 1 they drift after a few NVFP4 steps: TP's summation order moves
    weights by float32 ulps, and Adam at this learning rate carries some across NVFP4 rounding boundaries; TP 2
    against TP 1 is compared by the QAD test above); killed after step 2 and resumed, steps 3-4 equal the
    uninterrupted run bit for bit on every rank."""
    common = dict(STEPS=4, SWITCH_AT=1, TP=2, PP=2)
    one = _run(tmp_path, "one", tmp_path / "one_ckpt", nproc=2, SAVE_INTERVAL=100, **{**common, "PP": 1})
    four = _run(tmp_path, "four", tmp_path / "four_ckpt", nproc=4, SAVE_INTERVAL=100, **common)
    assert [(r["tp"], r["pp"]) for r in four["ranks"]] == [(2, 2)] * 4
    last = [r["losses"] for r in four["ranks"] if r["losses"]]  # the last stage's two tensor-parallel ranks
    assert len(last) == 2 and last[0] == last[1], last
    for step, loss in one["losses"].items():
        assert abs(last[0][step] - loss) <= 1e-5 * loss, (step, one["losses"], last[0])
    assert all(r["formats"] == one["formats"] for r in four["ranks"])

    ckpt = tmp_path / "ckpt"
    _run(tmp_path, "first", ckpt, nproc=4, SAVE_INTERVAL=2, EXIT_AT=2, **common)
    resumed = _run(tmp_path, "resumed", ckpt, nproc=4, SAVE_INTERVAL=100, **common)
    for got, want in zip(resumed["ranks"], four["ranks"]):
        assert got["losses"] == {s: v for s, v in want["losses"].items() if int(s) > 2}
        for key in ("fc1_weight_amax", "fc1_input_amax", "fc1_weight_sum"):
            assert got[key] == want[key], key
