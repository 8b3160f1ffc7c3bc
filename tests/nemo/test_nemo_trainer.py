"""NeMo 2.7.3 Megatron training (nl.Trainer + MegatronStrategy, CPU mode) with FP4 QAT and QAD, and a
NeMo dist-checkpoint save / resume that continues with the same stage, quantizers, teacher and losses."""

from __future__ import annotations

import json
import math

import pytest
from nemo_worker_run import run_worker

pytestmark = pytest.mark.nemo


def test_nemo_qat_switches_formats_reports_an_inf_and_ends_with_a_validated_trtllm_checkpoint(tmp_path):
    """NeMo QAT (one run): the callback calibrates, switches FP8 -> NVFP4 at its step on the schedule, and ends
    deployable: the callback's export_dir gets a TensorRT-LLM checkpoint that NeMo's is_qnemo_checkpoint
    accepts, with NeMo's model context for the tokenizer, and whose every exported weight was compared with
    the trained model (0 FP4 codes differ). On the way (test_monitor's Inf test on the NeMo path), NVFP4 clips
    an Inf put into one activation at step 3 of 5 (the loss stays finite), and QuantizationMonitor names the layer
    and the step, on a step it does not measure (every 2nd)."""
    pytest.importorskip("nemo.collections.llm")
    from megatron_utils import nemo_is_qnemo_checkpoint

    out = tmp_path / "qnemo"
    res = run_worker(tmp_path, "export", steps=5, export_dir=out, INJECT_INF_STEP=3)
    assert [(layer.endswith("decoder.layers.0.mlp.linear_fc2"), step, metric, value)
            for layer, step, metric, value in res["nonfinite"]] == [(True, 3, "input_nonfinite", 1.0)]  # fmt: skip
    assert res["calibrated"]
    assert [s["num_bits"] for s in res["seen"]] == [[4, 3], [4, 3], [2, 1], [2, 1], [2, 1]]
    assert [s["block"] for s in res["seen"]][2:] == [16, 16, 16]
    assert [(e["step"], e["group"], e["to"]) for e in res["history"]] == [(2, "other", "nvfp4")]
    assert all(math.isfinite(x) for x in res["losses"].values())
    # the NVFP4 weights were clipped to their searched block scales at the switch (calibration.block_scale_search)
    assert len(res["block_clips"]) == 8  # every decoder linear (policy fp_embeddings), as exported below

    assert res["final_num_bits"] == [2, 1]
    assert nemo_is_qnemo_checkpoint()(str(out))
    assert (out / "nemo_context" / "model.yaml").is_file()
    report = json.loads((out / "validation.json").read_text())
    assert report["ok"], report["errors"]
    num = report["numeric"]
    assert num["layers_compared"] == sum(a is not None for a in report["layers"].values()) == 8
    assert num["fp4_codes_compared"] > 0 and num["fp4_codes_different"] == 0
    from nemo_fp4qat.export import validate_export

    assert validate_export(out).ok  # what `nemo-fp4qat validate` checks without the model


@pytest.mark.parametrize("tp", [1, 2], ids=["data-parallel", "tensor-parallel"])
def test_two_process_run_keeps_stage_and_amax_identical_across_ranks(tmp_path, tp):
    """Two gloo processes (DP 2, or TP 2): every rank switches at the same step and ends with the same
    per-tensor amax. Under TP the weight shards differ, so equal amax means they were synced."""
    pytest.importorskip("nemo.collections.llm")
    r0, r1 = run_worker(tmp_path, f"ranks-tp{tp}", devices=2, tp=tp)
    assert r0["tp"] == r1["tp"] == tp
    bits = [[4, 3], [4, 3], [2, 1], [2, 1]]
    assert [s["num_bits"] for s in r0["seen"]] == [s["num_bits"] for s in r1["seen"]] == bits
    assert r0["history"] == r1["history"] and [e["to"] for e in r0["history"]] == ["nvfp4"]
    assert r0["amax"] and r0["amax"].keys() == r1["amax"].keys()
    assert any(".weight_quantizer" in n for n in r0["amax"]) and any(".input_quantizer" in n for n in r0["amax"])
    assert {n: v for n, v in r0["amax"].items() if len(v) == 1} == {n: v for n, v in r1["amax"].items() if len(v) == 1}
    assert r0["losses"] == r1["losses"] and all(math.isfinite(x) for x in r0["losses"].values())
    assert r0["block_clips"] == r1["block_clips"] and r0["block_clips"]
    if tp == 1:  # replicas calibrated on different samples clipped alike (block scale search), so stayed equal
        assert r0["final_fc1"] == r1["final_fc1"]


