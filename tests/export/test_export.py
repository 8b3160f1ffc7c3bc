"""Export: modelopt's exporters wrapped with preflight refusal, atomic writes and validation.

Numerics are checked by the plugin's own unpacker against the trained model's fake-quantized
weights (FP4 codes exactly), on randomly initialised tiny Llamas, for each deployable format and
for both checkpoint kinds. Corrupted exports must each be rejected naming the tensor.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_fp4qat import LayerPolicy
from nemo_fp4qat.export import (
    MANIFEST_NAME,
    ExportConfig,
    ExportRefused,
    ExportValidationError,
    export_checkpoint,
    validate_export,
)
from nemo_fp4qat.qat.calibration.w4a8_scaling import is_w4a8
from nemo_fp4qat.qat.modelopt_compat import uses_list_config

from reference_numerics import nvfp4_ref
from tiny_models import FULL, VOCAB, calibrated_tiny_llama, tiny_llama

pytestmark = pytest.mark.twice("modelopt 0.37's exporters write what NeMo's export path deploys")

W4A8_EXPORTER = pytest.mark.skipif(not uses_list_config(), reason="modelopt 0.37's W4A8 export is refused up front")
W4A16_NVFP4 = LayerPolicy(rules=[FULL, {"patterns": ["*_proj"], "weight": "nvfp4", "input": None}], default=None)
EXPECTED_ALGO = {"nvfp4": "NVFP4", "fp8": "FP8", "int8_sq": "W8A8_SQ_PER_CHANNEL", "int8_wo": "W8A16",
                 "int4_awq": "W4A16_AWQ", "trtllm_mixed": "MIXED_PRECISION"}  # fmt: skip


@pytest.mark.parametrize("kind", ["hf", "trtllm"])
@pytest.mark.parametrize("fmt", list(EXPECTED_ALGO))
def test_export_each_format_validates_against_the_trained_model(tmp_path, fmt, kind):
    model = calibrated_tiny_llama(fmt)
    if fmt == "int8_wo" and not uses_list_config():  # modelopt 0.37 mislabels weight-only INT8: refused up front
        with pytest.raises(ExportRefused, match="W8A8_SQ_PER_CHANNEL without input scales"):
            export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind=kind))
        assert not (tmp_path / "ckpt").exists()
        return
    out = export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind=kind))
    report = json.loads((out / "validation.json").read_text())
    assert report["ok"] and report["quant_algo"] == EXPECTED_ALGO[fmt]
    # coverage: every quantized layer was compared, or is named with the reason it could not be
    quantized = [m for m, a in report["layers"].items() if a is not None]
    skipped = report["numeric"].get("layers_skipped", {})
    assert report["numeric"]["layers_compared"] + len(skipped) == len(quantized) > 0
    assert all(reason for reason in skipped.values())
    if EXPECTED_ALGO[fmt] not in ("W8A8_SQ_PER_CHANNEL", "W4A16_AWQ"):  # only smoothing exporters requantize
        assert skipped == {} and "resmoothed_layers" not in report["numeric"], skipped
    else:
        assert report["numeric"]["layers_compared"] >= len(quantized) // 4, skipped
        assert set(skipped.values()) <= {"re-smoothed and requantized by the exporter"}
        assert report["numeric"].get("resmoothed_layers", 0) == len(skipped)
        warned = {w["tensor"]: w["message"] for w in report["warnings"] if "rounding tie" not in w["message"]}
        assert warned == {f"{m}.weight": "numeric check skipped: the exporter re-smoothed (pre_quant_scale changed) "
                          "and requantized." for m in skipped}  # fmt: skip
        ties = [w for w in report["warnings"] if "rounding tie" in w["message"]]
        assert len(ties) <= 1 and report["numeric"].get("rounding_ties_excused", 0) <= 1, ties  # one tie at most
    if fmt in ("nvfp4", "trtllm_mixed"):
        assert report["numeric"]["fp4_codes_compared"] > 0 and report["numeric"]["fp4_codes_different"] == 0
    # re-validated from disk, independently of the export call
    assert validate_export(out, model=model).ok
    assert (out / MANIFEST_NAME).is_file() and (out / "build_engine.sh").is_file()
    if kind == "trtllm":
        assert (out / "config.json").is_file() and (out / "rank0.safetensors").is_file()
    else:
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["quantization_config"]["quant_method"] == "modelopt"


@pytest.mark.parametrize("kind", ["hf", "trtllm"])
@pytest.mark.parametrize(("fmt", "algo"), [("mxfp4", "mxfp4"), ("mxfp8", "MXFP8")])
def test_mx_formats_export_for_the_pytorch_runtime_and_validate(tmp_path, fmt, algo, kind):
    """MXFP4 / MXFP8 (E8M0 block scales): no TensorRT-LLM kernel for the dense formats, so they export for the
    plugin's PyTorch runtime; the validator checks their layout and every FP4 code / MXFP8 value. modelopt 0.37
    mislabels MXFP8 (fp8_pb_wo) or crashes on it: refused up front there, nothing written."""
    model = calibrated_tiny_llama(fmt)
    if fmt == "mxfp8" and not uses_list_config():
        with pytest.raises(ExportRefused, match="modelopt < 0.40 exports MXFP8 as fp8_pb_wo"):
            export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind=kind, runtime="pytorch"))
        assert not (tmp_path / "ckpt").exists()
        return
    out = export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind=kind, runtime="pytorch"))
    report = json.loads((out / "validation.json").read_text())
    num = report["numeric"]
    assert report["ok"] and report["quant_algo"] == algo and not report["errors"]
    assert num["layers_compared"] == sum(a is not None for a in report["layers"].values()) > 0
    assert num["max_rel_error"] == 0.0
    if fmt == "mxfp4":
        assert num["fp4_codes_compared"] > 0 and num["fp4_codes_different"] == 0
    tensors = load_file(str(next(out.glob("*.safetensors"))))
    scales = {v.dtype for k, v in tensors.items() if k.endswith(("weight_scale", "weights_scaling_factor"))}
    assert scales == {torch.uint8}  # E8M0 exponents
    if kind == "hf":  # a block scale one binade off is caught by the numeric check, naming the layer
        key = "model.layers.0.mlp.up_proj.weight_scale"
        bad = _corrupt(out, tmp_path / "bad", lambda t: t.__setitem__(key, t[key] + 1))
        assert "model.layers.0.mlp.up_proj.weight" not in _errors(validate_export(bad, runtime="pytorch"))
        errs = _errors(validate_export(bad, model=model, runtime="pytorch"))
        assert "differ from the trained fake-quant weights" in errs["model.layers.0.mlp.up_proj.weight"]


def test_w4a8_layers_train_in_the_numerics_trtllm_deploys(tmp_path):
    # TRT-LLM's W4A8_NVFP4_FP8 kernel: per-tensor weight scale max|w| / 448 (block scales <= 448 / 6)
    model = calibrated_tiny_llama("nvfp4_w4a8")
    lin = model.model.layers[0].mlp.down_proj
    w = lin.weight.detach()
    assert float(lin.weight_quantizer.amax) == pytest.approx(6 * float(w.abs().max()), rel=1e-6)
    with torch.no_grad():
        got = lin.weight_quantizer(w).numpy()
    held = float(lin.weight_quantizer.amax)  # 6 max|w|, nudged by <= 2 ulps (training_amax)
    want = nvfp4_ref(w.numpy(), amax=held)  # global scale = held / 2688 = max|w| / 448
    np.testing.assert_array_equal(got, want)
    if not uses_list_config():  # modelopt 0.37 writes the W4A4 per-tensor scale: refused, nothing written
        with pytest.raises(ExportRefused, match="W4A8 kernel needs amax / 448"):
            export_checkpoint(model, tmp_path / "hf", ExportConfig(kind="hf"))
        assert list(tmp_path.iterdir()) == []
        return
    x = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        before = model(x).logits
    for kind in ("hf", "trtllm"):
        out = export_checkpoint(model, tmp_path / kind, ExportConfig(kind=kind))
        report = json.loads((out / "validation.json").read_text())
        assert report["ok"] and report["quant_algo"] == "MIXED_PRECISION"
        assert report["numeric"]["fp4_codes_compared"] > 0 and report["numeric"]["fp4_codes_different"] == 0
    layers = json.loads((tmp_path / "hf" / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    assert layers["model.layers.0.mlp.down_proj"]["quant_algo"] == "W4A8_NVFP4_FP8"
    assert layers["model.layers.0.self_attn.q_proj"]["quant_algo"] == "FP8"
    t = load_file(str(tmp_path / "hf" / "model.safetensors"))  # the kernel's scale contract
    assert float(t["model.layers.0.mlp.down_proj.weight_scale_2"]) == pytest.approx(float(w.abs().max()) / 448)
    for name, mod in model.named_modules():  # the exported per-tensor scale is the trained one, bit for bit
        if is_w4a8(mod):
            trained = mod.weight_quantizer._amax.float() / (6.0 * 448.0)
            assert torch.equal(t[f"{name}.weight_scale_2"].float().reshape(()), trained.reshape(())), name
    assert float(t["model.layers.0.mlp.down_proj.weight_scale"].float().max()) <= 448 / 6
    with torch.no_grad():  # the training amax is back after the export
        assert torch.equal(model(x).logits, before)


@W4A8_EXPORTER
def test_w4a8_export_without_the_amax_conversion_is_not_published(tmp_path, monkeypatch):
    # modelopt exports W4A8 with weight_scale_2 = amax / 448 but fake-quantizes with amax / (6 * 448): handed
    # the training amax, its block scales round differently; the validator must refuse that checkpoint
    import nemo_fp4qat.export.exporters as exporters

    model = calibrated_tiny_llama("nvfp4_w4a8")
    monkeypatch.setattr(exporters, "w4a8_export_amax", lambda m: contextlib.nullcontext())
    with pytest.raises(ExportValidationError, match="FP4 codes differ from the trained"):
        export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="hf"))
    assert not (tmp_path / "ckpt").exists()


@W4A8_EXPORTER
def test_w4a8_block_scales_that_overflow_the_kernel_are_refused(tmp_path):
    # trained without the 6 x amax convention (modelopt's own W4A8 calibration): codes match the export,
    # but block scales up to 448 overflow the kernel's FP8 weight dequantization (code 6 x 448)
    model = calibrated_tiny_llama("nvfp4_w4a8")
    with torch.no_grad():
        for m in model.modules():
            if is_w4a8(m):
                m.weight_quantizer._amax.div_(6.0)
    with pytest.raises(
        ExportValidationError,
        match=r"\.weight_scale: max [\d.]+ > 448 / 6: the W4A8 kernel's FP8 dequantization of the weights would "
        r"overflow \(weight_scale_2 must be amax / 448\)\.",
    ):
        export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="hf"))
    assert not (tmp_path / "ckpt").exists()


def test_nvfp4_packed_layout_and_scale_grid(tmp_path):
    model = calibrated_tiny_llama("nvfp4")
    out = export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="hf"))
    t = load_file(str(out / "model.safetensors"))
    w = model.model.layers[0].mlp.down_proj.weight
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == torch.uint8
    assert tuple(t["model.layers.0.mlp.down_proj.weight"].shape) == (w.shape[0], w.shape[1] // 2)
    assert tuple(t["model.layers.0.mlp.down_proj.weight_scale"].shape) == (w.shape[0], w.shape[1] // 16)
    amax = float(model.model.layers[0].mlp.down_proj.weight_quantizer.amax)
    assert float(t["model.layers.0.mlp.down_proj.weight_scale_2"]) == pytest.approx(amax / (6 * 448), rel=1e-6)
    assert t["lm_head.weight"].is_floating_point()  # excluded: full precision


def test_trtllm_tensor_parallel_2_splits_and_merges_back(tmp_path):
    model = calibrated_tiny_llama("nvfp4")
    out = export_checkpoint(model, tmp_path / "tp2", ExportConfig(kind="trtllm", tensor_parallel=2))
    assert (out / "rank0.safetensors").is_file() and (out / "rank1.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["mapping"]["tp_size"] == 2
    r0 = load_file(str(out / "rank0.safetensors"))
    full = model.model.layers[0].mlp.down_proj.weight
    assert r0["transformer.layers.0.mlp.proj.weight"].shape[1] * 2 == full.shape[1] // 2  # row parallel: half of in
    report = validate_export(out, model=model)  # ranks merged, then every code compared with the model
    assert report.ok, report.format()
    assert report.numeric["fp4_codes_different"] == 0 and report.numeric["layers_compared"] == 10


def test_fp8_kv_cache_is_exported(tmp_path):
    model = calibrated_tiny_llama("trtllm_mixed", kv_cache="fp8")
    for kind in ("hf", "trtllm"):
        out = export_checkpoint(model, tmp_path / kind, ExportConfig(kind=kind))
        rep = validate_export(out, model=model)
        assert rep.ok and rep.kv_cache_quant_algo == "FP8"
        keys = list(load_file(str(next(out.glob("*.safetensors")))).keys())
        assert any(k.endswith(("k_scale", "kv_cache_scaling_factor")) for k in keys)


def test_export_does_not_change_the_trained_model(tmp_path):
    model = calibrated_tiny_llama("nvfp4")
    x = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        before = model(x).logits
    export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="hf"))
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)


@pytest.mark.parametrize(
    ("policy", "hidden", "runtime", "needle"),
    [
        ("conservative_attention", 128, "trtllm", "MXFP8"),  # attention in MXFP8: no TRT-LLM kernel
        ("mxfp4", 128, "trtllm", "mxfp4"),  # dense MXFP4 to TRT-LLM
        ("int4_awq", 64, "pytorch", "not divisible by the int4_awq block size 128"),
        ("mxfp6_e2m3", 128, "pytorch", "no MXFP6 exporter"),
        (W4A16_NVFP4, 128, "trtllm", "NVFP4 weights with bf16 inputs"),  # no TRT-LLM kernel
    ],
)
def test_refused_exports_write_nothing(tmp_path, policy, hidden, runtime, needle):
    model = calibrated_tiny_llama(policy, hidden=hidden)
    with pytest.raises(ExportRefused) as e:
        export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="hf", runtime=runtime))
    assert needle.lower() in str(e.value).lower() and "model.layers.0." in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_nvfp4_weights_only_exports_for_the_pytorch_runtime_code_for_code_and_serves_as_trained(tmp_path):
    """NVFP4 weights with 16-bit activations (modelopt writes W4A16_NVFP4: no input_scale): the refusal above
    points to runtime="pytorch", and that export validates every FP4 code, serves the trained model's logits and
    still names a moved code."""
    from nemo_fp4qat.export.deployed_model import load_deployed_model

    model = calibrated_tiny_llama(W4A16_NVFP4)
    if not uses_list_config():  # modelopt 0.37 labels these layers NVFP4 without an input scale: refused up front
        with pytest.raises(ExportRefused, match="without an input scale"):
            export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="hf", runtime="pytorch"))
        assert list(tmp_path.iterdir()) == []
        return
    out = export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="hf", runtime="pytorch"))
    report = json.loads((out / "validation.json").read_text())
    assert report["ok"] and set(a for a in report["layers"].values() if a) == {"W4A16_NVFP4"}
    num = report["numeric"]
    assert num["layers_compared"] == 14 and num["fp4_codes_compared"] > 0 and num["fp4_codes_different"] == 0
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    served = load_deployed_model(out).model
    with torch.no_grad():
        assert torch.allclose(served(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
    name = "model.layers.1.self_attn.o_proj.weight"

    def flip(t):
        w = t[name].clone()
        w.view(-1)[3] ^= 1
        t[name] = w

    assert "FP4 codes differ" in _errors(validate_export(_corrupt(out, tmp_path / "bad", flip), model=model))[name]


def test_interrupted_export_leaves_no_directory_and_keeps_the_old_one(tmp_path):
    model = calibrated_tiny_llama("nvfp4")
    out = export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="hf"))
    old = (out / MANIFEST_NAME).read_text()

    class Interrupting:
        def save_pretrained(self, path):  # the tokenizer save comes after modelopt wrote the weights
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(model, tmp_path / "new", ExportConfig(kind="hf"), tokenizer=Interrupting())
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(model, out, ExportConfig(kind="hf", overwrite=True), tokenizer=Interrupting())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no "new", no partial directories
    assert (out / MANIFEST_NAME).read_text() == old
    with pytest.raises(FileExistsError, match="overwrite"):
        export_checkpoint(model, out, ExportConfig(kind="hf"))


def test_what_a_killed_export_left_is_cleaned_and_reported_by_the_next_one(tmp_path, caplog):
    """SIGKILL runs no cleanup: the next export to the path removes a dead process's partial directory,
    keeps a live one's, and puts back an export that was moved aside when the kill came mid-replacement."""
    import subprocess
    import sys

    from nemo_fp4qat.export.atomic import recover_interrupted

    model = calibrated_tiny_llama("nvfp4")
    out = export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="hf"))
    manifest = (out / MANIFEST_NAME).read_text()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f".ckpt.partial-{dead_pid}-0000").mkdir()
    (tmp_path / f".ckpt.partial-{dead_pid}-0000" / "model.safetensors").write_bytes(b"torn")
    live = tmp_path / f".ckpt.partial-{os.getpid()}-1111"
    live.mkdir()
    out.rename(tmp_path / ".ckpt.old-2222")  # killed between moving the old export aside and renaming the new
    with caplog.at_level("WARNING", logger="nemo_fp4qat"):
        actions = recover_interrupted(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / MANIFEST_NAME).read_text() == manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", live.name])
    assert len(actions) == 2 and any("restored" in a for a in actions) and str(dead_pid) in caplog.text
    # an export replacing it later cleans the same way before it starts
    (tmp_path / ".ckpt.old-3333").mkdir()
    export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="hf", overwrite=True))
    assert not (tmp_path / ".ckpt.old-3333").exists()


