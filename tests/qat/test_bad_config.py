"""Bad configuration is refused when it is constructed, before any training, with a message that names
the field, the bad value and the fix (a table: each case and the words its error must contain)."""

from __future__ import annotations

import pytest

from nemo_fp4qat import FP4QATCallback, LayerPolicy, PrecisionSchedule, QATController, QuantizationMonitor
from nemo_fp4qat.export import ExportConfig
from nemo_fp4qat.qat.calibration.calibrate import CalibrationConfig
from nemo_fp4qat.qat.distillation.distiller import DistillationConfig
from nemo_fp4qat.qat.policy.rules import PolicyRule
from nemo_fp4qat.specs import ConfigError

from tiny_models import tiny_llama

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")

PROGRESSIVE_TYPO = {"stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "target"}],
                    "group_offsets": {"atention": 1}}  # fmt: skip

BAD = [
    ("export kind", lambda: FP4QATCallback(export_dir="out", export={"kind": "onnx"}), r"Unknown export kind 'onnx'"),
    ("export dtype", lambda: FP4QATCallback(export_dir="out", export={"dtype": "fp64"}), r"Unknown dtype 'fp64'"),
    ("export runtime", lambda: FP4QATCallback(export={"runtime": "vlm"}), r"Unknown runtime 'vlm'"),
    ("hf with TP", lambda: FP4QATCallback(export={"kind": "hf", "tensor_parallel": 2}), r"not split by tensor parall"),
    ("TP < 1", lambda: FP4QATCallback(export={"kind": "trtllm", "tensor_parallel": 0}), r"tensor_parallel must be"),
    ("runtime vs policy", lambda: FP4QATCallback(policy="conservative_attention", export={"runtime": "trtllm"}),
     r"policy 'conservative_attention', which TensorRT-LLM cannot run.*runtime': 'vllm'"),
    ("offset typo", lambda: FP4QATCallback(schedule=PROGRESSIVE_TYPO), r"group 'atention'.*Did you mean 'attention'"),
    ("calibration word", lambda: FP4QATCallback(calibration="lots"), r"calibration='lots' is not understood"),
    ("calibration bool", lambda: FP4QATCallback(calibration=True), r"calibration=True is not understood"),
    ("calibration field", lambda: FP4QATCallback(calibration={"num_sample": 1}), r"Unknown calibration field"),
    ("calibration count", lambda: FP4QATCallback(calibration=0), r"num_samples must be a positive int"),
    ("policy name", lambda: FP4QATCallback(policy="fastest"), r"neither a preset"),
    ("policy runtime", lambda: LayerPolicy(runtime="tensorrt"), r"runtime='tensorrt' is not known"),
    ("rule format", lambda: FP4QATCallback(policy={"rules": [{"patterns": ["*"], "weight": "nvfp5"}]}),
     r"Unknown quantization format 'nvfp5'.*Did you mean 'nvfp4'"),
    ("kv cache", lambda: LayerPolicy(kv_cache="int4"), r"kv_cache='int4' is not supported"),
    ("schedule end", lambda: FP4QATCallback(schedule={"stages": [{"start": 0, "format": "fp6"}]}), r"fp6"),
    ("schedule preset", lambda: PrecisionSchedule.resolve_spec("fastest"), r"'fastest' is neither a preset"),
    ("stage format", lambda: PrecisionSchedule(stages=[{"start": 0, "format": "fp5"}]), r"Unknown quantization format"),
    ("stage start", lambda: PrecisionSchedule(stages=[{"start": -1, "format": "target"}]), r"non-negative step"),
    ("first stage", lambda: PrecisionSchedule(stages=[{"start": 5, "format": "fp8"}, {"start": 9, "format": "target"}]),
     r"first stage must start at 0"),
    ("no stages", lambda: PrecisionSchedule(stages=[]), r"needs at least one stage"),
    ("offset sign", lambda: PrecisionSchedule(stages=[{"start": 0, "format": "target"}], group_offsets={"mlp": -1}),
     r"group_offsets\['mlp'\] must be a non-negative number"),
    ("ramp sign", lambda: PrecisionSchedule(stages=[{"start": 0, "format": "target"}], ramp_steps=-2), r"ramp_steps"),
    ("schedule field", lambda: PrecisionSchedule.resolve_spec({"stages": [{"start": 0, "format": "fp8"}], "ramp": 1}),
     r"Unknown schedule field\(s\) 'ramp' \(did you mean 'ramp_steps'\?\); PrecisionSchedule has: .*ramp_steps"),
    ("rule patterns", lambda: PolicyRule(patterns=[]), r"at least one non-empty glob pattern"),
    ("rule group", lambda: PolicyRule(patterns=["*"], group=""), r"group must be a non-empty string"),
    ("rule field", lambda: LayerPolicy(rules=[{"patterns": ["*"], "wieght": "nvfp4"}]), r"rule 0 is invalid.*'wieght'"),
    ("rule type", lambda: LayerPolicy(rules=[3]), r"rule 0 must be a PolicyRule or a dict"),
    ("policy default", lambda: LayerPolicy(default="fp3"), r"Unknown quantization format 'fp3'"),
    ("policy file", lambda: LayerPolicy.resolve_spec("nope.yaml"), r"'nope.yaml' does not exist"),
    ("distill alpha", lambda: DistillationConfig(alpha=2), r"alpha must be in \[0, 1\]"),
    ("distill temperature", lambda: DistillationConfig(temperature=0), r"temperature must be > 0"),
    ("distill teacher", lambda: DistillationConfig(teacher="/nonexistent"), r"neither a Hugging Face.*nor a NeMo 2"),
    ("distill word", lambda: FP4QATCallback(distillation="lots"), r"distillation='lots' is not understood"),
    ("monitor action", lambda: QuantizationMonitor(action="explode"), r"action must be one of"),
    ("monitor cadence", lambda: QuantizationMonitor(every_n_steps=0), r"every_n_steps must be a positive int"),
    ("calibration fraction", lambda: CalibrationConfig(num_samples=1.5), r"num_samples must be a positive int"),
    ("engine plan field", lambda: ExportConfig(plan={"max_batch": -1}),
     r"Unknown engine plan field\(s\) 'max_batch' \(did you mean 'max_batch_size'\?\)"),
    ("export field", lambda: FP4QATCallback(export={"kind": "hf", "tensor_paralel": 2}),
     r"Unknown export field\(s\) 'tensor_paralel' \(did you mean 'tensor_parallel'\?\)"),
    ("distillation field", lambda: FP4QATCallback(distillation={"alfa": 0.5}),
     r"Unknown distillation field\(s\) 'alfa' \(did you mean 'alpha'\?\)"),
    ("policy dict field", lambda: FP4QATCallback(policy={"rule": []}),
     r"Unknown policy field\(s\) 'rule' \(did you mean 'rules'"),
    ("policy preset typo", lambda: FP4QATCallback(policy="defualt"), r"did you mean 'default'"),
    ("monitor threshold", lambda: QuantizationMonitor(thresholds={"max_weight_rel_eror": 1}),
     r"Unknown monitor thresholds field.*did you mean .max_weight_rel_err."),
    ("config dict field", lambda: FP4QATCallback.from_config({"polcy": "default"}),
     r"'polcy' \(did you mean 'policy'\?\)"),
    ("export TP sign", lambda: ExportConfig(kind="trtllm", tensor_parallel=-1), r"tensor_parallel must be >= 1"),
]  # fmt: skip


