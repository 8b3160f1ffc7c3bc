"""Layer-wise quantization policies: which module gets which format.

A :class:`LayerPolicy` is an ordered list of :class:`PolicyRule` (first match wins) plus a default
for linear layers no rule names. Rules use module-name globs; presets cover megatron-core names
(``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, ``embedding``, ``output_layer``)
and Hugging Face Llama/Qwen/Mistral names (``q_proj`` ... ``down_proj``, ``lm_head``,
``embed_tokens``) at once, and mixture-of-experts layers in both (groups ``router``, always 16-bit,
``experts`` and ``shared_experts``: :mod:`.moe`). Resolving a policy against a model gives a :class:`PolicyTable` that
users print and that drives the modelopt config.
"""

from __future__ import annotations

import fnmatch
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.nn as nn

from nemo_fp4qat.architectures import SIXTEEN_BIT_GROUPS, module_patterns
from nemo_fp4qat.numerics.formats import FULL_PRECISION, QuantFormat, get_format
from nemo_fp4qat.qat.experts.fused import fused_expert_containers
from nemo_fp4qat.qat.experts.moe import (
    EXPERT_PATTERNS,
    ROUTER_PATTERNS,
    SHARED_EXPERT_PATTERNS,
    check_moe_formats,
    is_router,
    refuse_fused_experts,
    refuse_grouped_experts,
)
from nemo_fp4qat.specs import ConfigError, did_you_mean, from_fields

# KV-cache formats a policy may request (TensorRT-LLM deploys FP8 KV caches from calibrated scales).
KV_CACHE_FORMATS = frozenset({"fp8"})

__all__ = [
    "ENGINE_RUNTIMES",
    "LINEAR_ATTENTION",
    "POLICY_PRESETS",
    "RUNTIMES",
    "SSM_MIXER",
    "TRTLLM_PRESETS",
    "LayerPolicy",
    "PolicyRow",
    "PolicyRule",
    "PolicyTable",
    "element_bits",
    "is_quantizable_linear",
    "is_quantizer",
    "layers_feeding_attention",
    "refuse_quantized_conv1d",
]

# Linear layer classes modelopt quantizes, by class name so megatron-core/TE need not be imported.
_LINEAR_CLASS_NAMES = {
    "Linear",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TELinear",
    "TEColumnParallelLinear",
    "TERowParallelLinear",
    "TELayerNormColumnParallelLinear",
}


def is_quantizable_linear(module: nn.Module) -> bool:
    """A linear layer modelopt can quantize (plain, already quantized, or megatron-core parallel)."""
    if isinstance(module, nn.Linear):
        return True
    names = {c.__name__ for c in type(module).__mro__}
    return bool(names & _LINEAR_CLASS_NAMES) and hasattr(module, "weight")


def _canonical(fmt: str | QuantFormat | None) -> str:
    return FULL_PRECISION.name if fmt is None else get_format(fmt).name


@dataclass
class PolicyRule:
    """Modules whose name matches any of ``patterns`` get ``weight``/``input`` formats.

    Attributes:
        patterns: ``fnmatch`` globs on module names (``"*linear_fc1"``, ``"*.q_proj"``).
        weight: format for the weight quantizer; ``None``/``"bf16"`` keeps full precision.
        input: format for the input (activation) quantizer; defaults to ``weight``'s format.
        group: layer-group name used by schedules (offsets) and logs.
        optional: if False, resolving against a model where no pattern matches is an error.
        feeds_attention: match only the sequence mixer (Mamba, linear attention) of the layer nearest before each
            attention layer of a hybrid model (its output is that attention's input), found from the model's own
            layers, not from fixed indices: what NVIDIA's Nemotron 3 Nano NVFP4 recipe keeps in 16 bits.
    """

    patterns: list[str]
    weight: str | None = "nvfp4"
    input: str | None = "same"
    group: str = "other"
    optional: bool = False
    feeds_attention: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.patterns, str):
            self.patterns = [self.patterns]
        self.patterns = list(self.patterns)
        if not self.patterns or not all(isinstance(p, str) and p for p in self.patterns):
            raise ValueError(f"PolicyRule needs at least one non-empty glob pattern, got {self.patterns!r}")
        self.weight = _canonical(self.weight)
        self.input = self.weight if self.input == "same" else _canonical(self.input)
        if not self.group or not isinstance(self.group, str):
            raise ValueError("PolicyRule.group must be a non-empty string (e.g. 'mlp', 'attention')")

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)


