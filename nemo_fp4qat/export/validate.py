"""``nemo-fp4qat validate``: check an exported checkpoint the way a runtime would, and against the model.

Checks, for unified HF and TensorRT-LLM (qnemo) checkpoints alike:

1. completeness (the export manifest, every listed file present with its size);
2. ``quant_algo`` / ``kv_cache_quant_algo`` values the runtime accepts;
3. per linear layer, the tensors, dtypes and shapes its algorithm needs (a missing scale, a wrong
   dtype or a scale grid that does not tile the weight is named with the tensor);
4. fused siblings (q/k/v, gate/up) share ``input_scale`` and ``weight_scale_2`` (TensorRT-LLM's
   loader asserts this); tensor-parallel ranks agree on shared scales;
5. excluded modules really are unquantized;
6. with the trained model: every exported weight, dequantized by this plugin's own unpacker,
   equals the model's fake-quantized weight (FP4: the E2M1 codes equal exactly, ties included;
   otherwise within the rounding of the scale product).
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .atomic import read_manifest
from .runtime_support import RUNTIMES, TRTLLM_KV_CACHE_QUANT_ALGOS, TRTLLM_QUANT_ALGOS
from .unpack import E2M1_VALUES, TRTLLM_TO_HF_NAMES, dequantize_linear, e8m0_to_float, unpack_e2m1_codes

__all__ = ["Problem", "ValidationReport", "load_export", "validate_export"]

F8 = torch.float8_e4m3fn
_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
_SCALE_NAMES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")
_EMBEDDING = re.compile(r"(embed|vocab_embedding|lm_head|output_layer)")
_FUSED = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("fc", "gate")]
_SMOOTHED = ("W4A16_AWQ", "W4A8_AWQ", "W8A8_SQ_PER_CHANNEL")
_NVFP4_WEIGHTS = ("NVFP4", "W4A8_NVFP4_FP8")  # same weight tensors; W4A8 has an FP8 input_scale
_FP4 = (*_NVFP4_WEIGHTS, "MXFP4", "W4A16_MXFP4")  # upper case; modelopt writes dense MXFP4 as "mxfp4"


@dataclass
class Problem:
    tensor: str
    message: str

    def __str__(self) -> str:
        return f"{self.tensor}: {self.message}"


@dataclass
class ValidationReport:
    path: str
    kind: str
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    runtime: str
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    layers: dict[str, str | None] = field(default_factory=dict)  # module -> algo (None: unquantized)
    numeric: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def error(self, tensor: str, message: str) -> None:
        self.errors.append(Problem(tensor, message))

    def format(self) -> str:
        head = (
            f"{self.path}: {self.kind} checkpoint, quant_algo={self.quant_algo}, kv_cache={self.kv_cache_quant_algo}, "
            f"{sum(a is not None for a in self.layers.values())} quantized / {len(self.layers)} linear layers"
        )
        lines = [head]
        lines += [f"  ERROR {p}" for p in self.errors]
        lines += [f"  warning {p}" for p in self.warnings]
        if self.numeric:
            lines.append(f"  numeric check: {json.dumps(self.numeric)}")
        lines.append("  OK" if self.ok else f"  FAILED ({len(self.errors)} errors)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


# --- loading ------------------------------------------------------------------------------------
def _kind(path: Path) -> str:
    if (path / "hf_quant_config.json").is_file():
        return "hf"
    if (path / "config.json").is_file() and (path / "rank0.safetensors").is_file():
        return "trtllm"
    raise FileNotFoundError(
        f"{path} is neither a unified HF checkpoint (hf_quant_config.json) nor a TensorRT-LLM checkpoint "
        "(config.json + rank0.safetensors)."
    )


def load_export(path: str | Path) -> tuple[str, dict[str, Any], list[dict[str, torch.Tensor]]]:
    """(kind, quantization config, tensors per rank); TRT-LLM names are mapped to unified HF names."""
    from safetensors.torch import load_file

    path = Path(path)
    kind = _kind(path)
    if kind == "hf":
        qcfg = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        return kind, qcfg, [tensors]
    config = json.loads((path / "config.json").read_text())
    qcfg = dict(config.get("quantization") or {})
    if (path / "quant_cfg.json").is_file():
        qcfg.update(json.loads((path / "quant_cfg.json").read_text()))
    qcfg["_config"] = config
    tp = int(config.get("mapping", {}).get("tp_size", 1)) * int(config.get("mapping", {}).get("pp_size", 1))
    ranks = []
    for r in range(tp):
        f = path / f"rank{r}.safetensors"
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: config.json declares {tp} ranks.")
        raw = load_file(str(f))
        ranks.append({_hf_name(k): v for k, v in raw.items()})
    return kind, qcfg, ranks


def _hf_name(key: str) -> str:
    mod, _, attr = key.rpartition(".")
    return f"{mod}.{TRTLLM_TO_HF_NAMES.get(attr, attr)}"


def _modules(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        mod, _, attr = k.rpartition(".")
        out.setdefault(mod, {})[attr] = v
    return out


# --- per-algorithm tensor layout ----------------------------------------------------------------
def _scalar(t: torch.Tensor) -> bool:
    return t.numel() == 1


def _layout(algo: str, t: dict[str, torch.Tensor], group_size: int | None) -> list[tuple[str, Any, Any]]:
    """[(tensor, allowed dtypes, expected shape or predicate)] for one layer; shapes from the weight."""
    w = t["weight"]
    algo = algo.upper()
    if algo in _NVFP4_WEIGHTS:
        o, i = w.shape[0], w.shape[1] * 2
        return [("weight", (torch.uint8,), (o, i // 2)), ("weight_scale", (F8,), (o, i // 16)),
                ("weight_scale_2", (torch.float32,), _scalar), ("input_scale", (torch.float32,), _scalar)]  # fmt: skip
    if algo in ("MXFP4", "W4A16_MXFP4"):
        o, i = w.shape[0], w.shape[1] * 2
        return [("weight", (torch.uint8,), (o, i // 2)), ("weight_scale", (torch.uint8,), (o, i // 32))]
    if algo == "MXFP8":
        o, i = w.shape
        return [("weight", (F8,), (o, i)), ("weight_scale", (torch.uint8,), (o, i // 32))]
    if algo == "FP8":
        o, i = w.shape
        return [("weight", (F8,), (o, i)), ("weight_scale", (torch.float32,), lambda s: s.numel() in (1, o)),
                ("input_scale", (torch.float32,), _scalar)]  # fmt: skip
    if algo in ("W8A16", "W8A8_SQ_PER_CHANNEL"):
        o, i = w.shape
        spec = [("weight", (torch.int8,), (o, i)), ("weight_scale", _FLOAT, lambda s: s.numel() == o)]
        if algo == "W8A8_SQ_PER_CHANNEL":
            spec += [("input_scale", (torch.float32,), _scalar), ("pre_quant_scale?", _FLOAT, lambda s: s.numel() == i)]
        return spec
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        o, i = w.shape[0] * 2, w.shape[1]
        g = group_size or 128
        return [("weight", (torch.uint8, torch.int8), (o // 2, i)),
                ("weight_scale", _FLOAT, lambda s: tuple(s.shape) in ((o, i // g), (i // g, o))),
                ("pre_quant_scale?", _FLOAT, lambda s: s.numel() == i)]  # fmt: skip
    return []


def _check_layout(rep: ValidationReport, mod: str, algo: str, t: dict[str, torch.Tensor], group: int | None) -> bool:
    ok = True
    for name, dtypes, shape in _layout(algo, t, group):
        # "?": optional. modelopt folds a smoothing pre_quant_scale into the preceding norm when
        # siblings (q/k/v, gate/up) share their input, so only some layers keep one.
        optional, name = name.endswith("?"), name.rstrip("?")
        full = f"{mod}.{name}"
        if name not in t and optional:
            continue
        if name not in t:
            rep.error(full, f"missing: a {algo} layer needs {name} (scale tensors are part of the checkpoint format).")
            ok = False
            continue
        v = t[name]
        if v.dtype not in dtypes:
            rep.error(full, f"dtype {v.dtype} but {algo} requires {' or '.join(str(d) for d in dtypes)}.")
            ok = False
        good = shape(v) if callable(shape) else tuple(v.shape) == tuple(shape)
        if not good:
            want = "a per-tensor scalar" if shape is _scalar else shape
            rep.error(full, f"shape {tuple(v.shape)} does not fit {algo} with weight {tuple(t['weight'].shape)} "
                      f"(expected {want}).")  # fmt: skip
            ok = False
        if v.dtype in _FLOAT and not torch.isfinite(v.float()).all():
            rep.error(full, "contains NaN/Inf.")
            ok = False
    return ok


# --- TRT-LLM rank merging and megatron naming ---------------------------------------------------
def _heads(config: dict[str, Any]) -> tuple[int, int, int]:
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    return heads, kv, int(config.get("head_size") or config["hidden_size"] // heads)


def _merge_ranks(ranks: list[dict[str, torch.Tensor]], config: dict[str, Any], rep: ValidationReport):
    if len(ranks) == 1:
        return ranks[0]
    heads, kv = (
        int(config["num_attention_heads"]),
        int(config.get("num_key_value_heads") or config["num_attention_heads"]),
    )
    hd = int(config.get("head_size") or config["hidden_size"] // heads)
    tp = len(ranks)
    merged: dict[str, torch.Tensor] = {}
    for key in ranks[0]:
        parts = [r[key] for r in ranks]
        mod, _, attr = key.rpartition(".")
        if parts[0].dim() == 0 or parts[0].numel() == 1 or attr in ("input_scale", "weight_scale_2"):
            if any(not torch.equal(p.float(), parts[0].float()) for p in parts[1:]):
                rep.error(key, "tensor-parallel ranks disagree on this shared scale.")
            merged[key] = parts[0]
        elif mod.endswith(("attention.dense", "mlp.proj")) and attr != "bias":
            merged[key] = torch.cat(parts, dim=-1)  # row parallel: split along in_features
        elif mod.endswith("attention.qkv"):
            rows = [heads * hd // tp, kv * hd // tp, kv * hd // tp]
            scale_rows = parts[0].shape[0] // sum(rows) if parts[0].shape[0] % sum(rows) == 0 else 1
            qkv = [p.split([r * scale_rows for r in rows], dim=0) for p in parts]
            merged[key] = torch.cat([torch.cat([q[j] for q in qkv], 0) for j in range(3)], 0)
        elif (
            (parts[0].dim() >= 1 and mod.endswith(("mlp.fc", "mlp.gate")))
            or "vocab_embedding" in mod
            or "lm_head" in mod
        ):
            merged[key] = torch.cat(parts, dim=0)
        else:
            merged[key] = parts[0]  # replicated (norms)
    return merged


_MCORE = [
    (r"transformer\.layers\.(\d+)\.attention\.qkv", r"decoder.layers.\1.self_attention.linear_qkv"),
    (r"transformer\.layers\.(\d+)\.attention\.dense", r"decoder.layers.\1.self_attention.linear_proj"),
    (r"transformer\.layers\.(\d+)\.mlp\.fc", r"decoder.layers.\1.mlp.linear_fc1"),
    (r"transformer\.layers\.(\d+)\.mlp\.gate", r"decoder.layers.\1.mlp.linear_fc1"),
    (r"transformer\.layers\.(\d+)\.mlp\.proj", r"decoder.layers.\1.mlp.linear_fc2"),
]
# TRT-LLM names -> Hugging Face Llama-family modules (concatenated along rows when several)
_HF = [
    (r"transformer\.layers\.(\d+)\.attention\.qkv", ["q_proj", "k_proj", "v_proj"], "self_attn"),
    (r"transformer\.layers\.(\d+)\.attention\.dense", ["o_proj"], "self_attn"),
    (r"transformer\.layers\.(\d+)\.mlp\.fc", ["gate_proj"], "mlp"),  # the activated branch
    (r"transformer\.layers\.(\d+)\.mlp\.gate", ["up_proj"], "mlp"),
    (r"transformer\.layers\.(\d+)\.mlp\.proj", ["down_proj"], "mlp"),
]


def _qkv_rows(config: dict[str, Any]) -> torch.Tensor:
    """Row order that turns megatron's per-group interleaved [q.., k, v] into TRT-LLM's [Q; K; V]."""
    heads, kv = (
        int(config["num_attention_heads"]),
        int(config.get("num_key_value_heads") or config["num_attention_heads"]),
    )
    hd = int(config.get("head_size") or config["hidden_size"] // heads)
    per = heads // kv
    group = (per + 2) * hd
    q = [g * group + j for g in range(kv) for j in range(per * hd)]
    k = [g * group + per * hd + j for g in range(kv) for j in range(hd)]
    v = [g * group + (per + 1) * hd + j for g in range(kv) for j in range(hd)]
    return torch.tensor(q + k + v)


def _fake_quant(mod: nn.Module) -> torch.Tensor | None:
    if getattr(mod, "weight_quantizer", None) is None:
        return None
    with torch.no_grad():
        return mod.weight_quantizer(mod.weight.detach()).to(torch.float64)


def _reference(
    modules: dict[str, nn.Module], name: str, kind: str, config: dict[str, Any], names: set[str]
) -> torch.Tensor | None:
    """The model's fake-quantized weight for exported module ``name`` (None: no counterpart)."""
    if name in modules:
        return _fake_quant(modules[name])
    if kind != "trtllm":
        return None
    for pat, leaves, block in _HF:  # Hugging Face model exported to a TRT-LLM checkpoint
        m = re.fullmatch(pat, name)
        found = [modules.get(f"model.layers.{m.group(1)}.{block}.{leaf}") for leaf in leaves] if m else []
        if found and all(f is not None for f in found):
            refs = [_fake_quant(f) for f in found]
            return None if any(r is None for r in refs) else torch.cat(refs, 0)
    for pat, repl in _MCORE:  # megatron-core model
        if re.fullmatch(pat, name):
            target = re.sub(pat, repl, name)
            break
    else:
        return None
    ref = _fake_quant(modules[target]) if target in modules else None
    if ref is None:
        return None
    if target.endswith("linear_qkv"):
        ref = ref[_qkv_rows(config)]
    if target.endswith("linear_fc1") and f"{name.rsplit('.', 1)[0]}.gate" in names:
        half = ref.shape[0] // 2  # gated MLP: linear_fc1 = [activated half; linear half] -> "fc", "gate"
        ref = ref[:half] if name.endswith(".fc") else ref[half:]
    return ref