# --- corrupted exports ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nvfp4_export(tmp_path_factory):
    model = calibrated_tiny_llama("nvfp4", seed=3)
    out = export_checkpoint(model, tmp_path_factory.mktemp("x") / "ckpt", ExportConfig(kind="hf"))
    return model, out


def _corrupt(src, dst, fn):
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    fn(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


def _errors(report):
    return {p.tensor: p.message for p in report.errors}


def test_corrupt_wrong_dtype_is_named(tmp_path, nvfp4_export):
    model, src = nvfp4_export
    name = "model.layers.1.mlp.up_proj.weight_scale"
    bad = _corrupt(src, tmp_path / "c", lambda t: t.__setitem__(name, t[name].float()))
    errs = _errors(validate_export(bad, model=model))
    assert "float8_e4m3fn" in errs[name]


def test_corrupt_missing_scale_is_named(tmp_path, nvfp4_export):
    _, src = nvfp4_export
    name = "model.layers.0.self_attn.o_proj.weight_scale_2"
    bad = _corrupt(src, tmp_path / "c", lambda t: t.pop(name))
    assert "missing" in _errors(validate_export(bad))[name]


def test_corrupt_mismatched_fused_scales_are_named(tmp_path, nvfp4_export):
    _, src = nvfp4_export
    name = "model.layers.0.self_attn.k_proj.input_scale"
    bad = _corrupt(src, tmp_path / "c", lambda t: t.__setitem__(name, t[name] * 1.5))
    errs = _errors(validate_export(bad))
    assert "fused siblings disagree" in errs["model.layers.0.self_attn.{q_proj,k_proj,v_proj}.input_scale"]


@pytest.mark.parametrize(("mod", "attr"), [("self_attn.q_proj", "weight_scale_2"), ("mlp.up_proj", "input_scale")])
def test_each_fused_sibling_and_shared_scale_is_compared(tmp_path, nvfp4_export, mod, attr):
    """TensorRT-LLM fuses q/k/v and gate/up into one GEMM: a change to any one of them (here the first of q/k/v,
    the second of gate/up) and to either shared scale is named."""
    _, src = nvfp4_export
    name = f"model.layers.1.{mod}.{attr}"
    bad = _corrupt(src, tmp_path / "c", lambda t: t.__setitem__(name, t[name] * 1.25))
    group = "{q_proj,k_proj,v_proj}" if "attn" in mod else "{gate_proj,up_proj}"
    parent = mod.split(".")[0]
    msgs = [p.message for p in validate_export(bad).errors if p.tensor == f"model.layers.1.{parent}.{group}.{attr}"]
    assert len(msgs) == 1, msgs  # once per fused group, not once per sibling
    msg = msgs[0]
    assert msg.startswith("fused siblings disagree (") and msg.endswith(
        "TensorRT-LLM loads them as one GEMM with one scale. Train with share_fused_amax=True.")  # fmt: skip


def test_corrupt_fp4_code_is_caught_by_the_numeric_check(tmp_path, nvfp4_export):
    model, src = nvfp4_export
    name = "model.layers.1.mlp.down_proj.weight"

    def flip(t):
        w = t[name].clone()
        w[3, 5] ^= 0x01  # one E2M1 code, one mantissa bit
        t[name] = w

    bad = _corrupt(src, tmp_path / "c", flip)
    assert name not in _errors(validate_export(bad))  # structure alone cannot see it ...
    errs = _errors(validate_export(bad, model=model))
    assert "1 of" in errs[name] and "FP4 codes differ" in errs[name]  # ... the trained model can


def test_tiny_weight_blocks_zero_in_training_are_excused_only_within_their_bound(tmp_path):
    """modelopt's training kernel gives a block whose scale is below 1e-5 the scale 1 (its values
    train as 0) while its exporter keeps the tiny scale: the validator excuses exactly those blocks,
    names them, and still fails a code change in a block whose scale is not tiny."""
    from nemo_fp4qat.numerics.fake_quant import fake_quant_nvfp4

    model = calibrated_tiny_llama("nvfp4", seed=5)
    lin = model.model.layers[0].mlp.down_proj
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        lin.weight[0, :16] = torch.randn(16, generator=g) * 1e-6  # block amax ~3e-6: scale < 1e-5
    trained = lin.weight_quantizer(lin.weight.detach())
    assert torch.count_nonzero(trained[0, :16]) == 0  # the training rule: scale 1, every value rounds to 0
    # the same rule in the pure-torch kernel, written from modelopt's Triton source (independent of the C one)
    assert torch.count_nonzero(fake_quant_nvfp4(lin.weight.detach()[:1, :16] * 1, lin.weight_quantizer._amax)) == 0

    out = export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="hf"))
    report = json.loads((out / "validation.json").read_text())
    name = "model.layers.0.mlp.down_proj.weight"
    assert report["ok"] and report["numeric"]["fp4_tiny_blocks_excused"] == 1
    assert [w["tensor"] for w in report["warnings"]] == [name]
    exported = load_file(str(out / "model.safetensors"))
    assert torch.count_nonzero(exported[name][0, :8]) > 0  # modelopt's exporter did keep the tiny values

    def big_scale(t):  # the same zero-in-training block, now with a scale far above the excuse's bound
        s = t[name + "_scale"].float()
        s[0, 0] = 448.0
        t[name + "_scale"] = s.to(torch.float8_e4m3fn)

    bad = _corrupt(out, tmp_path / "c", big_scale)
    assert "FP4 codes differ" in _errors(validate_export(bad, model=model))[name]