# Rule building blocks shared by the presets (both naming sets in each rule).
# MoE routers: always 16-bit (a policy that quantizes one is refused: moe.check_moe_formats).
_ROUTER = dict(patterns=list(ROUTER_PATTERNS), weight=None, group="router", optional=True)
_EMBED_OUT_NORM = dict(patterns=list(module_patterns("embedding_output_norm")), weight=None,
                       group="embedding_output_norm")  # fmt: skip
_ATTENTION = list(module_patterns("attention"))
_MLP = list(module_patterns("mlp"))


# Hybrid models' sequence mixers, each a group of its own: state-space (Mamba, Mamba-2) projections and linear
# attention (gated DeltaNet); their small gates, the depthwise convolution (a rule that quantizes it is refused:
# refuse_quantized_conv1d), Nemotron 3's latent MoE projections and multi-token-prediction layers stay 16-bit (as
# modelopt's Mamba-MoE recipes keep them). The names of each family's modules: architectures.py.
SSM_MIXER = module_patterns("ssm_mixer")
LINEAR_ATTENTION = module_patterns("linear_attention")
_HYBRID_16BIT = [dict(patterns=list(module_patterns(group)), weight=None, group=group, optional=True)
                 for group in SIXTEEN_BIT_GROUPS]  # fmt: skip


def _mixer_rules(weight: str | None) -> list[dict[str, Any]]:
    """The hybrid models' 16-bit modules, then the state-space and linear-attention mixers in ``weight`` (each
    optional: a plain transformer has none)."""
    return [*_HYBRID_16BIT, dict(patterns=list(SSM_MIXER), weight=weight, group="ssm_mixer", optional=True),
            dict(patterns=list(LINEAR_ATTENTION), weight=weight, group="linear_attention", optional=True)]  # fmt: skip


def _mlp_rules(weight: str = "nvfp4", mlp_input: str = "same") -> list[dict[str, Any]]:
    """Shared experts, routed experts and dense MLPs, each a group of its own (in that order: the expert globs are
    narrower than the MLP's projection names, which expert linears also carry), all in one format. Each is optional:
    a dense model has no experts, a MoE model may have no dense MLP."""
    groups = ((list(SHARED_EXPERT_PATTERNS), "shared_experts"), (list(EXPERT_PATTERNS), "experts"), (_MLP, "mlp"))
    rules = []
    for patterns, group in groups:
        rule: dict[str, Any] = dict(patterns=patterns, weight=weight, group=group, optional=True)
        if mlp_input != "same":
            rule["input"] = mlp_input
        rules.append(rule)
    return rules


def _attention_mlp(
    attention: str, mlp_input: str = "same", default: str = "nvfp4", runtime: str = "trtllm"
) -> dict[str, Any]:
    """Routers, embeddings / output / norms in full precision, attention in ``attention``, MLP and experts NVFP4
    weights with ``mlp_input`` activations, other linears ``default``: the shape the attention-vs-MLP presets
    share."""
    # attention is optional: a pure state-space model (Mamba, Mamba-2) has none
    rules = [_ROUTER, _EMBED_OUT_NORM, *_mixer_rules(attention), dict(patterns=_ATTENTION, weight=attention,
             group="attention", optional=True), *_mlp_rules("nvfp4", mlp_input)]  # fmt: skip
    return {"rules": rules, "default": default, "runtime": runtime}


