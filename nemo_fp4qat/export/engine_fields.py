"""The fields of a unified Hugging Face checkpoint that the serving engines' loaders read and modelopt leaves out.

modelopt's exporter writes ``hf_quant_config.json`` (TensorRT-LLM's LLM API reads it; SGLang falls back to it) and
``config.json["quantization_config"]`` (vLLM reads it, and SGLang when it names a ``kv_cache_quant_algo``). For a
mixed-precision checkpoint (the layer-wise policies' usual output) it names the quantized layers only: the layers
a policy keeps in 16 bits are named nowhere (``exclude_modules`` / ``ignore`` empty), so an engine that quantizes
by default would quantize them; ``config.json`` carries no ``kv_cache_quant_algo`` (SGLang then reads the other
file), and ``hf_quant_config.json`` no ``quant_method``. The engines fuse q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj``: vLLM and recent SGLang find a fused layer's format through its shards, SGLang's exact-name lookup
and TensorRT-LLM's ``gate_up_proj`` match read the fused name itself, so each fused layer whose shards share one
format (the export preflight refuses any other) is also listed under its fused name. :func:`declare_for_engines`
completes both files from the written tensors; nothing else is changed.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any

from ..qat.experts.moe import split_expert_name
from ..qat.policy.fused_siblings import ENGINE_FUSED_NAMES

__all__ = [
    "FUSED_SHARDS",
    "declare_for_engines",
    "engine_field_problems",
    "fused_aliases",
    "is_fused_alias",
    "layer_entry",
    "repaired_names",
    "stored_unquantized_linears",
    "unquantized_linears",
]

# the input token embedding: a lookup table, never a linear layer an engine would quantize
_INPUT_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|embed_in|wte|word_embeddings|vocab_embedding)$")


def _weight_shapes(out: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key.endswith(".weight"):
                    shapes[key[: -len(".weight")]] = tuple(st.get_slice(key).get_shape())
    return shapes


# fused module the engines build -> the checkpoint's shards it is made of (Llama, Mistral, Qwen naming)
FUSED_SHARDS = {fused: shards for shards, fused in ENGINE_FUSED_NAMES.items()}


def fused_aliases(quantized: dict[str, Any]) -> dict[str, Any]:
    """``quantized_layers`` entries for the engines' fused modules: ``<prefix>.qkv_proj`` where q/k/v are all listed
    with one format, ``<prefix>.gate_up_proj`` likewise for gate/up."""
    out: dict[str, Any] = {}
    for name, entry in quantized.items():
        prefix, _, leaf = name.rpartition(".")
        for fused, shards in FUSED_SHARDS.items():
            if leaf != shards[0]:
                continue
            entries = [quantized.get(f"{prefix}.{s}") for s in shards]
            if all(e == entry for e in entries):
                out[f"{prefix}.{fused}"] = dict(entry)
    return out


def is_fused_alias(name: str, quantized: dict[str, Any]) -> bool:
    """Whether ``name`` is a fused-module entry of ``quantized`` (its shards listed), not a checkpoint module."""
    prefix, _, leaf = name.rpartition(".")
    shards = FUSED_SHARDS.get(leaf)
    return shards is not None and all(f"{prefix}.{s}" in quantized for s in shards)


# modelopt 0.47 writes the exclude_modules of a model that transformers 5 saves under another prefix (NemotronH:
# ``model.`` in memory, ``backbone.`` on the hub) with its internal name-mapping sentinel left in
# (``lm_head.\x00backbone.pt_name_sentinel``, ``backbone.layers.0.\x00backbone.pt_name_sentinel*``): names no engine
# matches, so the modules they mean would be loaded as quantized
_NAME_SENTINEL = re.compile(r"\x00[^*]*")


def repaired_names(names: list[str]) -> list[str]:
    """Module names and globs with modelopt's name-mapping sentinel removed (``lm_head``, ``backbone.layers.0.*``)."""
    out = []
    for name in names:
        if "\x00" in name:
            name = _NAME_SENTINEL.sub("", name)
            name = name[:-1] if name.endswith(".") else name
        out.append(name)
    return out