def test_corrupt_excluded_module_carrying_scales_and_runtime_algo(tmp_path, nvfp4_export):
    _, src = nvfp4_export
    bad = _corrupt(src, tmp_path / "c", lambda t: t.__setitem__("lm_head.weight_scale_2", torch.tensor(1.0)))
    assert "excludes this module" in _errors(validate_export(bad))["lm_head.weight"]
    cfg = json.loads((bad / "hf_quant_config.json").read_text())
    cfg["quantization"]["quant_algo"] = "mxfp4"
    (bad / "hf_quant_config.json").write_text(json.dumps(cfg))
    assert "not a TensorRT-LLM QuantAlgo" in _errors(validate_export(bad))["quant_algo"]


def test_truncated_file_is_reported_from_the_manifest(tmp_path, nvfp4_export):
    _, src = nvfp4_export
    bad = tmp_path / "c"
    shutil.copytree(src, bad)
    (bad / "engine_plan.json").write_text("{}")
    assert _errors(validate_export(bad))["engine_plan.json"] == (
        "missing or truncated (size differs from the export manifest).")  # fmt: skip


def test_same_size_change_is_caught_by_the_manifest_hash(tmp_path, nvfp4_export):
    _, src = nvfp4_export
    bad = tmp_path / "c"
    shutil.copytree(src, bad)
    plan = (bad / "engine_plan.json").read_text()
    i = plan.index("max_batch_size") + len("max_batch_size") + 3  # a digit of its value
    flipped = "1" if plan[i] != "1" else "2"
    (bad / "engine_plan.json").write_text(plan[:i] + flipped + plan[i + 1 :])  # same size, other contents
    assert _errors(validate_export(bad))["engine_plan.json"] == (
        "contents differ from the export manifest (sha256): changed after export; re-export.")  # fmt: skip
    assert validate_export(src).ok


