"""The linear layers a serving engine's Llama has for a unified HF export: q/k/v fused into ``qkv_proj``, gate/up
into ``gate_up_proj`` (vLLM and SGLang both), the rest under their checkpoint names. Shared by the engine parser
workers, which run in the engines' own environments."""

from __future__ import annotations

from pathlib import Path

LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def engine_linear_prefixes(export_dir: str | Path) -> list[str]:
    """Every 2-D weight of the export but the embedding, shards folded into their fused module's name."""
    from safetensors import safe_open

    modules = []
    for f in sorted(Path(export_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            modules += [k[: -len(".weight")] for k in st.keys()
                        if k.endswith(".weight") and len(st.get_slice(k).get_shape()) == 2]  # fmt: skip
    shard_to_fused = {s: f for f, shards in LLAMA_PACKED.items() for s in shards}
    out = set()
    for m in modules:
        if "embed_tokens" in m or ".experts." in m:  # routed experts: one fused MoE layer each (engine_moe_prefixes)
            continue
        head, _, leaf = m.rpartition(".")
        out.add(f"{head}.{shard_to_fused[leaf]}" if leaf in shard_to_fused else m)
    return sorted(out)


def engine_moe_prefixes(export_dir: str | Path) -> list[str]:
    """The fused MoE layers an engine builds for a unified HF export: one per ``<layer>.experts`` container."""
    from safetensors import safe_open

    out = set()
    for f in sorted(Path(export_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out |= {k.split(".experts.")[0] + ".experts" for k in st.keys() if ".experts." in k}
    return sorted(out)