@pytest.mark.parametrize(("build", "message"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_configuration_is_refused_at_construction(build, message):
    with pytest.raises((ValueError, TypeError, FileNotFoundError), match=message) as raised:
        build()
    if "field" in message and "Unknown" in message:  # unknown fields are ConfigErrors, never TypeErrors
        assert isinstance(raised.value, ConfigError)


def test_empty_calibration_data_is_refused_before_training():
    ctl = QATController(policy="default", schedule="direct", calibration=4)
    model = tiny_llama()
    ctl.prepare(model)
    with pytest.raises(ValueError, match="Calibration got no batches.*calibration_data"):
        ctl.calibrate(model, iter([]))


def test_preset_group_offsets_fit_policies_without_that_group():
    """The progressive preset's attention offset is not an error for a policy that keeps attention unquantized."""
    sched = {
        "stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "target"}],
        "group_offsets": {"attention": 1},
    }
    assert QATController(policy="aggressive_mlp", schedule=sched).schedule.group_offsets == {"attention": 1}


def test_export_runtime_follows_the_policy_when_not_given():
    cb = FP4QATCallback(policy="conservative_attention", export_dir="out", export={"kind": "hf"})
    assert cb.export.runtime == "vllm"
    assert FP4QATCallback(export={"kind": "hf"}).export.runtime == "trtllm"