def _hybrid_moe(
    attention: str | None, mixer: str | None, shared_experts: str, feeding_attention: str | None = "same"
) -> list[dict[str, Any]]:
    """A hybrid Mamba / attention MoE's rules (NVIDIA's Nemotron 3 recipes, modelopt's Mamba-MoE configs): routers,
    embeddings / output / norms, conv1d and the latent and MTP layers in 16 bits; the mixers nearest before each
    attention layer in ``feeding_attention`` (``"same"``: as the other mixers), the other mixers in ``mixer``;
    attention in ``attention``; shared experts ``shared_experts``, routed experts and dense MLPs NVFP4."""
    rules = [_ROUTER, _EMBED_OUT_NORM, *_HYBRID_16BIT]
    if feeding_attention != "same":
        rules.append(dict(patterns=[*SSM_MIXER, *LINEAR_ATTENTION], weight=feeding_attention,
                          group="mixer_feeding_attention", optional=True, feeds_attention=True))  # fmt: skip
    rules += [dict(patterns=list(SSM_MIXER), weight=mixer, group="ssm_mixer", optional=True),
              dict(patterns=list(LINEAR_ATTENTION), weight=mixer, group="linear_attention", optional=True),
              dict(patterns=_ATTENTION, weight=attention, group="attention", optional=True),
              dict(patterns=list(SHARED_EXPERT_PATTERNS), weight=shared_experts, group="shared_experts", optional=True),
              *_mlp_rules()[1:]]  # fmt: skip
    return rules


# FP8 attention + NVFP4 MLP: what TensorRT-LLM deploys as MIXED_PRECISION (per-layer FP8 / NVFP4).
_FP8_ATTENTION_NVFP4_MLP = _attention_mlp("fp8")

# Where an export deploys. "trtllm": TensorRT-LLM (engine build or LLM API) has a kernel for every layer; "vllm",
# "sglang": the engine's modelopt loader has one for every layer of the unified HF checkpoint; "pytorch": this
# plugin's own server, which unpacks whatever modelopt exports. Every engine runs 16-bit activations.
RUNTIMES = ("trtllm", "vllm", "sglang", "pytorch")
ENGINE_RUNTIMES = RUNTIMES[:3]

