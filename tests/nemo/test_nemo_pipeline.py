"""Pipeline parallelism on the NeMo path: two gloo processes, one stage each (``PP=2``), on the CPU.

Every run starts from the same base checkpoint (trained without QAT, saved without pipeline parallelism), so
the pipeline-parallel run can be compared layer by layer with the same QAT run without pipeline parallelism.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from export_compare import assert_same_export
from nemo_worker_run import run_worker

pytestmark = pytest.mark.nemo


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A base checkpoint (one step without QAT, one process): what a recipe restores before QAT."""
    d = tmp_path_factory.mktemp("pp_base")
    run_worker(d, "base", "pretrain", str(d / "base"), steps=2)
    return d / "base"


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def _export_tensors(path):
    from safetensors.torch import load_file

    config = json.loads((path / "config.json").read_text())
    assert config["mapping"]["pp_size"] == 1 and config["mapping"]["tp_size"] == 1
    return config, load_file(str(path / "rank0.safetensors"))


def test_pipeline_parallel_run_calibrates_switches_resumes_and_exports_every_stage(tmp_path, base):
    """PP=2: each stage calibrates its own layers through a forward of the whole pipeline, both ranks switch FP8 ->
    NVFP4 at the same step and report the same losses; a mid-run checkpoint resumes with identical losses, amax and
    weights (each stage gets its own quantizer state back); the end-of-fit TensorRT-LLM export holds every layer of
    both stages, validated code for code against the trained stages; and the run equals, layer by layer, the same
    QAT run without pipeline parallelism (the amax rule: a layer's amax is its own stage's, not reduced across
    stages, which hold other layers)."""
    exp_pp, exp_1 = tmp_path / "export_pp2", tmp_path / "export_pp1"
    r0, r1 = run_worker(tmp_path, "pp2", "save", str(tmp_path / "mid"), steps=4, devices=2, PP=2, BASE=base,
                  export_dir=exp_pp)  # fmt: skip
    assert (r0["pp"], r0["pp_rank"], r0["layer_offset"]) == (2, 0, 0)
    assert (r1["pp"], r1["pp_rank"], r1["layer_offset"]) == (2, 1, 1)
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) == 4  # the last stage's loss, on both ranks
    assert all(math.isfinite(v) for v in r0["losses"].values())
    for r in (r0, r1):
        assert r["calibrated"]
        assert [(e["step"], e["group"], e["to"]) for e in r["history"]] == [(2, "other", "nvfp4")]
        assert [s["num_bits"] for s in r["seen"]] == [[4, 3], [4, 3], [2, 1], [2, 1]]
    stage0 = {k.split(".")[2] for k in r0["global_amax"]}
    stage1 = {k.split(".")[2] for k in r1["global_amax"]}
    assert stage0 == {"0"} and stage1 == {"1"}  # each stage quantized its own layer

    # kill and resume: the mid-run checkpoint, resumed at PP=2, continues exactly
    q0, q1 = run_worker(tmp_path, "pp2-resume", "resume", str(tmp_path / "mid"), steps=4, devices=2, PP=2)
    for uninterrupted, resumed in ((r0, q0), (r1, q1)):
        assert resumed["losses"] == {k: v for k, v in uninterrupted["losses"].items() if int(k) > 2}
        assert resumed["global_amax"] == uninterrupted["global_amax"]
        assert resumed["weights"] == uninterrupted["weights"]

    # the export: every layer of every stage, validated against the assembled stages
    report = json.loads((exp_pp / "validation.json").read_text())
    assert report["ok"], report["errors"]
    assert report["numeric"]["layers_compared"] == 8 and report["numeric"]["fp4_codes_different"] == 0
    config, t_pp = _export_tensors(exp_pp)
    assert config["num_hidden_layers"] == 2
    assert {k.split(".")[2] for k in t_pp if k.startswith("transformer.layers.")} == {"0", "1"}
    assert {"lm_head.weight", "transformer.vocab_embedding.weight", "transformer.ln_f.weight"} <= set(t_pp)

    # the same QAT run without pipeline parallelism, from the same base: equal up to float summation order
    # (micro-batches of 1 under PP, one of 2 without)
    one = run_worker(tmp_path, "pp1", steps=4, BASE=base, export_dir=exp_1)
    assert _rel(list(r0["losses"].values()), list(one["losses"].values())) < 1e-5
    staged = {**r0["global_amax"], **r1["global_amax"]}
    assert sorted(staged) == sorted(one["global_amax"])
    for name, amax in staged.items():
        assert _rel(amax, one["global_amax"][name]) < 1e-5, name
    for name, w in {**r0["weights"], **r1["weights"]}.items():
        assert max(abs(x - y) for x, y in zip(w, one["weights"][name], strict=True)) < 1e-4, name
    _, t_1 = _export_tensors(exp_1)
    assert sorted(t_pp) == sorted(t_1)
    for key, v in t_pp.items():
        assert v.shape == t_1[key].shape and v.dtype == t_1[key].dtype, key
        if v.dtype == torch.uint8:  # packed E2M1 codes: the same but for a few near a rounding boundary
            same = (v == t_1[key]).float().mean().item()
            assert same > 0.995, (key, same)
        else:
            assert torch.allclose(v.float(), t_1[key].float(), rtol=1e-3, atol=1e-4), key


