"""The linear layers a serving engine's Llama has for a unified HF export: q/k/v fused into ``qkv_proj``, gate/up
into ``gate_up_proj`` (vLLM and SGLang both), the rest under their checkpoint names. Shared by the engine parser
workers, which run in the engines' own environments."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from pathlib import Path

LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def engine_linear_layers(export_dir: str | Path, packed: dict[str, list[str]] = LLAMA_PACKED) -> dict[str, list[str]]:
    """Every 2-D weight of the export but the embedding and routed experts, by the linear layer an engine builds for
    it: the shards ``packed`` fuses (``{fused leaf: shard leaves}``, the engine model's ``packed_modules_mapping``)
    under their fused name where the checkpoint has every shard of one parent, the rest under their own names:
    engine layer -> the checkpoint modules it holds."""
    from safetensors import safe_open

    modules = []
    for f in sorted(Path(export_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            modules += [k[: -len(".weight")] for k in st.keys()
                        if k.endswith(".weight") and len(st.get_slice(k).get_shape()) == 2]  # fmt: skip
    present = set(modules)
    shard_to_fused = {s: f for f, shards in packed.items() for s in shards}
    out: dict[str, list[str]] = {}
    for m in modules:
        if "embed_tokens" in m or ".experts." in m:  # routed experts: one fused MoE layer each (engine_moe_prefixes)
            continue
        head, _, leaf = m.rpartition(".")
        fused = shard_to_fused.get(leaf)
        if fused is not None and all(f"{head}.{s}" in present for s in packed[fused]):
            out.setdefault(f"{head}.{fused}", []).append(m)
        else:
            out.setdefault(m, []).append(m)
    return dict(sorted(out.items()))


def engine_linear_prefixes(export_dir: str | Path) -> list[str]:
    """The linear layers of an engine's Llama for the export (:func:`engine_linear_layers` with Llama's packing)."""
    return list(engine_linear_layers(export_dir))


def engine_moe_prefixes(export_dir: str | Path) -> list[str]:
    """The fused MoE layers an engine builds for a unified HF export: one per ``<layer>.experts`` container."""
    from safetensors import safe_open

    out = set()
    for f in sorted(Path(export_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out |= {k.split(".experts.")[0] + ".experts" for k in st.keys() if ".experts." in k}
    return sorted(out)


def run_many(main: Callable[[str, str], None], argv: list[str]) -> None:
    """``main(EXPORT_DIR, OUT_JSON, ...)`` for one export, or with ``--many PAIRS_JSON`` (a JSON list of
    ``[export_dir, out_json]``) for each of many in one process (one engine import): an export the engine fails on
    gets ``{"error": ...}`` in its file and the others still run."""
    if argv[0] != "--many":
        main(*argv)
        return
    for export_dir, out_json in json.loads(Path(argv[1]).read_text()):
        try:
            main(export_dir, out_json)
        except Exception:
            Path(out_json).write_text(json.dumps({"error": traceback.format_exc()[-3000:]}))