# ``runtime``: where the preset's export deploys. "trtllm": TensorRT-LLM has a kernel for every layer
# (tested on the embedded SmolLM2: HF and TRT-LLM checkpoints, TP 1 and 2, validated); "vllm": vLLM's
# loader has one for every layer of the unified HF checkpoint (SGLang's too, for these presets).
POLICY_PRESETS: dict[str, dict[str, Any]] = {
    # The deployable default: conservative attention (FP8: 8-bit elements and activations, the
    # highest precision TensorRT-LLM serves beside NVFP4 in one MIXED_PRECISION checkpoint), MLP in
    # NVFP4, embeddings / output layer / norms / routers in full precision.
    "default": _FP8_ATTENTION_NVFP4_MLP,
    # The same formats under the name earlier releases used for them (warns: see _OLD_NAMES).
    "trtllm_mixed": _FP8_ATTENTION_NVFP4_MLP,
    # Keep embeddings, the output layer, norms and MoE routers in full precision; NVFP4 elsewhere (MoE experts and
    # shared experts in groups of their own, every other linear in the default's group).
    # Hybrid models' mixers in NVFP4 in groups of their own; conv1d 16-bit.
    "fp_embeddings": {
        "rules": [_ROUTER, _EMBED_OUT_NORM, *_mixer_rules("nvfp4"), *_mlp_rules()[:2]],
        "default": "nvfp4",
        "runtime": "trtllm",
    },
    # MLP (experts included) in NVFP4 only; other linear layers (hybrid models' mixers too) stay in full precision.
    "aggressive_mlp": {
        "rules": [_ROUTER, _EMBED_OUT_NORM, *_mixer_rules(None), *_mlp_rules()],
        "default": None,
        "runtime": "trtllm",
    },
    # Attention projections at 8 bits with per-32 block scales (MXFP8: finer scaling than FP8's one
    # scale per tensor); everything else NVFP4. TensorRT-LLM has no dense MXFP8 kernel; vLLM and SGLang
    # load both formats from a unified HF checkpoint (and this plugin's server runs it).
    "conservative_attention": _attention_mlp("mxfp8", runtime="vllm"),
    # FP4 weights, 8-bit activations: NVFP4 MLP weights with FP8 inputs (TensorRT-LLM W4A8_NVFP4_FP8),
    # FP8 attention. Same weight memory as "default"; on the demo model the MLP's NVFP4 *activations*
    # are about half of the FP4 perplexity loss (benchmarks/RESULTS.md), which this keeps out.
    "nvfp4_w4a8": _attention_mlp("fp8", mlp_input="fp8", default="fp8"),
    # Hybrid Mamba / attention MoE models (the presets below name every group of theirs; the presets above file a
    # hybrid's mixers with their attention's format). NVIDIA's Nemotron 3 Nano NVFP4 checkpoint: attention and the
    # Mamba layer feeding each attention layer in 16 bits, the other Mamba layers, the routed and shared experts in
    # NVFP4; routers, conv1d, lm_head 16-bit; FP8 KV cache. Served by vLLM (NVFP4 GEMMs: Blackwell).
    "nemotron3_nano": {
        "rules": _hybrid_moe(attention=None, mixer="nvfp4", shared_experts="nvfp4", feeding_attention=None),
        "default": None,
        "kv_cache": "fp8",
        "runtime": "vllm",
    },
    # Nemotron 3 Super's recipe: routed experts NVFP4; shared experts and Mamba in/out projections FP8; attention,
    # conv1d, the latent MoE projections and the MTP layers 16-bit.
    "nemotron3_super": {
        "rules": _hybrid_moe(attention=None, mixer="fp8", shared_experts="fp8"),
        "default": None,
        "runtime": "vllm",
    },
    # modelopt's MAMBA_MOE_NVFP4_AGGRESSIVE_CFG: NVFP4 W4A4 everywhere but attention, routers, conv1d, lm_head and
    # the latent / MTP layers; _CONSERVATIVE_CFG also keeps every Mamba in/out projection 16-bit.
    "mamba_moe_aggressive": {
        "rules": _hybrid_moe(attention=None, mixer="nvfp4", shared_experts="nvfp4"),
        "default": "nvfp4",
        "runtime": "vllm",
    },
    "mamba_moe_conservative": {
        "rules": _hybrid_moe(attention=None, mixer=None, shared_experts="nvfp4"),
        "default": "nvfp4",
        "runtime": "vllm",
    },
    # gpt-oss as OpenAI ships it and NVIDIA's QAT recipe trains it (modelopt's MXFP4_MLP_WEIGHT_ONLY_CFG): the routed
    # experts' weights in MXFP4 (16-bit activations), everything else 16-bit; exported in gpt-oss's own MXFP4 layout
    # (export/gpt_oss_mxfp4.py), which vLLM, SGLang and TensorRT-LLM serve.
    "gpt_oss_mxfp4": {
        "rules": [
            *(_ROUTER, _EMBED_OUT_NORM, *_mixer_rules(None)),
            dict(patterns=list(SHARED_EXPERT_PATTERNS), weight=None, group="shared_experts", optional=True),
            dict(patterns=list(EXPERT_PATTERNS), weight="mxfp4", input=None, group="experts", optional=True),
        ],
        "default": None,
        "runtime": "vllm",
    },
}
# preset names kept for existing configs -> the name to use
_OLD_NAMES = {"trtllm_mixed": "default"}
TRTLLM_PRESETS = tuple(n for n, p in POLICY_PRESETS.items() if p["runtime"] == "trtllm")


@dataclass(frozen=True)
class PolicyRow:
    module: str
    group: str
    rule: str  # "rule 2 (*linear_fc1, ...)" or "default"
    weight: str
    input: str
    quantizable: bool

    @property
    def quantized(self) -> bool:
        return self.quantizable and (self.weight != FULL_PRECISION.name or self.input != FULL_PRECISION.name)


@dataclass
class PolicyTable:
    """The result of resolving a policy against a model: one row per matched or linear module."""

    rows: list[PolicyRow]

    def assignment(self) -> dict[str, tuple[QuantFormat, QuantFormat]]:
        """Quantizable module name -> (weight format, input format), for the modelopt config."""
        return {r.module: (get_format(r.weight), get_format(r.input)) for r in self.rows if r.quantizable}

    def groups(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for r in self.rows:
            if r.quantizable:
                out.setdefault(r.group, []).append(r.module)
        return out

    def format_table(self) -> str:
        """A plain-text table (module, group, weight, input, rule) for logs and terminals."""
        head = ("module", "group", "weight", "input", "rule")
        data = [(r.module, r.group, r.weight, r.input, r.rule) for r in self.rows]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *data)]
        line = lambda row: "  ".join(str(v).ljust(w) for v, w in zip(row, widths))  # noqa: E731
        return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in data])

    def __str__(self) -> str:
        return self.format_table()