@pytest.mark.parametrize("action", [pytest.param("warn", marks=pytest.mark.slow_nemo), "rollback"])
def test_monitor_under_pipeline_parallelism_reports_every_stage_and_acts_on_all(tmp_path, base, action):
    """PP=2 with the monitor: each stage measures its own layers under the whole model's names; an Inf put into the
    input of each stage's first linear_fc2 at step 1 is found on both stages, and every rank holds both findings;
    rank 0's report names every quantized layer of both stages. With action='rollback' both stages roll the group
    back once, together: it stays in FP8 (no switch to NVFP4 at step 2) on every rank."""
    r0, r1 = run_worker(tmp_path, f"monitor_{action}", steps=4, devices=2, PP=2, BASE=base, INJECT_INF_STEP=1,
                        MONITOR_ACTION=action)  # fmt: skip
    found = sorted((layer, step, metric) for layer, step, metric, _ in r0["nonfinite"])
    assert found == [("decoder.layers.0.mlp.linear_fc2", 1, "input_nonfinite"),
                     ("decoder.layers.1.mlp.linear_fc2", 1, "input_nonfinite")], r0["nonfinite"]  # fmt: skip
    assert sorted(map(tuple, r1["nonfinite"])) == sorted(map(tuple, r0["nonfinite"]))  # every rank holds both
    report = json.loads((tmp_path / "quant_report.json").read_text())
    kinds = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    every_layer = {f"decoder.layers.{i}.{k}" for i in (0, 1) for k in kinds}
    assert report["measurements"] and all(set(m["layers"]) == every_layer for m in report["measurements"])
    assert {(f["layer"], f["step"]) for f in report["findings"] if f["problem"] == "nonfinite"} == {
        (n, 1) for n, _, _ in found}  # fmt: skip
    if action == "rollback":
        assert r0["pins"] == r1["pins"] == {"other": 0}  # one stage back from FP8: held there, once
        assert r0["history"] == r1["history"] == []
        assert r0["final_num_bits"] == r1["final_num_bits"] == [4, 3]
    else:
        assert r0["pins"] == r1["pins"] == {}
        assert (
            [(e["step"], e["to"]) for e in r0["history"]]
            == [(2, "nvfp4")]
            == [(e["step"], e["to"]) for e in r1["history"]]
        )


def test_pipeline_stage_state_refuses_another_pipeline_size():
    """A checkpoint's per-stage QAT state cannot be resumed at another pipeline-parallel size: the message names
    the size it was saved with and how to start from its weights instead."""
    from nemo_fp4qat.nemo.callback import NeMoFP4QATCallback
    from nemo_fp4qat.qat.parallel.pipeline import STAGES_KEY, this_stage

    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=2 .*resumed with 1.*pretrained checkpoint"):
        this_stage({STAGES_KEY: [{"controller": {}}, {"controller": {}}]})
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=2 .*resumed with 1.*RestoreConfig"):
        NeMoFP4QATCallback().load_state_dict({STAGES_KEY: [{"controller": {}}, {"controller": {}}]})
    assert this_stage({"controller": {"current": {}}}) == {"controller": {"current": {}}}


@pytest.mark.slow_nemo
def test_qad_under_pipeline_parallelism_matches_one_stage_and_resumes(tmp_path):
    """QAD at PP=2 (two gloo ranks; each rank's teacher is its stage of the base checkpoint, running beside the
    student's stage): the losses NeMo reports equal the PP=1 run's from the same base within 1e-5 relative; a
    mid-run checkpoint resumed (the teacher path coming back from it) gives the uninterrupted run's last steps."""
    base_ckpt = tmp_path / "base"
    # as the tensor-parallel QAD test: sharper distributions (std 0.1) and NVFP4 from the first step, so the KL is
    # far above float32's noise
    run_worker(tmp_path, "pretrain", "pretrain", str(base_ckpt), steps=4, INIT_STD=0.1)
    env = {"NVFP4_FROM_START": 1, "BLOCK_SEARCH": 0, "INIT_STD": 0.1}
    one = run_worker(tmp_path, "qad_pp1", "qad", str(base_ckpt), steps=4, **env)
    mid = tmp_path / "mid"
    r0, r1 = run_worker(tmp_path, "qad_pp2", "qad", str(base_ckpt), str(mid), steps=4, devices=2, PP=2, **env)
    assert (r0["pp"], r1["pp"]) == (2, 2) and r0["losses"] == r1["losses"]
    for step in ("1", "2", "3", "4"):
        assert 0 < one["losses"][step] < 1.0
        assert r1["losses"][step] == pytest.approx(one["losses"][step], rel=1e-5), (step, one["losses"], r1["losses"])
    assert r0["qad_check"]["teacher_path"] == str(base_ckpt)
    q0, q1 = run_worker(tmp_path, "qad_pp2_resumed", "qad_resume", str(base_ckpt), str(mid), steps=4, devices=2,
                        PP=2, **env)  # fmt: skip
    assert q1["qad_check"]["teacher_path"] == str(base_ckpt) and q0["losses"] == q1["losses"]
    for step in ("3", "4"):
        assert q1["losses"][step] == pytest.approx(r1["losses"][step], rel=1e-6), (step, q1["losses"], r1["losses"])