def layer_entry(name: str, quantized: dict[str, Any]) -> Any:
    """The ``quantized_layers`` entry that gives module ``name`` its format: its own, or for an expert linear
    (``<prefix>.experts.<i>.gate_proj``) its expert container's: modelopt lists a fused expert container once under
    its own name (the name of the engines' fused MoE layer) and writes its experts as per-expert linears. None: the
    table does not name it."""
    entry = quantized.get(name)
    if entry is None and (parts := split_expert_name(name)) is not None:
        entry = quantized.get(parts[0])
    return entry


def stored_unquantized_linears(out: str | Path) -> list[str]:
    """The modules of the checkpoint in ``out`` whose 2-D weight is stored without a weight scale (16-bit), other
    than the input embedding."""
    from safetensors import safe_open

    keys: set[str] = set()
    for f in sorted(Path(out).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            keys.update(st.keys())
    return sorted(
        mod
        for mod, shape in _weight_shapes(Path(out)).items()
        if len(shape) == 2 and f"{mod}.weight_scale" not in keys and not _INPUT_EMBEDDING.search(mod)
    )


def unquantized_linears(out: str | Path, quantized: dict[str, Any]) -> list[str]:
    """The modules of the checkpoint in ``out`` with a 2-D weight that ``quantized`` (``quantized_layers``) does not
    name, other than the input embedding: the linear layers kept in 16 bits (``lm_head`` among them)."""
    return sorted(
        mod
        for mod, shape in _weight_shapes(Path(out)).items()
        if len(shape) == 2 and layer_entry(mod, quantized) is None and not _INPUT_EMBEDDING.search(mod)
    )


def declare_for_engines(out: str | Path) -> None:
    """Complete a unified HF checkpoint's quantization fields for TensorRT-LLM, vLLM and SGLang (in place).

    ``hf_quant_config.json``: ``quant_method: "modelopt"``, and for a mixed-precision checkpoint
    ``quantization.exclude_modules`` naming the 16-bit linear layers. ``config.json["quantization_config"]``: the
    same names in ``ignore``, ``kv_cache_quant_algo`` (``null`` when the KV cache is not quantized) and, for a
    mixed-precision checkpoint, the ``quantized_layers`` table (vLLM and SGLang read this file first). The
    engines' fused layers are listed under their own names too (see the module docstring).
    """
    out = Path(out)
    hq_path, cfg_path = out / "hf_quant_config.json", out / "config.json"
    if not hq_path.is_file():
        return
    hq = json.loads(hq_path.read_text())
    q = hq.setdefault("quantization", {})
    hq.setdefault("quant_method", "modelopt")
    excluded = repaired_names(q.get("exclude_modules") or [])
    if excluded:
        q["exclude_modules"] = excluded
    aliases: dict[str, Any] = {}
    if q.get("quant_algo") == "MIXED_PRECISION":
        excluded = sorted(set(excluded) | set(unquantized_linears(out, q.get("quantized_layers") or {})))
        q["exclude_modules"] = excluded
        aliases = fused_aliases(q.get("quantized_layers") or {})
        q["quantized_layers"] = {**(q.get("quantized_layers") or {}), **aliases}
    elif q.get("quant_algo"):
        # one format for the checkpoint: a linear stored unquantized that no exclude names (a module transformers
        # saves under another name than the one modelopt excluded) would be loaded in that format
        unnamed = [m for m in stored_unquantized_linears(out) if not any(fnmatch.fnmatchcase(m, g) for g in excluded)]
        if unnamed:
            excluded = sorted(set(excluded) | set(unnamed))
            q["exclude_modules"] = excluded
    hq_path.write_text(json.dumps(hq, indent=4))
    if not cfg_path.is_file():
        return
    config = json.loads(cfg_path.read_text())
    qc = config.get("quantization_config")
    if isinstance(qc, dict):
        qc["ignore"] = sorted(set(repaired_names(qc.get("ignore") or [])) | set(excluded))
        qc.setdefault("kv_cache_quant_algo", q.get("kv_cache_quant_algo"))
        if q.get("quant_algo") == "MIXED_PRECISION":  # modelopt < 0.4x writes the table in hf_quant_config only
            qc.setdefault("quant_algo", "MIXED_PRECISION")
            qc["quantized_layers"] = q["quantized_layers"]
        cfg_path.write_text(json.dumps(config, indent=2))


def engine_field_problems(out: str | Path) -> list[tuple[str, str]]:
    """``(where, what)`` for each field :func:`declare_for_engines` writes that the unified HF checkpoint in ``out``
    lacks or gets wrong (an empty list for a TensorRT-LLM checkpoint)."""
    out = Path(out)
    hq_path, cfg_path = out / "hf_quant_config.json", out / "config.json"
    if not hq_path.is_file():
        return []
    hq = json.loads(hq_path.read_text())
    q = hq.get("quantization", {})
    problems = []
    if hq.get("quant_method") != "modelopt":
        problems.append(("hf_quant_config.json", "no quant_method 'modelopt'"))
    excluded = set(q.get("exclude_modules") or [])
    broken = [n for n in excluded if "\x00" in n]
    if broken:
        problems.append(("hf_quant_config.json", f"exclude_modules holds names no engine matches ({broken[:2]!r}: "
                         "modelopt's name-mapping sentinel)"))  # fmt: skip
    if q.get("quant_algo") == "MIXED_PRECISION":
        missing = [m for m in unquantized_linears(out, q.get("quantized_layers") or {}) if m not in excluded]
        if missing:
            more = " ..." if len(missing) > 4 else ""
            problems.append(("hf_quant_config.json", f"exclude_modules does not name the 16-bit linear layers "
                             f"{missing[:4]}{more} (engines would quantize them)"))  # fmt: skip
    elif q.get("quant_algo"):
        unnamed = [m for m in stored_unquantized_linears(out) if not any(fnmatch.fnmatchcase(m, g) for g in excluded)]
        if unnamed:
            problems.append(("hf_quant_config.json", f"exclude_modules does not name the 16-bit linear layers "
                             f"{unnamed[:4]} (engines would load them as {q['quant_algo']})"))  # fmt: skip
    layers = q.get("quantized_layers") or {}
    if q.get("quant_algo") == "MIXED_PRECISION":
        lacking = [n for n, e in fused_aliases(layers).items() if layers.get(n) != e]
        if lacking:
            problems.append(("hf_quant_config.json", f"quantized_layers does not name the fused layers {lacking[:2]} "
                             "(SGLang looks their format up by that name)"))  # fmt: skip
    qc = json.loads(cfg_path.read_text()).get("quantization_config") if cfg_path.is_file() else None
    if isinstance(qc, dict):
        if q.get("quant_algo") == "MIXED_PRECISION" and qc.get("quantized_layers") != layers:
            problems.append(("config.json", "quantization_config.quantized_layers is not hf_quant_config.json's (vLLM "
                             "and SGLang read config.json first; without it vLLM refuses the checkpoint)"))  # fmt: skip
        if "kv_cache_quant_algo" not in qc or qc["kv_cache_quant_algo"] != q.get("kv_cache_quant_algo"):
            problems.append(("config.json", f"quantization_config.kv_cache_quant_algo is not "
                             f"{q.get('kv_cache_quant_algo')!r} (hf_quant_config.json's)"))  # fmt: skip
        if not excluded <= set(qc.get("ignore") or []):
            lacking = sorted(excluded - set(qc.get("ignore") or []))
            problems.append(("config.json", f"quantization_config.ignore lacks {lacking[:4]}"))
    return problems