@dataclass
class LayerPolicy:
    """Ordered rules (first match wins) mapping module-name globs to formats.

    Args:
        rules: :class:`PolicyRule` objects or dicts with the same fields.
        default: format for quantizable linear layers no rule matches (``None``: full precision).
        name: a label for logs and reports.
        kv_cache: ``"fp8"`` quantizes the attention K/V (calibrated scales, exported as the
            checkpoint's ``kv_cache_quant_algo``); ``None`` keeps the KV cache in full precision.
        runtime: where exports of this policy deploy, the export's default runtime (:data:`RUNTIMES`):
            ``"trtllm"`` (TensorRT-LLM has a kernel for every layer), ``"vllm"`` / ``"sglang"`` (the
            engine's loader has one for every layer of the unified HF checkpoint) or ``"pytorch"`` (this
            plugin's server only).
    """

    rules: list[PolicyRule] = field(default_factory=list)
    default: str | None = "nvfp4"
    name: str = "custom"
    kv_cache: str | None = None
    runtime: str = "trtllm"

    def __post_init__(self) -> None:
        rules = []
        for i, r in enumerate(self.rules):
            if isinstance(r, PolicyRule):
                rules.append(r)
            elif isinstance(r, dict) or hasattr(r, "items"):
                try:
                    rules.append(from_fields(PolicyRule, r, "policy rule"))
                except ConfigError as e:
                    raise ConfigError(f"Policy rule {i} is invalid: {e}") from e
            else:
                raise TypeError(f"Policy rule {i} must be a PolicyRule or a dict, got {type(r).__name__}")
        self.rules = rules
        self.default = _canonical(self.default)
        if self.kv_cache is not None and str(self.kv_cache).lower() not in KV_CACHE_FORMATS:
            raise ValueError(
                f"kv_cache={self.kv_cache!r} is not supported; use one of {sorted(KV_CACHE_FORMATS)} or null "
                "(TensorRT-LLM deploys an FP8 KV cache from calibrated k/v scales)."
            )
        self.kv_cache = None if self.kv_cache is None else str(self.kv_cache).lower()
        if self.runtime not in RUNTIMES:
            raise ValueError(
                f"runtime={self.runtime!r} is not known; use 'trtllm' (TensorRT-LLM deploys every layer), 'vllm' or "
                "'sglang' (the engine's loader has a kernel for every layer of the unified HF checkpoint), or "
                "'pytorch' (this plugin's own server)."
            )

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> LayerPolicy:
        if name in _OLD_NAMES:
            warnings.warn(
                f"policy {name!r} is the {_OLD_NAMES[name]!r} policy under its older name; use {_OLD_NAMES[name]!r}",
                FutureWarning,
                stacklevel=3,
            )
        if name not in POLICY_PRESETS:
            raise ConfigError(
                f"Unknown policy preset {name!r}{did_you_mean(name, POLICY_PRESETS)}; presets: "
                f"{', '.join(POLICY_PRESETS)}"
            )
        spec = POLICY_PRESETS[name]
        rules = [PolicyRule(**r) for r in spec["rules"]]
        return cls(rules=rules, default=spec["default"], name=name, runtime=spec["runtime"],
                   kv_cache=spec.get("kv_cache"))  # fmt: skip

    @classmethod
    def from_yaml(cls, path: str | Path) -> LayerPolicy:
        """Load a policy file: either ``_target_``-style (hydra) or plain ``rules``/``default`` keys."""
        from nemo_fp4qat.qat.config_io import instantiate_yaml

        obj = instantiate_yaml(path, default_target=cls)
        if not isinstance(obj, LayerPolicy):
            raise TypeError(f"{path} does not describe a LayerPolicy (got {type(obj).__name__})")
        return obj

    @classmethod
    def resolve_spec(cls, spec: str | Path | dict | LayerPolicy) -> LayerPolicy:
        """A preset name, a YAML path, a dict of fields or a policy object -> LayerPolicy."""
        if isinstance(spec, LayerPolicy):
            return spec
        if isinstance(spec, dict) or hasattr(spec, "items"):
            return from_fields(cls, spec, "policy")
        spec_s = str(spec)
        if spec_s in POLICY_PRESETS:
            return cls.preset(spec_s)
        if spec_s.endswith((".yaml", ".yml")) or Path(spec_s).is_file():
            return cls.from_yaml(spec_s)
        raise ConfigError(
            f"Policy {spec!r} is neither a preset{did_you_mean(spec_s, POLICY_PRESETS)} ({', '.join(POLICY_PRESETS)}) "
            "nor a YAML file."
        )

    def to_yaml(self, path: str | Path, header: str = "") -> Path:
        """Write the policy as a YAML file :meth:`from_yaml` reads back (``header``: comment lines on top)."""
        import yaml

        body = {"_target_": "nemo_fp4qat.LayerPolicy", **self.to_dict()}
        comment = "".join(f"# {line}\n" for line in header.splitlines())
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(comment + yaml.safe_dump(body, sort_keys=False, width=120))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "default": self.default, "kv_cache": self.kv_cache, "runtime": self.runtime,
                "rules": [asdict(r) for r in self.rules]}  # fmt: skip

    def kv_cache_entries(self) -> list[tuple[str, dict[str, Any]]]:
        """modelopt quantizer entries for the KV cache (the k/v BMM quantizers of attention)."""
        if self.kv_cache is None:
            return []
        cfg = get_format(self.kv_cache).quantizer_cfg("input")
        return [("*k_bmm_quantizer", cfg), ("*v_bmm_quantizer", cfg)]

    # --- queries ------------------------------------------------------------------------------
    @property
    def formats(self) -> list[QuantFormat]:
        names = [self.default] + [f for r in self.rules for f in (r.weight, r.input)]
        return [get_format(n) for n in dict.fromkeys(names)]

    @property
    def target_format(self) -> QuantFormat:
        """The most aggressive format the policy uses (what a schedule must end in)."""
        quant = [f for f in self.formats if not f.is_full_precision]
        if not quant:
            return FULL_PRECISION
        return min(quant, key=lambda f: (element_bits(f), f.bits_per_element))

    def keeps_in_full_precision(self, name: str) -> bool:
        """Whether a rule matching ``name`` (the first) keeps it in 16 bits; a default that names no module does not
        say so for a module it was never meant for."""
        rule = next((r for r in self.rules if r.matches(name)), None)
        return rule is not None and _full_precision_rule(rule)

    def resolve(self, model: nn.Module) -> PolicyTable:
        """Match every module of ``model``; raise if a rule matches nothing or nothing is quantized."""
        rows: list[PolicyRow] = []
        hits = [0] * len(self.rules)
        names: list[str] = []
        feeding = layers_feeding_attention(n for n, _ in model.named_modules())
        fused = {p: c for c in fused_expert_containers(model).values() for p in c.projection_names()}
        for name, module in _policy_entries(model, fused):
            names.append(name)
            quantizable = name in fused or is_quantizable_linear(module)
            for i, rule in enumerate(self.rules):
                feeds = feeding.get(_layer_of(name)) if rule.feeds_attention else None
                if rule.matches(name) and (feeds is not None or not rule.feeds_attention):
                    hits[i] += 1
                    label = f"rule {i} ({', '.join(rule.patterns[:3])}{', ...' if len(rule.patterns) > 3 else ''})"
                    if feeds is not None:
                        label = f"rule {i}: feeds attention layer {feeds}"
                    if quantizable or module is None or not _is_container(module):
                        rows.append(PolicyRow(name, rule.group, label, rule.weight, rule.input, quantizable))
                    break
            else:
                if quantizable and is_router(name):  # the default names linears; a router is never quantized by it
                    rows.append(PolicyRow(name, "router", "router (16-bit)", FULL_PRECISION.name,
                                          FULL_PRECISION.name, True))  # fmt: skip
                elif quantizable:
                    rows.append(PolicyRow(name, "other", "default", self.default, self.default, True))
        for i, rule in enumerate(self.rules):
            if hits[i] == 0 and not rule.optional:
                sample = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
                raise ValueError(
                    f"Policy {self.name!r}: rule {i} (group {rule.group!r}, patterns {rule.patterns}) "
                    f"matches no module of {type(model).__name__}. Fix the glob (module names look like: "
                    f"{sample}) or mark the rule 'optional: true'."
                )
        check_moe_formats(rows)
        refuse_quantized_conv1d(rows)
        refuse_fused_experts(model, self.keeps_in_full_precision)
        refuse_grouped_experts(model, self.keeps_in_full_precision)
        table = PolicyTable(rows)
        if not any(r.quantized for r in rows):
            raise ValueError(
                f"Policy {self.name!r} leaves no layer of {type(model).__name__} quantized "
                f"(default={self.default!r}, rules={[r.patterns for r in self.rules]}). Set a quantized "
                "'default' or add a rule with a format for the linear layers."
            )
        return table