@pytest.mark.slow_nemo
def test_qad_and_export_at_tensor_x_pipeline_parallel_match_one_rank(tmp_path):
    """QAD at TP 2 x PP 2 (four gloo ranks; each rank's teacher its shard of its stage of the base checkpoint): the
    losses equal the one-rank run's from the same base within 1e-5 relative, and the end-of-training export (every
    stage's tensor-parallel shards merged on rank 0) equals the one-rank run's export code for code."""
    base_ckpt = tmp_path / "base"
    run_worker(tmp_path, "pretrain", "pretrain", str(base_ckpt), steps=4, INIT_STD=0.1)
    env = {"NVFP4_FROM_START": 1, "BLOCK_SEARCH": 0, "INIT_STD": 0.1}
    one = run_worker(tmp_path, "qad_1", "qad", str(base_ckpt), steps=4, export_dir=tmp_path / "e1", **env)
    ranks = run_worker(tmp_path, "qad_tp2pp2", "qad", str(base_ckpt), steps=4, devices=4, tp=2, PP=2,
                       export_dir=tmp_path / "e4", **env)  # fmt: skip
    assert [(r["tp"], r["pp"], r["pp_rank"]) for r in ranks] == [(2, 2, 0), (2, 2, 0), (2, 2, 1), (2, 2, 1)]
    last = ranks[3]["losses"]
    assert ranks[2]["losses"] == last
    for step in ("1", "2", "3", "4"):
        assert 0 < one["losses"][step] < 1.0
        assert last[step] == pytest.approx(one["losses"][step], rel=1e-5), (step, one["losses"], last)
    # the key projection's bias has no gradient in exact arithmetic (softmax ignores it): Adam turns its float32 noise
    # into lr-sized steps that differ with each shape's summation order; the query and value parts must agree
    assert_same_export(tmp_path / "e4", tmp_path / "e1", layers=8, atol={"attention.qkv.bias": 1e-4})
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / e / "rank0.safetensors")) for e in ("e1", "e4"))
    for layer in (0, 1):
        one, four = (t[f"transformer.layers.{layer}.attention.qkv.bias"].float().chunk(3) for t in (a, b))
        for part in (0, 2):  # query, value
            assert torch.allclose(one[part], four[part], rtol=1e-3, atol=1e-7), (layer, part)


@pytest.mark.slow_nemo
def test_tensor_and_pipeline_parallel_together(tmp_path, base):
    """TP 2 x PP 2 (four gloo processes): every rank switches at the same step; the two ranks of a stage hold the
    same per-tensor amax (synced over the tensor-parallel group, not across stages); the loss is the last stage's,
    which NeMo logs on global rank 0 and on the last stage's ranks."""
    ranks = run_worker(tmp_path, "tp2pp2", steps=4, devices=4, tp=2, PP=2, BASE=base)
    assert [(r["tp"], r["pp"], r["pp_rank"]) for r in ranks] == [(2, 2, 0), (2, 2, 0), (2, 2, 1), (2, 2, 1)]
    for r in ranks:
        assert [(e["step"], e["to"]) for e in r["history"]] == [(2, "nvfp4")]
    for a, b in ((ranks[0], ranks[1]), (ranks[2], ranks[3])):
        per_tensor = {k: v for k, v in a["global_amax"].items() if len(v) == 1}
        assert per_tensor and per_tensor == {k: b["global_amax"][k] for k in per_tensor}
    assert {k.split(".")[2] for k in ranks[0]["global_amax"]} == {"0"}
    assert {k.split(".")[2] for k in ranks[2]["global_amax"]} == {"1"}
    assert ranks[0]["losses"] == ranks[2]["losses"] == ranks[3]["losses"]
    assert all(math.isfinite(v) and v > 0 for v in ranks[0]["losses"].values())
