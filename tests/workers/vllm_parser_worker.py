"""vLLM's own parser on a unified HF export (runs in the engines environment: ``make test-engines``).

Usage: ``python vllm_parser_worker.py EXPORT_DIR OUT_JSON`` (or ``--many PAIRS_JSON``: engine_layers.run_many).
Builds vLLM's quantization config from the export's
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
from types import SimpleNamespace

from engine_layers import LLAMA_PACKED, engine_linear_layers, engine_moe_prefixes, run_many


def main(export_dir: str, out_json: str) -> None:
    import vllm
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    from vllm.model_executor.layers.quantization.modelopt import LINEAR_ALGOS

    config = json.loads((Path(export_dir) / "config.json").read_text())
    qc = config["quantization_config"]
    hf_config = SimpleNamespace(**config)  # what vLLM hands the methods: gpt-oss's is claimed by its model_type
    claimed = []
    for name in QUANTIZATION_METHODS:
        try:
            cls = get_quantization_config(name)
        except (ImportError, ValueError):  # a method whose kernels this build lacks
            continue
        got = cls.override_quantization_method(qc, None, hf_config=hf_config)
        if got is not None:
            claimed.append(got)
    method = claimed[0] if claimed else qc.get("quant_method")
    cfg = get_quantization_config(method).from_config(qc)
    from vllm import ModelRegistry

    # what vLLM's model loader hands the config: the packing of the model class the checkpoint names (Llama's where
    # vLLM has none for it)
    registered = [a in ModelRegistry.get_supported_archs() for a in config.get("architectures", [])]
    model_cls = ModelRegistry._try_load_model_cls(config["architectures"][0]) if all(registered) else None
    packed = dict(getattr(model_cls, "packed_modules_mapping", None) or LLAMA_PACKED)
    cfg.packed_modules_mapping = packed

    from vllm.model_executor.layers.linear import LinearBase

    def excluded(prefix: str, layer: object) -> bool:
        """modelopt's configs name excluded layers; the others say it through the linear method they give."""
        if hasattr(cfg, "is_layer_excluded"):
            return bool(cfg.is_layer_excluded(prefix))
        return type(cfg.get_quant_method(layer, prefix)).__name__ == "UnquantizedLinearMethod"

    def algo_of(prefix: str, layer: object) -> str | None:
        """The per-layer algorithm a mixed-precision config resolves; a single-format config's own (``FP8`` for a
        checkpoint whose every quantized layer is FP8) for what it does not exclude."""
        if excluded(prefix, layer):
            return None
        return cfg._resolve_quant_algo(prefix) if hasattr(cfg, "_resolve_quant_algo") else qc.get("quant_algo")

    linear = LinearBase.__new__(LinearBase)  # get_quant_method asks only what kind of layer it is
    layers, shards_of = {}, {}
    for prefix, shards in engine_linear_layers(export_dir, packed).items():
        layers[prefix] = {"excluded": excluded(prefix, linear), "algo": algo_of(prefix, linear)}
        shards_of[prefix] = shards
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
        from vllm.model_executor.layers.quantization import mxfp4

        mxfp4.GptOssMxfp4MoEMethod.__init__ = mxfp4.Mxfp4MoEMethod.__init__ = keep_config
        for prefix in moe:
            method = cfg.get_quant_method(layer, prefix)
            sub = getattr(method, "quant_config", None)
            layers[prefix] = {"excluded": excluded(prefix, layer), "method": type(method).__name__,
                              "algo": algo_of(prefix, layer),
                              "config": None if sub is None else type(sub).__name__}  # fmt: skip
    got = {"vllm": vllm.__version__, "claimed": claimed, "method": cfg.get_name(), "layers": layers,
           "linear_algos": sorted(LINEAR_ALGOS), "registered": registered, "shards": shards_of}  # fmt: skip
    if config.get("architectures") == ["GptOssForCausalLM"]:
        got["gpt_oss"] = _gpt_oss_weights(export_dir, config)
    Path(out_json).write_text(json.dumps(got, indent=1))


def _gpt_oss_weights(export_dir: str, config: dict) -> dict:
    """vLLM's gpt-oss loader on the export's tensors: the name its weights mapper gives each, and whether each expert
    tensor has the shape the parameter its MXFP4 MoE method creates would take after the loader's reshape."""
    from safetensors import safe_open
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

    experts, hidden, inter = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    # Mxfp4MoEMethod.create_weights: w13 [E, 2F, H / 2] uint8, [E, 2F, H / 32] scales; w2 [E, H, F / 2], [E, H, F / 32]
    params = {"w13_weight": [experts, 2 * inter, hidden // 2], "w13_weight_scale": [experts, 2 * inter, hidden // 32],
              "w2_weight": [experts, hidden, inter // 2],
              "w2_weight_scale": [experts, hidden, inter // 32]}  # fmt: skip
    out = {}
    for f in sorted(Path(export_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                name = GptOssForCausalLM.hf_to_vllm_mapper.map_name(key)
                shape = list(st.get_slice(key).get_shape())
                leaf = name.rpartition(".")[2]
                if leaf in params:  # the loader views blocks as [E, 2F, -1] (w13) or [E, -1, F / 2] (w2)
                    n = shape[0] * shape[1] * (shape[2] * shape[3] if len(shape) == 4 else shape[2])
                    shape = [shape[0], shape[1], n // (shape[0] * shape[1])]
                out[key] = {"name": name, "shape_fits": params.get(leaf, shape) == shape}
    return out


if __name__ == "__main__":
    run_many(main, sys.argv[1:])