def _full_precision_rule(rule: PolicyRule) -> bool:
    return _canonical(rule.weight) == FULL_PRECISION.name and _canonical(rule.input) == FULL_PRECISION.name


def element_bits(fmt: QuantFormat) -> int:
    """Bits per element (without scales): the precision a schedule stage compares."""
    if fmt.element is None:
        return 16
    if fmt.element[0] == "int":
        return int(fmt.element[1])
    return 1 + int(fmt.element[0]) + int(fmt.element[1])


def is_quantizer(module: nn.Module) -> bool:
    """A modelopt quantizer module (TensorQuantizer, SequentialQuantizer ...), by class name."""
    return type(module).__name__.endswith("Quantizer")


_LAYER = re.compile(r"^(?P<layer>.*\.layers\.(?P<index>\d+))\.")


def _layer_of(name: str) -> str | None:
    m = _LAYER.match(name)
    return m.group("layer") if m else None


def layers_feeding_attention(names: Iterable[str]) -> dict[str, int]:
    """In a hybrid model, each layer holding a sequence mixer (:data:`SSM_MIXER` or :data:`LINEAR_ATTENTION`
    projections) that is the nearest such layer before an attention layer: its prefix (``model.layers.3``) -> that
    attention layer's index. Read from the module names, so any interleaving (Nemotron-H's pattern string, Jamba's
    period, a parallel hybrid's every layer) is found as the model has it."""
    mixers: dict[int, str] = {}
    attention: set[int] = set()
    for name in names:
        m = _LAYER.match(name)
        if m is None:
            continue
        index = int(m.group("index"))
        if any(fnmatch.fnmatchcase(name, p) for p in (*SSM_MIXER, *LINEAR_ATTENTION)):
            mixers[index] = m.group("layer")
        elif any(fnmatch.fnmatchcase(name, p) for p in _ATTENTION):
            attention.add(index)
    out: dict[str, int] = {}
    for a in sorted(attention):
        before = [i for i in mixers if i < a]
        if before:
            out.setdefault(mixers[max(before)], a)
    return out


