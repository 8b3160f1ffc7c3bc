"""vLLM's own parser on a unified HF export (runs in the engines environment: ``make test-engines``).

Usage: ``python vllm_parser_worker.py EXPORT_DIR OUT_JSON``. Builds vLLM's quantization config from the export's
``config.json`` the way vLLM's loader does (the method whose ``override_quantization_method`` claims it, then its
``from_config``, with Llama's ``packed_modules_mapping``), and writes, for every linear layer of the vLLM model
(q/k/v fused into ``qkv_proj``, gate/up into ``gate_up_proj``), the format vLLM resolves and whether it is excluded;
for every fused MoE layer (one per ``<layer>.experts``) the method vLLM's ``get_quant_method`` picks and the format
of its sub-config; and the per-layer algorithms vLLM's modelopt loader has linear kernels for (``LINEAR_ALGOS``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engine_layers import LLAMA_PACKED, engine_linear_prefixes, engine_moe_prefixes


def main(export_dir: str, out_json: str) -> None:
    import vllm
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    from vllm.model_executor.layers.quantization.modelopt import LINEAR_ALGOS

    qc = json.loads((Path(export_dir) / "config.json").read_text())["quantization_config"]
    claimed = []
    for name in QUANTIZATION_METHODS:
        try:
            cls = get_quantization_config(name)
        except (ImportError, ValueError):  # a method whose kernels this build lacks
            continue
        got = cls.override_quantization_method(qc, None)
        if got is not None:
            claimed.append(got)
    method = claimed[0] if claimed else qc.get("quant_method")
    cfg = get_quantization_config(method).from_config(qc)
    cfg.packed_modules_mapping = dict(LLAMA_PACKED)  # what vLLM's model loader hands the config for a Llama

    def algo_of(prefix: str) -> str | None:
        """The per-layer algorithm a mixed-precision config resolves; a single-format config's own (``FP8`` for a
        checkpoint whose every quantized layer is FP8) for what it does not exclude."""
        if cfg.is_layer_excluded(prefix):
            return None
        return cfg._resolve_quant_algo(prefix) if hasattr(cfg, "_resolve_quant_algo") else qc.get("quant_algo")

    layers = {}
    for prefix in engine_linear_prefixes(export_dir):
        layers[prefix] = {"excluded": bool(cfg.is_layer_excluded(prefix)), "algo": algo_of(prefix)}
    moe = engine_moe_prefixes(export_dir)
    if moe:
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.quantization import modelopt

        # get_quant_method only asks whether the layer is vLLM's RoutedExperts; building a real one needs vLLM's
        # parallel config, so an uninitialised instance stands in. The fused MoE methods pick a GPU kernel backend
        # when built: here the question is only which method vLLM picks, so they are built without that step.
        layer = RoutedExperts.__new__(RoutedExperts)
        layer.moe_config = None

        def keep_config(self, quant_config=None, moe_config=None):
            self.quant_config = quant_config

        for name in ("ModelOptNvFp4FusedMoE", "ModelOptFp8MoEMethod", "ModelOptMxFp8FusedMoE"):
            getattr(modelopt, name).__init__ = keep_config
        for prefix in moe:
            method = cfg.get_quant_method(layer, prefix)
            sub = getattr(method, "quant_config", None)
            layers[prefix] = {"excluded": bool(cfg.is_layer_excluded(prefix)), "method": type(method).__name__,
                              "algo": algo_of(prefix),
                              "config": None if sub is None else type(sub).__name__}  # fmt: skip
    got = {"vllm": vllm.__version__, "claimed": claimed, "method": cfg.get_name(), "layers": layers,
           "linear_algos": sorted(LINEAR_ALGOS)}  # fmt: skip
    Path(out_json).write_text(json.dumps(got, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