@pytest.fixture(scope="module")
def fp8_export(tmp_path_factory):
    model = calibrated_tiny_llama("fp8", seed=4)
    return model, export_checkpoint(model, tmp_path_factory.mktemp("x") / "ckpt", ExportConfig(kind="hf"))


@pytest.mark.parametrize("factor", [1.3, 1.0001])
def test_fp8_weight_scale_off_by_a_factor_is_caught_by_the_numeric_check(tmp_path, fp8_export, factor):
    """Within the rounding of the scale product (2e-6) or it fails: a scale 30% or 0.01% off is an error."""
    model, src = fp8_export
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    bad = _corrupt(src, tmp_path / "c", lambda t: t.__setitem__(name, t[name] * factor))
    assert "model.layers.0.self_attn.o_proj.weight" not in _errors(validate_export(bad))
    errs = _errors(validate_export(bad, model=model))
    assert "differ from the trained fake-quant weights" in errs["model.layers.0.self_attn.o_proj.weight"]
    assert validate_export(src, model=model).ok


def test_validate_cli_exit_codes(tmp_path, nvfp4_export, capsys):
    from nemo_fp4qat.cli import main

    _, src = nvfp4_export
    assert main(["validate", str(src)]) == 0
    bad = _corrupt(src, tmp_path / "c", lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale"))
    assert main(["validate", str(bad)]) == 1
    assert "model.layers.0.mlp.up_proj.weight_scale" in capsys.readouterr().out
    assert main(["validate", str(tmp_path / "nothing")]) == 2


def test_callback_exports_at_the_end_of_training(tmp_path):
    import lightning.pytorch as pl

    from nemo_fp4qat import FP4QATCallback

    from tiny_models import LitLM, loader

    lit = LitLM(tiny_llama(hidden=128))
    cb = FP4QATCallback(policy={"rules": [FULL], "default": "nvfp4"}, schedule="direct", calibration=8,
                        module_getter=lambda m: m.net, export_dir=str(tmp_path / "export"))  # fmt: skip
    pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[cb]).fit(lit, loader())  # fmt: skip
    report = validate_export(tmp_path / "export", model=lit.net)
    assert report.ok and report.numeric["fp4_codes_different"] == 0