def refuse_quantized_conv1d(rows: Iterable[PolicyRow]) -> None:
    """A state-space or linear-attention mixer's depthwise ``conv1d`` stays in 16 bits: no engine runs it quantized
    and modelopt's recipes exclude it.

    Raises:
        ConfigError: a rule gives a ``conv1d`` a format, naming the module and the fix.
    """
    for r in rows:
        if r.module.endswith("conv1d") and (r.weight != FULL_PRECISION.name or r.input != FULL_PRECISION.name):
            raise ConfigError(
                f"{r.module}: {r.rule} gives a sequence mixer's conv1d the format {r.weight}/{r.input}; conv1d stays "
                "in 16 bits (no engine runs it quantized, modelopt's Mamba recipes exclude it). Put a rule "
                "{patterns: ['*conv1d'], weight: null, group: conv1d} before the one that matches it."
            )


def _policy_entries(model: nn.Module, fused: dict[str, Any]) -> Iterator[tuple[str, nn.Module | None]]:
    """The names a policy matches: every module of ``model`` but quantizers, each fused expert container followed by
    its fused projections (``<container>.gate_up_proj`` ..., no module of their own: None)."""
    for name, module in model.named_modules():
        if not name or is_quantizer(module):
            continue
        yield name, module
        for proj in (p for p in fused if p.rpartition(".")[0] == name):
            yield proj, None


def _is_container(module: nn.Module) -> bool:
    return any(True for _ in module.children())