def _resmoothed(modules: dict[str, nn.Module], name: str, t: dict[str, torch.Tensor]) -> bool:
    """Whether the exporter changed this layer's smoothing scale (so its weights were requantized)."""
    mod = modules.get(name)
    iq = getattr(mod, "input_quantizer", None)
    trained = getattr(iq, "_pre_quant_scale", None) if iq is not None else None
    if trained is None:
        return False
    exported = t.get("pre_quant_scale")
    return exported is None or not torch.allclose(exported.double().flatten(), trained.double().flatten(), rtol=1e-6)


def _compare(rep: ValidationReport, mod: str, algo: str, t: dict[str, torch.Tensor], ref: torch.Tensor) -> None:
    num = rep.numeric
    try:
        got = dequantize_linear(t, algo)
    except Exception as e:  # reported as a problem of this tensor
        rep.error(f"{mod}.weight", f"cannot be unpacked as {algo}: {e}")
        return
    if got.shape != ref.shape:
        rep.error(f"{mod}.weight", f"unpacks to shape {tuple(got.shape)} but the model's weight is {tuple(ref.shape)}.")
        return
    num["layers_compared"] = num.get("layers_compared", 0) + 1
    if algo.upper() in _FP4:
        codes = unpack_e2m1_codes(t["weight"]).long()
        if algo.upper() in _NVFP4_WEIGHTS:
            s = (t["weight_scale"].float() * t["weight_scale_2"].float().reshape(())).double()
        else:
            s = e8m0_to_float(t["weight_scale"])
        s = s.repeat_interleave(codes.shape[-1] // s.shape[-1], dim=-1)
        want = ref / s  # the model's E2M1 values (exact up to the fp32 rounding of q * s)
        # The exported code must name exactly the model's E2M1 value. E2M1 grid points are >= 0.5
        # apart, so a distance below 1e-5 relative means "same grid point", and anything else is a
        # different code or a model value off the grid (both errors). Zero scales carry no codes.
        code_values = E2M1_VALUES[codes]
        bad = int((((want - code_values).abs() > 1e-5 * code_values.abs().clamp_min(0.5)) & (s != 0)).sum())
        num["fp4_codes_compared"] = num.get("fp4_codes_compared", 0) + codes.numel()
        num["fp4_codes_different"] = num.get("fp4_codes_different", 0) + bad
        if bad:
            rep.error(
                f"{mod}.weight", f"{bad} of {codes.numel()} FP4 codes differ from the trained fake-quant weights."
            )
            return
    denom = ref.abs().clamp_min(torch.finfo(torch.float32).tiny)
    rel = ((got - ref).abs() / denom).max().item() if ref.numel() else 0.0
    num["max_rel_error"] = max(num.get("max_rel_error", 0.0), rel)
    if not math.isfinite(rel) or rel > 2e-6:
        rep.error(f"{mod}.weight", f"dequantized weights differ from the trained fake-quant weights (max rel error "
                  f"{rel:.3g}, allowed 2e-6: the rounding of the scale product).")  # fmt: skip


# --- entry point ---------------------------------------------------------------------------------
def validate_export(
    path: str | Path, model: nn.Module | None = None, runtime: str = "trtllm", require_manifest: bool = True
) -> ValidationReport:
    """Validate the checkpoint at ``path`` (see the module docstring); ``model`` adds the numeric check."""
    if runtime not in RUNTIMES:
        raise ValueError(f"Unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}.")
    path = Path(path)
    kind, qcfg, ranks = load_export(path)
    algo = qcfg.get("quant_algo")
    kv = qcfg.get("kv_cache_quant_algo")
    rep = ValidationReport(str(path), kind, algo, kv, runtime)

    manifest = read_manifest(path)
    if manifest is None:
        if require_manifest:
            rep.warnings.append(Problem(str(path), "no nemo_fp4qat manifest: not written by nemo-fp4qat export."))
    else:
        for rel, meta in manifest.get("files", {}).items():
            f = path / rel
            if not f.is_file() or f.stat().st_size != meta["bytes"]:
                rep.error(rel, "missing or truncated (size differs from the export manifest).")

    if algo is None:
        rep.error("quant_algo", "not set: the checkpoint declares no quantization.")
    elif runtime == "trtllm" and algo not in TRTLLM_QUANT_ALGOS:
        fix = (
            " (modelopt writes 'mxfp4' for dense MXFP4; TRT-LLM deploys MXFP4 only as W4A8_MXFP4_FP8/W4A16_MXFP4)"
            if str(algo).lower() == "mxfp4"
            else ""
        )
        rep.error("quant_algo", f"{algo!r} is not a TensorRT-LLM QuantAlgo{fix}; re-export with a format TRT-LLM "
                  "deploys, or validate with runtime='pytorch' for this plugin's own server.")  # fmt: skip
    if kv is not None and kv not in TRTLLM_KV_CACHE_QUANT_ALGOS:
        rep.error("kv_cache_quant_algo", f"{kv!r} is not one of {sorted(TRTLLM_KV_CACHE_QUANT_ALGOS)}.")

    config = qcfg.get("_config", {})
    tensors = _merge_ranks(ranks, config, rep) if kind == "trtllm" else ranks[0]
    mods = _modules(tensors)
    mixed = qcfg.get("quantized_layers") or {}
    excludes = list(qcfg.get("exclude_modules") or [])
    group = qcfg.get("group_size")

    def layer_algo(mod: str, t: dict[str, torch.Tensor]) -> str | None:
        if algo == "MIXED_PRECISION":
            entry = mixed.get(mod)
            return entry.get("quant_algo") if entry else None
        if any(fnmatch.fnmatch(mod, p) or mod == p for p in excludes):
            return None
        if _EMBEDDING.search(mod) and not any(n in t for n in _SCALE_NAMES):
            return None
        return algo

    model_modules = dict(model.named_modules()) if model is not None else {}
    names = set(mods)
    for mod, t in sorted(mods.items()):
        w = t.get("weight")
        if w is None or w.dim() != 2:
            continue
        a = layer_algo(mod, t)
        rep.layers[mod] = a
        if a is None:
            carried = [n for n in _SCALE_NAMES if n in t and n != "pre_quant_scale"]
            if carried or w.dtype not in _FLOAT:
                rep.error(f"{mod}.weight", f"the config excludes this module from quantization but it has dtype "
                          f"{w.dtype} and scales {carried}; excluded modules must be stored unquantized.")  # fmt: skip
            continue
        if runtime == "trtllm" and a not in TRTLLM_QUANT_ALGOS:
            rep.error(mod, f"layer quant_algo {a!r} is not a TensorRT-LLM QuantAlgo.")
        if not _layout(a, t, group):
            rep.error(mod, f"no layout known for quant_algo {a!r}.")
            continue
        layout_ok = _check_layout(rep, mod, a, t, group)
        top = float(t["weight_scale"].float().max()) if layout_ok and a.upper() == "W4A8_NVFP4_FP8" else 0.0
        if top * 6.0 > 448.0:
            # the W4A8 kernel dequantizes code * block scale to FP8 (max 448) before the FP8 GEMM
            rep.error(f"{mod}.weight_scale", f"max {top:g} > 448 / 6: the W4A8 kernel's FP8 dequantization of the "
                      "weights would overflow (weight_scale_2 must be amax / 448).")  # fmt: skip
            layout_ok = False
        if layout_ok and model is not None:
            ref = _reference(model_modules, mod, kind, config, names)
            if ref is None:
                rep.numeric["layers_without_counterpart"] = rep.numeric.get("layers_without_counterpart", 0) + 1
            elif a.upper() in _SMOOTHED and _resmoothed(model_modules, mod, t):
                # modelopt's HF exporter re-smooths siblings that share an input (q/k/v, gate/up; one
                # averaged pre_quant_scale, or folded into the preceding norm) and requantizes their
                # weights: what deploys is not bit-for-bit what was trained. Reported, not hidden.
                rep.numeric["resmoothed_layers"] = rep.numeric.get("resmoothed_layers", 0) + 1
                msg = "numeric check skipped: the exporter re-smoothed (pre_quant_scale changed) and requantized."
                rep.warnings.append(Problem(f"{mod}.weight", msg))
            else:
                _compare(rep, mod, a, t, ref)

    for mod in mixed:
        if mod not in mods:
            rep.error(mod, "listed in quantized_layers but the checkpoint has no tensors for it.")

    # fused siblings: TRT-LLM loads q/k/v and gate/up as one GEMM with one input_scale / weight_scale_2
    for mod in mods:
        parent, _, leaf = mod.rpartition(".")
        for group_names in _FUSED:
            if leaf != group_names[0]:
                continue
            sibs = [f"{parent}.{n}" for n in group_names if f"{parent}.{n}" in mods]
            for attr in ("input_scale", "weight_scale_2"):
                vals = [mods[s][attr] for s in sibs if attr in mods[s]]
                if len(vals) > 1 and any(not torch.equal(v.float(), vals[0].float()) for v in vals[1:]):
                    rep.error(f"{parent}.{{{','.join(group_names)}}}.{attr}",
                              f"fused siblings disagree ({[float(v.float().max()) for v in vals]}); TensorRT-LLM "
                              "loads them as one GEMM with one scale. Train with share_fused_amax=True.")  # fmt: skip

    if kv is not None:
        kv_scales = [k for k in tensors if k.endswith(("k_scale", "v_scale", "kv_cache_scaling_factor"))]
        if not kv_scales:
            rep.error("kv_cache_quant_algo", f"declares {kv} but no KV-cache scale tensors (k_scale/v_scale) exist.")
    if model is not None and not rep.numeric.get("layers_compared"):
        rep.warnings.append(Problem(str(path), "no exported layer matched a model layer: numeric check skipped."))
    return rep