def test_the_report_names_the_checkpoint_and_refuses_an_unknown_runtime(nvfp4_export):
    _, src = nvfp4_export
    rep = validate_export(src, runtime="pytorch")
    assert (rep.path, rep.kind, rep.quant_algo, rep.runtime) == (str(src), "hf", "NVFP4", "pytorch")
    assert rep.ok and rep.numeric == {}  # without a model, no numeric check is claimed
    assert rep.format().startswith(f"{src}: hf checkpoint, quant_algo=NVFP4")
    with pytest.raises(ValueError, match=r"Unknown runtime 'tensorrt'; choose one of trtllm, vllm, sglang, pytorch\."):
        validate_export(src, runtime="tensorrt")


def test_a_checkpoint_without_the_manifest_is_flagged_unless_not_required(tmp_path, nvfp4_export):
    _, src = nvfp4_export
    bad = tmp_path / "c"
    shutil.copytree(src, bad)
    (bad / MANIFEST_NAME).unlink()
    rep = validate_export(bad)
    assert rep.ok and [(p.tensor, p.message) for p in rep.warnings] == [
        (str(bad), "no nemo_fp4qat manifest: not written by nemo-fp4qat export.")]  # fmt: skip
    assert validate_export(bad, require_manifest=False).warnings == []


def _with_quant_config(src, dst, **changes):
    """A copy of the export at ``src`` whose quantization config has ``changes`` (hf or trtllm kind)."""
    shutil.copytree(src, dst)
    f = dst / ("hf_quant_config.json" if (dst / "hf_quant_config.json").is_file() else "config.json")
    cfg = json.loads(f.read_text())
    cfg["quantization"].update(changes)
    f.write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("algo", [None, "mxfp4", "MXFP4", "FP5"])
def test_a_quant_algo_the_runtime_cannot_load_is_an_error_with_the_fix(tmp_path, nvfp4_export, algo):
    """No quant_algo at all, modelopt's dense 'mxfp4' (the fix names the MXFP4 algos TRT-LLM has), or any
    other name TRT-LLM lacks: an error on quant_algo; this plugin's own server (runtime='pytorch') takes
    what it can unpack."""
    _, src = nvfp4_export
    bad = _with_quant_config(src, tmp_path / "c", quant_algo=algo)
    msg = _errors(validate_export(bad, require_manifest=False))["quant_algo"]
    if algo is None:
        assert msg == "not set: the checkpoint declares no quantization."
        return
    fix = (" (modelopt writes 'mxfp4' for dense MXFP4; TRT-LLM deploys MXFP4 only as W4A8_MXFP4_FP8/W4A16_MXFP4)"
           if algo.lower() == "mxfp4" else "")  # fmt: skip
    assert msg == (f"{algo!r} is not a TensorRT-LLM QuantAlgo{fix}; re-export with a format TRT-LLM deploys, or "
                   "validate with runtime='pytorch' for this plugin's own server.")  # fmt: skip
    assert "quant_algo" not in _errors(validate_export(bad, runtime="pytorch", require_manifest=False))


