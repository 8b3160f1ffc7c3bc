"""SGLang's own parser and loader on a unified HF export (runs in the SGLang environment: ``make test-engines``).

Usage: ``python sglang_parser_worker.py EXPORT_DIR OUT_JSON [ALGOS_JSON]`` (or ``--many PAIRS_JSON``:
engine_layers.run_many). Builds SGLang's ``ModelConfig``
from the export (the quantization method and the dtype it would run), then the quantization config its model
loader builds for the checkpoint's architecture (``model_loader.loader._get_quantization_config``, with the model
class's own ``packed_modules_mapping``), and writes, for every linear layer of SGLang's Llama, the format SGLang
resolves and the linear method ``get_quant_method`` gives it. With ``ALGOS_JSON`` (a JSON list of ``quant_algo``
names), also the method that config gives a layer declared in each of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engine_layers import LLAMA_PACKED, engine_linear_layers, engine_moe_prefixes, run_many

# the linear methods SGLang 0.5.23's ModelOptMixedPrecisionConfig hands out, by the format each runs
METHOD_FORMAT = {
    "ModelOptFp8LinearMethod": "FP8",
    "ModelOptFp4LinearMethod": "NVFP4",
    "ModelOptNvFp4A16LinearMethod": "W4A16_NVFP4",
    "Fp8LinearMethod": "FP8 block / MXFP8",
    "UnquantizedLinearMethod": None,
    # fused MoE layers (all experts of a layer in one method)
    "ModelOptNvFp4FusedMoEMethod": "NVFP4",
    "ModelOptFp8MoEMethod": "FP8",
    "NoneType": None,
}


def main(export_dir: str, out_json: str, algos_json: str | None = None) -> None:
    import sglang
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.model_loader.loader import _get_quantization_config
    from sglang.srt.models.registry import ModelRegistry

    archs = json.loads((Path(export_dir) / "config.json").read_text()).get("architectures", [])
    registered = [a in ModelRegistry.get_supported_archs() for a in archs]
    if not all(registered):  # SGLang refuses to build a config for a model it has no class for
        Path(out_json).write_text(json.dumps({"registered": registered, "layers": {}}))
        return
    packed = dict(getattr(ModelRegistry._try_load_model_cls(archs[0]), "packed_modules_mapping", None) or LLAMA_PACKED)
    mc = ModelConfig(model_path=export_dir)
    cfg = _get_quantization_config(mc, LoadConfig())
    declared = json.loads((Path(export_dir) / "config.json").read_text())["quantization_config"].get("quant_algo")

    def algo_of(prefix: str, method: str) -> str | None:
        """The per-layer algorithm a mixed-precision config resolves; a single-format config's own for what it
        quantizes."""
        if hasattr(cfg, "resolve_quant_algo"):
            return cfg.resolve_quant_algo(prefix)
        return None if METHOD_FORMAT.get(method, method) is None else declared

    # get_quant_method only asks whether the layer is one of SGLang's linear classes; building a real one needs
    # SGLang's tensor-parallel groups, so an uninitialised instance of its own LinearBase stands in
    layer = LinearBase.__new__(LinearBase)
    layers, shards_of = {}, {}
    for prefix, shards in engine_linear_layers(export_dir, packed).items():
        method = type(cfg.get_quant_method(layer, prefix)).__name__
        layers[prefix] = {"method": method, "format": METHOD_FORMAT.get(method, method),
                          "algo": algo_of(prefix, method)}  # fmt: skip
        shards_of[prefix] = shards
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.quantization import modelopt_quant

    moe = FusedMoE.__new__(FusedMoE)  # likewise for the fused MoE layer (all of a layer's experts)
    # the fused MoE methods check for a GPU kernel backend when built (NVFP4: Blackwell, or Marlin on SM80+): here
    # the question is only which method SGLang picks for the layer, so they are built without that check
    for name in ("ModelOptNvFp4FusedMoEMethod", "ModelOptFp8MoEMethod"):
        getattr(modelopt_quant, name).__init__ = lambda self, *a, **k: None
    for prefix in engine_moe_prefixes(export_dir):
        method = type(cfg.get_quant_method(moe, prefix)).__name__
        layers[prefix] = {"method": method, "format": METHOD_FORMAT.get(method, method),
                          "algo": algo_of(prefix, method)}  # fmt: skip
    methods = {}
    if algos_json:  # a mixed-precision config, asked per algorithm
        probe, table = "model.layers.0.mlp.down_proj", cfg.quantized_layers
        for algo in json.loads(algos_json):
            cfg.quantized_layers = {probe: {"quant_algo": algo, "group_size": 16}}
            methods[algo] = type(cfg.get_quant_method(layer, probe)).__name__
        cfg.quantized_layers = table
    Path(out_json).write_text(json.dumps({
        "registered": registered, "shards": shards_of,
        "sglang": sglang.__version__, "quantization": mc.quantization, "dtype": str(mc.dtype).removeprefix("torch."),
        "config": type(cfg).__name__, "kv_cache_quant_algo": cfg.kv_cache_quant_algo,
        "exclude_modules": sorted(getattr(cfg, "exclude_modules", None) or []), "layers": layers, "methods": methods,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    run_many(main, sys.argv[1:])
