"""vLLM's own parser on a unified HF export (runs in the engines environment: ``make test-engines``).

Usage: ``python vllm_parser_worker.py EXPORT_DIR OUT_JSON``. Builds vLLM's quantization config from the export's
``config.json`` the way vLLM's loader does (the method whose ``override_quantization_method`` claims it, then its
``from_config``, with Llama's ``packed_modules_mapping``), and writes, for every linear layer of the vLLM model
(q/k/v fused into ``qkv_proj``, gate/up into ``gate_up_proj``), the format vLLM resolves and whether it is excluded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def vllm_prefixes(checkpoint_modules: list[str]) -> list[str]:
    """The vLLM Llama's linear layers for the checkpoint's modules (shards folded into their fused module)."""
    shard_to_fused = {s: f for f, shards in LLAMA_PACKED.items() for s in shards}
    out = set()
    for m in checkpoint_modules:
        head, _, leaf = m.rpartition(".")
        out.add(f"{head}.{shard_to_fused[leaf]}" if leaf in shard_to_fused else m)
    return sorted(out)


def main(export_dir: str, out_json: str) -> None:
    import vllm
    from safetensors import safe_open
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

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
    modules = []
    for f in sorted(Path(export_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            modules += [
                k[: -len(".weight")]
                for k in st.keys()
                if k.endswith(".weight") and len(st.get_slice(k).get_shape()) == 2
            ]
    layers = {}
    for prefix in vllm_prefixes([m for m in modules if "embed_tokens" not in m]):
        excluded = bool(cfg.is_layer_excluded(prefix))
        layers[prefix] = {"excluded": excluded, "algo": None if excluded else cfg._resolve_quant_algo(prefix)}
    Path(out_json).write_text(json.dumps({"vllm": vllm.__version__, "claimed": claimed, "method": cfg.get_name(),
                                          "layers": layers}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
