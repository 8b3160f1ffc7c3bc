"""SGLang's own parser and loader on a unified HF export (runs in the SGLang environment: ``make test-engines``).

Usage: ``python sglang_parser_worker.py EXPORT_DIR OUT_JSON [ALGOS_JSON]``. Builds SGLang's ``ModelConfig``
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

from engine_layers import engine_linear_prefixes

# the linear methods SGLang 0.5.23's ModelOptMixedPrecisionConfig hands out, by the format each runs
METHOD_FORMAT = {
    "ModelOptFp8LinearMethod": "FP8",
    "ModelOptFp4LinearMethod": "NVFP4",
    "ModelOptNvFp4A16LinearMethod": "W4A16_NVFP4",
    "Fp8LinearMethod": "FP8 block / MXFP8",
    "UnquantizedLinearMethod": None,
}


def main(export_dir: str, out_json: str, algos_json: str | None = None) -> None:
    import sglang
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.model_loader.loader import _get_quantization_config

    mc = ModelConfig(model_path=export_dir)
    cfg = _get_quantization_config(mc, LoadConfig())
    # get_quant_method only asks whether the layer is one of SGLang's linear classes; building a real one needs
    # SGLang's tensor-parallel groups, so an uninitialised instance of its own LinearBase stands in
    layer = LinearBase.__new__(LinearBase)
    layers = {}
    for prefix in engine_linear_prefixes(export_dir):
        method = type(cfg.get_quant_method(layer, prefix)).__name__
        layers[prefix] = {"method": method, "format": METHOD_FORMAT.get(method, method),
                          "algo": cfg.resolve_quant_algo(prefix)}  # fmt: skip
    probe, table = "model.layers.0.mlp.down_proj", cfg.quantized_layers
    methods = {}
    for algo in json.loads(algos_json) if algos_json else []:
        cfg.quantized_layers = {probe: {"quant_algo": algo, "group_size": 16}}
        methods[algo] = type(cfg.get_quant_method(layer, probe)).__name__
    cfg.quantized_layers = table
    Path(out_json).write_text(json.dumps({
        "sglang": sglang.__version__, "quantization": mc.quantization, "dtype": str(mc.dtype).removeprefix("torch."),
        "config": type(cfg).__name__, "kv_cache_quant_algo": cfg.kv_cache_quant_algo,
        "exclude_modules": sorted(cfg.exclude_modules), "layers": layers, "methods": methods,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:4])