def test_qad_fine_tune_from_a_base_checkpoint_restores_student_and_teacher_and_distils(tmp_path):
    """The NeMo recipe path: a base model trained and saved without QAT (stacked-layer dist-checkpoint), restored
    by ``AutoResume(restore_config=RestoreConfig(...))`` into a model the callback has already quantized
    (modelopt switches it to per-layer checkpoint keys): the weights arrive, then QAT runs. With QAD
    (``distillation=True``) the teacher is that base checkpoint too (not the randomly initialised model the
    quantizers were inserted into); its per-token KL replaces the cross entropy under NeMo's own loss reduction
    (0 while the student is still BF16), checked against a float64 KL of the two models' logits; a resume without
    ``RestoreConfig`` finds the teacher again and continues exactly."""
    pytest.importorskip("nemo.collections.llm")
    base_ckpt, mid_ckpt = tmp_path / "base", tmp_path / "mid"
    base = run_worker(tmp_path, "pretrain", "pretrain", str(base_ckpt), steps=4)
    qad = run_worker(tmp_path, "qad", "qad", str(base_ckpt), str(mid_ckpt), steps=4)  # saves mid_ckpt after step 2
    check = qad["qad_check"]
    assert qad["start_fc1"] == base["saved_fc1"]  # the base weights, not a fresh initialisation
    assert [(s["enabled"], s["num_bits"], s["block"]) for s in qad["seen"]] == [(False, 8, None)] + [
        (True, [2, 1], 16)] * 3  # fmt: skip
    assert qad["calibrated"]
    assert check["teacher_fc1"] == base["saved_fc1"]
    assert check["teacher_path"] == str(base_ckpt)
    assert check["teacher_bytes"] == check["student_bytes"] > 0  # the memory cost logged: one more model
    assert qad["losses"]["1"] == pytest.approx(0.0, abs=1e-6)  # step 0 in BF16: student == teacher
    assert all(0 < qad["losses"][str(s)] < 1.0 for s in (2, 3, 4))  # NVFP4: a KL, far below the LM loss
    assert check["logit_diff"] > 0
    # float32 KL of near-equal distributions (~5e-4 per token) against float64: a few 1e-7 of cancellation
    assert check["kd"] == pytest.approx(check["ref"], abs=2e-6) and max(check["ref"]) > 1e-4
    # the NeMo dist-checkpoint saved mid-run, resumed: the stage, quantizers, teacher and losses continue
    # as in the uninterrupted run
    assert (mid_ckpt / "weights" / "modelopt_state").exists()  # NeMo saved modelopt's state with the weights
    resumed = run_worker(tmp_path, "qad_resume", "qad_resume", str(base_ckpt), str(mid_ckpt), steps=4)
    assert resumed["seen"][0]["step"] == 2 and resumed["seen"][0]["num_bits"] == [2, 1]
    assert resumed["seen"][0]["block"] == 16 and resumed["seen"][0]["amax"] == qad["saved_amax"]
    assert [e["to"] for e in resumed["history"]] == ["nvfp4"]  # the schedule history came back, no new switch
    assert resumed["qad_check"]["teacher_path"] == str(base_ckpt)
    assert resumed["qad_check"]["teacher_fc1"] == base["saved_fc1"]
    for step in ("3", "4"):
        assert resumed["losses"][step] == pytest.approx(qad["losses"][step], rel=1e-6), (step, resumed, qad)