def test_a_kv_cache_algo_the_runtime_lacks_is_named(tmp_path, nvfp4_export):
    _, src = nvfp4_export
    bad = _with_quant_config(src, tmp_path / "c", kv_cache_quant_algo="INT4")
    msgs = [p.message for p in validate_export(bad).errors if p.tensor == "kv_cache_quant_algo"]
    assert msgs == ["'INT4' is not one of ['FP8', 'INT8', 'NVFP4'].",
                    "declares INT4 but no KV-cache scale tensors (k_scale/v_scale) exist."]  # fmt: skip


def test_awq_scales_are_checked_against_the_declared_group_size(tmp_path):
    """INT4 AWQ's weight_scale has one column per group of the config's group_size (128 here): a config that
    declares 64 does not fit the scales the checkpoint carries."""
    model = calibrated_tiny_llama("int4_awq")
    src = export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="hf"))
    assert validate_export(src, model=model).ok
    errs = _errors(validate_export(_with_quant_config(src, tmp_path / "c", group_size=64)))
    t = load_file(str(src / "model.safetensors"))
    w, s = (tuple(t[f"model.layers.0.mlp.down_proj.{n}"].shape) for n in ("weight", "weight_scale"))
    o, i = w[0] * 2, w[1]  # two INT4 rows per byte
    assert errs["model.layers.0.mlp.down_proj.weight_scale"] == (
        f"shape {s} does not fit W4A16_AWQ with weight {w} (expected {(o, i // 64)} or {(i // 64, o)}).")  # fmt: skip


def test_tensor_parallel_ranks_that_disagree_on_a_shared_scale_are_named(tmp_path):
    model = calibrated_tiny_llama("nvfp4")
    src = export_checkpoint(model, tmp_path / "tp2", ExportConfig(kind="trtllm", tensor_parallel=2))
    bad = tmp_path / "c"
    shutil.copytree(src, bad)
    r1 = load_file(str(bad / "rank1.safetensors"))
    r1["transformer.layers.0.attention.dense.activation_scaling_factor"] *= 2  # TRT-LLM's name for input_scale
    save_file(r1, str(bad / "rank1.safetensors"))
    errs = _errors(validate_export(bad))
    assert (
        errs["transformer.layers.0.attention.dense.input_scale"]
        == "tensor-parallel ranks disagree on this shared scale."
    )


def test_a_model_that_does_not_match_the_export_is_named_not_compared(nvfp4_export):
    """Validating against a model whose layers are named otherwise (here: wrapped one level deeper) compares
    nothing, and says so per layer and overall instead of passing the numeric check silently."""
    model, src = nvfp4_export
    rep = validate_export(src, model=torch.nn.ModuleDict({"inner": model}))
    quantized = [m for m, a in rep.layers.items() if a is not None]
    assert rep.numeric["layers_without_counterpart"] == len(quantized) == 14
    assert rep.numeric["layers_skipped"] == dict.fromkeys(
        quantized, "no layer of the given model maps to this exported layer")  # fmt: skip
    assert "layers_compared" not in rep.numeric
    assert [(p.tensor, p.message) for p in rep.warnings] == [
        (str(src), "no exported layer matched a model layer: numeric check skipped.")]  # fmt: skip


def test_a_layer_declared_quantized_but_stored_in_full_precision_is_named(tmp_path, nvfp4_export):
    model, src = nvfp4_export
    mod = "model.layers.1.mlp.gate_proj"

    def dequantized(t):
        for k in [k for k in t if k.startswith(f"{mod}.")]:
            t.pop(k)
        t[f"{mod}.weight"] = model.model.layers[1].mlp.gate_proj.weight.detach().clone()

    errs = _errors(validate_export(_corrupt(src, tmp_path / "c", dequantized)))
    assert errs[f"{mod}.weight_scale"].startswith("missing: a NVFP4 layer needs weight_scale")


def test_a_mixed_precision_layer_algo_trtllm_lacks_is_named_and_the_rest_still_checked(tmp_path):
    model = calibrated_tiny_llama("trtllm_mixed")
    src = export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="hf"))
    layers = json.loads((src / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    mod = sorted(layers)[0]
    layers[mod] = {**layers[mod], "quant_algo": "FP5"}
    layers["model.layers.9.mlp.up_proj"] = layers[sorted(layers)[1]]  # a layer the model does not have
    bad = _with_quant_config(src, tmp_path / "c", quantized_layers=layers)
    rep = validate_export(bad)
    assert _errors(rep)["model.layers.9.mlp.up_proj"] == (
        "listed in quantized_layers but the checkpoint has no tensors for it.")  # fmt: skip
    assert [p.message for p in rep.errors if p.tensor == mod] == [
        "layer quant_algo 'FP5' is not a TensorRT-LLM QuantAlgo.", "no layout known for quant_algo 'FP5'."]  # fmt: skip
    assert rep.layers == validate_export(src).layers | {mod: "FP5"}  # every other layer still checked
    assert [p.tensor for p in validate_export(bad, runtime="pytorch").errors if p.tensor == mod] == [mod]


def test_layout_errors_name_each_tensor_and_what_it_should_be(tmp_path, nvfp4_export):
    """Every layout problem of a layer is named (not only the first), with the dtype or shape it should have,
    and a layer whose layout is broken is not also reported by the numeric check (it cannot be unpacked)."""
    model, src = nvfp4_export
    layers = [(0, "mlp.down_proj"), (1, "mlp.down_proj"), (1, "self_attn.o_proj"), (0, "self_attn.o_proj")]
    a, b, c, d = (f"model.layers.{i}.{m}" for i, m in layers)

    def corrupt(t):
        t.pop(f"{a}.weight_scale_2"), t.pop(f"{a}.input_scale")
        t[f"{b}.input_scale"] = torch.tensor([1.0, 2.0])
        t[f"{c}.input_scale"] = torch.tensor(float("nan"))
        t[f"{d}.weight_scale"] = t[f"{d}.weight_scale"].float()

    rep = validate_export(_corrupt(src, tmp_path / "c", corrupt), model=model)
    errs = {(p.tensor, p.message) for p in rep.errors if not p.tensor.endswith(".safetensors")}
    w = tuple(load_file(str(src / "model.safetensors"))[f"{b}.weight"].shape)
    assert errs == {
        (f"{a}.weight_scale_2", "missing: a NVFP4 layer needs weight_scale_2 (scale tensors are part of the "
         "checkpoint format)."),
        (f"{a}.input_scale", "missing: a NVFP4 layer needs input_scale (scale tensors are part of the checkpoint "
         "format)."),
        (f"{b}.input_scale", f"shape (2,) does not fit NVFP4 with weight {w} (expected a per-tensor scalar)."),
        (f"{c}.input_scale", "contains NaN/Inf."),
        (f"{d}.weight_scale", "dtype torch.float32 but NVFP4 requires torch.float8_e4m3fn."),
    }  # fmt: skip


def test_an_optional_smoothing_scale_that_does_not_fit_is_named(tmp_path):
    """pre_quant_scale is optional (modelopt folds it into the norm for fused siblings) but, where present,
    must have one entry per input channel."""
    model = calibrated_tiny_llama("int8_sq")
    src = export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="hf"))
    tensors = load_file(str(src / "model.safetensors"))
    name = next(k for k in tensors if k.endswith(".pre_quant_scale"))
    w = tuple(tensors[name.replace("pre_quant_scale", "weight")].shape)
    bad = _corrupt(src, tmp_path / "c", lambda t: t.__setitem__(name, t[name][:-1]))
    assert _errors(validate_export(bad))[name] == (
        f"shape ({w[1] - 1},) does not fit W8A8_SQ_PER_CHANNEL with weight {w} (expected {w[1]} values).")  # fmt: skip


# --- the unquantized tensors (embeddings, norms, lm_head) -----------------------------------------
@pytest.mark.parametrize("trained", [torch.float32, torch.bfloat16], ids=str)
def test_trtllm_checkpoints_unquantized_tensors_are_the_models_in_the_checkpoints_dtype(tmp_path, trained):
    """A TensorRT-LLM checkpoint holds the embeddings, norms and lm_head of a bfloat16-trained model in bfloat16,
    exactly, and a float32-trained model's in float16 (the closest 16-bit dtype; TensorRT-LLM checkpoints hold no
    float32), declared so in config.json; each equals the model's tensor rounded once to that dtype. A
    float32 TensorRT-LLM checkpoint is refused by name."""
    model = calibrated_tiny_llama("nvfp4", dtype=trained)
    out = export_checkpoint(model, tmp_path / "trt", ExportConfig(kind="trtllm"))
    want = torch.bfloat16 if trained == torch.bfloat16 else torch.float16
    assert json.loads((out / "config.json").read_text())["dtype"] == str(want).replace("torch.", "")
    t = load_file(str(out / "rank0.safetensors"))
    norm = model.model.layers[1].post_attention_layernorm.weight
    for name, ref in [("transformer.vocab_embedding.weight", model.model.embed_tokens.weight),
                      ("transformer.layers.1.post_layernorm.weight", norm),
                      ("lm_head.weight", model.lm_head.weight)]:  # fmt: skip
        assert t[name].dtype == want and torch.equal(t[name], ref.detach().to(want)), name
    rep = validate_export(out, model=model)
    assert rep.ok and rep.numeric["unquantized_compared"] >= 2 + 2 * 2 and "unquantized_different" not in rep.numeric
    with pytest.raises(ValueError, match="dtype='float16' or 'bfloat16'"):
        ExportConfig(kind="trtllm", dtype="float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_float32_models_hf_checkpoint_in_a_16_bit_dtype_keeps_the_trained_codes(tmp_path, dtype):
    """A float32 model's unified HF checkpoint asked for the 16-bit dtype the engines run declares it, holds its
    embeddings, norms and lm_head rounded once to it, and keeps every FP4 code and scale of the float32 export
    (packed from the float32 weights; modelopt alone casts before packing, so codes would move); it validates.
    A config.json that declares another dtype than the tensors' is named. float16 is the default for the engines;
    runtime='pytorch' (this plugin's server) keeps float32."""
    model = calibrated_tiny_llama("nvfp4", seed=3)
    full = export_checkpoint(model, tmp_path / "f32", ExportConfig(kind="hf", runtime="pytorch"))
    half = export_checkpoint(
        model, tmp_path / dtype, ExportConfig(kind="hf", dtype=None if dtype == "float16" else dtype)
    )
    want = getattr(torch, dtype)
    assert json.loads((full / "config.json").read_text())["torch_dtype"] == "float32"
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == dtype
    a, b = load_file(str(full / "model.safetensors")), load_file(str(half / "model.safetensors"))
    assert a.keys() == b.keys()
    rounded = 0
    for k, t in b.items():
        if t.dtype == want:  # an unquantized tensor: the float32 export's, rounded once
            assert a[k].dtype == torch.float32 and torch.equal(t, a[k].to(want)), k
            rounded += 1
        else:  # packed codes and scales: exactly the float32 export's
            same_bits = torch.equal(t.reshape(-1).view(torch.uint8), a[k].reshape(-1).view(torch.uint8))
            assert t.dtype == a[k].dtype and same_bits, k
    assert rounded >= 1 + 2 * 2 + 1  # embedding, 2 norms per layer, final norm
    rep = validate_export(half, model=model)
    assert rep.ok, rep.format()
    for_engine = validate_export(full, runtime="vllm")  # the float32 checkpoint read as an engine would run it
    assert [w.tensor for w in for_engine.warnings if "declares float32" in w.message] == ["config.json"]
    assert not [w for w in rep.warnings if "declares float32" in w.message]
    assert rep.numeric["fp4_codes_different"] == 0 and rep.numeric["unquantized_compared"] >= rounded
    other = "float16" if dtype == "bfloat16" else "bfloat16"
    bad = tmp_path / "declares_other"
    shutil.copytree(half, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["torch_dtype"] = other
    (bad / "config.json").write_text(json.dumps(cfg))
    errs = _errors(validate_export(bad, model=model, require_manifest=False))
    assert errs["model.norm.weight"] == f"stored as torch.{dtype} but config.json declares dtype {other!r}."


@pytest.mark.parametrize("runtime", ["trtllm", "vllm", "sglang"])
def test_an_export_for_an_engine_is_16_bit_and_of_a_kind_the_engine_loads(runtime):
    with pytest.raises(ValueError, match=f"dtype='float32' for runtime='{runtime}': TensorRT-LLM, vLLM and SGLang run"):
        ExportConfig(kind="hf", runtime=runtime, dtype="float32")
    assert ExportConfig(kind="hf", runtime="pytorch", dtype="float32").dtype == "float32"
    if runtime != "trtllm":
        with pytest.raises(ValueError, match=f"kind='trtllm' for runtime='{runtime}': vLLM and SGLang load unified HF"):
            ExportConfig(kind="trtllm", runtime=runtime)


@pytest.mark.parametrize(
    ("runtime", "fmt", "algo"),
    [("vllm", "int8_sq", "W8A8_SQ_PER_CHANNEL"), ("sglang", "int4_awq", "W4A16_AWQ"), ("vllm", "int8_wo", "W8A16")],
)
def test_an_export_for_vllm_or_sglang_refuses_a_format_its_loader_has_no_kernel_for(tmp_path, runtime, fmt, algo):
    """modelopt's own get_quant_config says which algorithm each layer will declare; one the engine's modelopt
    loader has no linear kernel for is refused before anything is written, and the validator names it too."""
    if fmt == "int8_wo" and not uses_list_config():
        pytest.skip("modelopt 0.37 mislabels weight-only INT8: refused up front for every runtime")
    model = calibrated_tiny_llama(fmt)
    engine = {"vllm": "vLLM", "sglang": "SGLang"}[runtime]
    with pytest.raises(ExportRefused, match=f"every quantized layer: quant_algo {algo}, which {engine}'s modelopt"):
        export_checkpoint(model, tmp_path / "x", ExportConfig(kind="hf", runtime=runtime))
    assert not (tmp_path / "x").exists()
    out = export_checkpoint(model, tmp_path / "y", ExportConfig(kind="hf"))  # TensorRT-LLM runs it
    errs = _errors(validate_export(out, runtime=runtime))
    assert errs["quant_algo"].startswith(f"{algo!r} has no kernel in {runtime}'s modelopt loader")


def test_mxfp8_attention_exports_for_vllm_and_sglang_and_is_refused_for_tensorrt_llm(tmp_path):
    if not uses_list_config():
        pytest.skip("modelopt 0.37 exports MXFP8 as another format: refused up front for every runtime")
    model = calibrated_tiny_llama("conservative_attention")
    with pytest.raises(ExportRefused, match="weights are mxfp8, which TensorRT-LLM has no kernel for"):
        export_checkpoint(model, tmp_path / "trt", ExportConfig(kind="hf", runtime="trtllm"))
    out = export_checkpoint(model, tmp_path / "hf", ExportConfig(kind="hf", runtime="vllm"))
    for runtime in ("vllm", "sglang"):
        rep = validate_export(out, model=model, runtime=runtime)
        assert rep.ok and set(rep.layers.values()) == {"MXFP8", "NVFP4", None}, rep.format()
    assert not validate_export(out, runtime="trtllm").ok


@pytest.mark.parametrize("kind", ["hf", "trtllm"])
def test_unquantized_tensors_that_differ_from_the_model_are_named(tmp_path, kind):
    """The validator compares the unquantized tensors too: a norm the model has changed since the export (as if
    the export had been written from other weights) is named, with the dtype it was compared in."""
    model = calibrated_tiny_llama("nvfp4", seed=5)
    out = export_checkpoint(model, tmp_path / kind, ExportConfig(kind=kind))
    assert validate_export(out, model=model).ok
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.mul_(1.5)
    errs = _errors(validate_export(out, model=model))
    name = "model.layers.0.input_layernorm.weight" if kind == "hf" else "transformer.layers.0.input_layernorm.weight"
    assert "differs from the trained model's tensor" in errs[name]
    assert len([e for e in errs if "layernorm" in e]) == 1


@pytest.mark.parametrize("policy", ["nvfp4", "default"])
@pytest.mark.parametrize("kind", ["hf", "trtllm"])
def test_a_bfloat16_model_validates_code_for_code_and_a_flipped_code_is_still_caught(tmp_path, kind, policy):
    """A bfloat16 model (how models train on GPUs) trains on ``code * scale`` rounded to bfloat16: its exports
    validate with every FP4 code equal, the comparison allowing exactly that rounding, and with every FP8 weight
    as trained (the default policy's attention; modelopt's HF exporter alone would divide FP8 weights in bfloat16
    and move some of them by an E4M3 step); one FP4 code moved to its neighbour is still an error."""
    model = calibrated_tiny_llama(policy, dtype=torch.bfloat16)
    out = export_checkpoint(model, tmp_path / kind, ExportConfig(kind=kind))
    report = validate_export(out, model=model)
    assert report.ok and report.numeric["fp4_codes_compared"] > 0 and report.numeric["fp4_codes_different"] == 0
    assert report.numeric["layers_compared"] == (14 if kind == "hf" else 10)
    if kind != "hf" or policy != "nvfp4":
        return
    name = "model.layers.0.mlp.up_proj.weight"

    def flip(t):
        w = t[name].clone()
        w.view(-1)[0] ^= 1  # the low nibble's code, one step along E2M1
        t[name] = w

    errs = _errors(validate_export(_corrupt(out, tmp_path / "bad", flip), model=model))
    assert "FP4 codes differ" in errs[name]


def test_a_trtllm_checkpoint_with_another_rotary_base_than_trained_is_named(tmp_path):
    """TensorRT-LLM runs the rotary base the checkpoint's config.json names (its default where none): a base other
    than the model's rope_theta serves another model."""
    model = calibrated_tiny_llama("nvfp4", seed=3)
    out = export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind="trtllm"))
    config = json.loads((out / "config.json").read_text())
    rope = getattr(model.config, "rope_parameters", None) or {"rope_theta": model.config.rope_theta}
    assert config["rotary_base"] == rope["rope_theta"]
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (bad / "config.json").write_text(json.dumps({**config, "rotary_base": 500000.0}))
    report = validate_export(bad, model=model)
    errors = [p.message for p in report.errors if p.tensor == "config.json"]
    assert any("rotary_base 500000 but the model was trained with rope_theta 10000" in e for e in errors), errors