@pytest.mark.slow_nemo
def test_qad_at_tensor_parallel_2_matches_tp_1_from_the_same_base(tmp_path):
    """QAD at TP=2 (two gloo ranks; the teacher is the base checkpoint loaded at the run's shape): the per-token KL
    over vocabulary-parallel logits equals a float64 KL of the gathered logits, and the losses NeMo reports match the
    TP=1 run of the same data and base within 1e-5 relative."""
    pytest.importorskip("nemo.collections.llm")
    base_ckpt = tmp_path / "base"
    # weights of std 0.1: sharper distributions, a KL far above float32's noise (which differs with each shape's
    # summation order). NVFP4 from the first step: a BF16 step with student == teacher has a KL of 0 and gradients
    # of float32 noise, which Adam scales up to full-size updates. Without the plugin's block scale search, whose
    # choices on tensor-parallel shards are not the TP=1 choices (a different quantized model).
    run_worker(tmp_path, "pretrain", "pretrain", str(base_ckpt), steps=4, INIT_STD=0.1)
    env = {"NVFP4_FROM_START": 1, "BLOCK_SEARCH": 0, "INIT_STD": 0.1}
    one = run_worker(tmp_path, "qad_tp1", "qad", str(base_ckpt), steps=4, **env)
    r0, r1 = run_worker(tmp_path, "qad_tp2", "qad", str(base_ckpt), steps=4, devices=2, tp=2, **env)
    assert (r0["tp"], r1["tp"]) == (2, 2) and r0["losses"] == r1["losses"]
    for r in (r0, r1):
        check = r["qad_check"]
        assert check["kd"] == pytest.approx(check["ref"], abs=2e-6) and max(check["ref"]) > 1e-4
    for step in ("1", "2", "3", "4"):
        assert 0 < one["losses"][step] < 1.0
        assert r0["losses"][step] == pytest.approx(one["losses"][step], rel=1e-5), (step, one["losses"], r0["losses"])


def test_moe_qad_at_expert_parallel_2_matches_one_rank_from_the_same_base(tmp_path):
    """A mixture-of-experts GPT (4 experts, top 2) through NeMo's trainer: QAD at expert-parallel size 2 (each rank two
    experts, the teacher the base checkpoint loaded at the run's shape) reports the losses of the EP 1 run from the same
    base within 1e-5, with every expert's amax equal to the one-rank run's and tied across the experts of a layer."""
    pytest.importorskip("nemo.collections.llm")
    base_ckpt = tmp_path / "base"
    run_worker(tmp_path, "pretrain", "pretrain", str(base_ckpt), steps=4, INIT_STD=0.1, EP=1)
    env = {"NVFP4_FROM_START": 1, "BLOCK_SEARCH": 0, "INIT_STD": 0.1}
    one = run_worker(tmp_path, "qad_ep1", "qad", str(base_ckpt), steps=4, EP=1, **env)
    # EP 2 is data parallel 2: each rank calibrates on its half of the first two global batches (2 samples), which
    # together are the 4 samples the one-rank run calibrates on
    mid = tmp_path / "mid"  # a mid-run checkpoint after step 2
    r0, r1 = run_worker(tmp_path, "qad_ep2", "qad", str(base_ckpt), str(mid), steps=4, devices=2, EP=2,
                        CALIB_SAMPLES=2, **env)  # fmt: skip
    assert r0["losses"] == r1["losses"]
    for step in ("1", "2", "3", "4"):
        assert 0 < one["losses"][step]
        assert r0["losses"][step] == pytest.approx(one["losses"][step], abs=1e-5), (step, one["losses"], r0["losses"])
    ep2 = {**r0["global_amax"], **r1["global_amax"]}
    experts = {n for n in one["global_amax"] if ".local_experts." in n}
    assert len(experts) == 2 * 4 * 2 * 2 and experts <= ep2.keys()  # layers x experts x fc1/fc2 x weight/input
    for name in experts:
        assert ep2[name] == pytest.approx(one["global_amax"][name], rel=1e-6), name
    for layer in (0, 1):
        for proj in ("linear_fc1", "linear_fc2"):
            inputs = {ep2[f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{proj}.input_quantizer"][0]
                      for e in range(4)}  # fmt: skip
            assert len(inputs) == 1, (layer, proj, inputs)
    # resumed at EP 2 from the mid-run checkpoint (each rank its experts, the teacher found again): the same run
    s0, s1 = run_worker(tmp_path, "qad_ep2_resumed", "qad_resume", str(base_ckpt), str(mid), steps=4, devices=2, EP=2,
                        CALIB_SAMPLES=2, **env)  # fmt: skip
    for step in ("3", "4"):
        assert s0["losses"][step] == r0["losses"][step], (step, s0["losses"], r0["losses"])
    assert {**s0["global_amax"], **s1["global_amax"]} == ep2
