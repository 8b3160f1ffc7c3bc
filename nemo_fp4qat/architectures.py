"""The model families this plugin trains, in one table: what each calls its modules and which policy group each
belongs to, how it holds its experts, which front ends train it, which preset fits it, what it exports to and what
reads the export.

The policies' module patterns (``qat/policy/rules.py``), the mixture-of-experts names (``qat/experts/moe.py``),
the layers that deploy fused with one scale (``qat/policy/fused_siblings.py``, the export validation), the expert
container layouts (``qat/experts/fused.py``) and the README's supported-models table (``nemo-fp4qat models
--markdown``) are read from here: supporting a family is one entry plus its test (``tests/test_architectures.py`` holds
every entry to the tests it names and the README to the table).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "FAMILIES",
    "Family",
    "expert_classes",
    "fused_sibling_sets",
    "module_patterns",
    "refused_classes",
]

HF, NEMO, BRIDGE = "Lightning / HF", "NeMo 2", "Megatron-Bridge"
HF_EXPORT, TRTLLM_EXPORT = "unified HF", "TensorRT-LLM"
# what the groups of a hybrid's always-16-bit modules are called (every preset keeps them in 16 bits)
SIXTEEN_BIT_GROUPS = (
    "conv1d", "linear_attention_gates", "latent_proj", "multi_token_prediction", "sparse_attention_indexer",
    "batched_shared_experts",
)  # fmt: skip


@dataclass(frozen=True)
class Family:
    """One model family.

    Args:
        name: as the README names it.
        classes: the architectures it covers (transformers' ``*ForCausalLM`` prefixes, as tests build them from
            ``<prefix>Config``; megatron-core's model class).
        front_ends: the front ends that train it, tested.
        modules: policy group -> the module-name globs this family's modules of that group match.
        fused_siblings: leaf names of layers that read one input and deploy as one GEMM (one shared scale).
        experts: how it holds its routed experts: ``"linears"`` (one linear per expert), ``"fused"`` (transformers
            5's 3-D ``gate_up_proj`` / ``down_proj``), ``"transposed"`` (``[E, in, out]`` with one weight quantizer
            for every expert); None for a dense model.
        expert_classes: the expert container classes of a ``"transposed"`` or refused layout (a refused family's are
            refused by name at ``prepare`` with ``refused`` as the reason).
        preset: the policy preset that fits it (NVIDIA's recipe where one is published).
        quantizes: the policy groups of its modules that ``preset`` quantizes (the README shows their formats).
        export: the checkpoints its export writes, validated.
        readers: what is tested to read the export (the validator always does; engines' own parsers, transformers).
        tests: the test files that carry it through the chain.
        refused: why the plugin refuses it (by name, before training), or None.
    """

    name: str
    classes: tuple[str, ...]
    front_ends: tuple[str, ...] = (HF,)
    modules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    fused_siblings: tuple[tuple[str, ...], ...] = ()
    experts: str | None = None
    expert_classes: tuple[str, ...] = ()
    preset: str = "default"
    quantizes: tuple[str, ...] = ("attention", "mlp")
    export: tuple[str, ...] = (HF_EXPORT,)
    readers: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    refused: str | None = None


_LLAMA_ATTENTION = ("*q_proj", "*k_proj", "*v_proj", "*o_proj")
_GATED_MLP = ("*gate_proj", "*up_proj", "*down_proj")
_HF_EMBED_OUT_NORM = ("*embed_tokens*", "*lm_head*", "*norm*")
_FUSED_MOE_CLASSES = (
    "Qwen3Moe", "Qwen2Moe", "Mixtral", "Olmoe", "Phimoe", "MiniMax", "MiniMaxM2", "DeepseekV2", "Dots1", "Glm4Moe",
    "Glm4MoeLite", "Ernie4_5_Moe", "ExaoneMoe", "Cohere2Moe", "HunYuanMoEV1", "GraniteMoe", "GraniteMoeShared",
    "SolarOpen", "Mistral4", "Afmoe", "HYV3", "Laguna", "MiMoV2Flash", "Mellum", "FlexOlmo", "Lfm2Moe", "DeepseekV3",
    "DeepseekV32", "GlmMoeDsa", "Zaya", "Gemma4", "MiniMaxM3VL", "Inkling",
)  # fmt: skip
_STATE_SPACE = ("*mamba.in_proj", "*mamba.out_proj", "*mamba.x_proj", "*mamba.dt_proj")
_MIXER = ("*mixer.in_proj", "*mixer.out_proj", "*mixer.x_proj", "*mixer.dt_proj")
_GATED_DELTANET = ("*linear_attn.in_proj_qkvz", "*linear_attn.in_proj_qkv", "*linear_attn.in_proj_z",
                   "*linear_attn.out_proj")  # fmt: skip
_GROUPED = ("GroupedMLP", "TEGroupedMLP", "InferenceGroupedMLP")
_GATED_DELTANET_GATES = ("*linear_attn.in_proj_ba", "*linear_attn.in_proj_a", "*linear_attn.in_proj_b")

FAMILIES: tuple[Family, ...] = (
    Family(
        "Llama (SmolLM2, Llama 3)",
        ("Llama",),
        front_ends=(HF, NEMO, BRIDGE),
        modules={"attention": _LLAMA_ATTENTION, "mlp": _GATED_MLP, "embedding_output_norm": _HF_EMBED_OUT_NORM},
        fused_siblings=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
        export=(HF_EXPORT, TRTLLM_EXPORT),
        readers=("vLLM", "SGLang", "TensorRT-LLM's config loader", "NeMo"),
        tests=(
            "tests/export/test_export_smollm2.py",
            "tests/nemo/test_nemo_import.py",
            "tests/bridge/test_bridge_smollm2.py",
        ),
    ),
    Family(
        "megatron-core GPT (NeMo 2, Megatron-Bridge)",
        ("GPTModel",),
        front_ends=(NEMO, BRIDGE),
        modules={
            "attention": ("*linear_qkv", "*linear_proj"),
            "mlp": ("*linear_fc1", "*linear_fc2"),
            "embedding_output_norm": ("*embedding*", "*output_layer*"),
            "router": ("*mlp.router",),
            "experts": ("*.experts.*",),
            "shared_experts": ("*shared_experts.*",),
        },
        export=(TRTLLM_EXPORT, HF_EXPORT),
        readers=("NeMo",),
        tests=(
            "tests/nemo/test_nemo_trainer.py",
            "tests/nemo/test_nemo_pipeline.py",
            "tests/bridge/test_bridge_qat.py",
        ),
    ),
    Family(
        "Other decoder layouts (Phi-3, Phi, GPT-NeoX, OPT)",
        ("Phi3", "Phi", "GPTNeoX", "OPT"),
        modules={
            "attention": (
                "*qkv_proj",
                "*self_attn.out_proj",
                "*self_attn.dense",
                "*attention.query_key_value",
                "*attention.dense",
            ),
            "mlp": ("*gate_up_proj", "*.fc1", "*.fc2", "*dense_h_to_4h", "*dense_4h_to_h"),
        },
        export=(),
        tests=("tests/test_architectures.py",),
    ),
    Family(
        "MoE, one linear per expert (transformers 4: Qwen3-MoE, Qwen2-MoE, Mixtral)",
        ("Qwen3Moe", "Qwen2Moe", "Mixtral"),
        front_ends=(HF, NEMO, BRIDGE),
        experts="linears",
        modules={
            "router": ("*mlp.gate", "*block_sparse_moe.gate", "*shared_expert_gate"),
            "experts": ("*.experts.*",),
            "shared_experts": ("*shared_expert.*",),
        },
        fused_siblings=(("w1", "w3"),),
        quantizes=("attention", "experts", "shared_experts"),
        tests=("tests/lightning/test_moe_qad.py", "tests/nemo/test_nemo_hf_moe.py", "tests/bridge/test_bridge_moe.py"),
    ),
    Family(
        "MoE, fused experts (transformers 5: 33 families)",
        _FUSED_MOE_CLASSES,
        experts="fused",
        modules={
            # Zaya's router is a small MLP (mlp.gate.*), Gemma 4's a projection beside the layer's experts, LFM2's
            # sits in the layer's feed_forward
            "router": (
                "*mlp.router.gate",
                "*block_sparse_moe.router",
                "*mlp.gate.*",
                "*layers.*.router.proj",
                "*feed_forward.gate",
            ),
            "shared_experts": ("*shared_mlp.*",),
            "attention": ("*v_proj_current", "*v_proj_delayed", "*self_attn.r_proj"),  # Zaya's values, Inkling's
            # DeepSeek-V3.2 / GLM-5 / MiniMax-M3 sparse attention's indexer: it picks the tokens attention reads,
            # runs without gradients, and modelopt's export would tie its input scale to attention's
            "sparse_attention_indexer": ("*self_attn.indexer.*",),
            # Inkling's shared experts: 3-D weights run by torch.bmm, which modelopt has no wrapper for
            "batched_shared_experts": ("*.mlp.shared_experts",),
        },
        # multi-head latent attention's down projections (DeepSeek-V2 / V3, GLM-4 MoE Lite, Mistral 4) deploy fused
        fused_siblings=(("q_a_proj", "kv_a_proj_with_mqa"),),
        quantizes=("attention", "experts", "shared_experts"),
        readers=("vLLM (the 26 it has a model for)", "SGLang (24)"),
        tests=("tests/lightning/test_fused_experts.py", "tests/export/test_engine_parsers.py"),
    ),
    Family(
        "gpt-oss",
        ("GptOss",),
        experts="transposed",
        expert_classes=("GptOssExperts",),
        preset="gpt_oss_mxfp4",
        quantizes=("experts",),
        export=("gpt-oss MXFP4",),
        readers=("transformers",),
        tests=("tests/lightning/test_gpt_oss.py",),
    ),
    Family(
        "Nemotron-H / Nemotron 3 Nano",
        ("NemotronH",),
        front_ends=(HF, BRIDGE),
        experts="fused",
        modules={
            "ssm_mixer": _MIXER,
            "router": ("*mixer.gate",),
            "latent_proj": ("*fc1_latent_proj", "*fc2_latent_proj"),
            "multi_token_prediction": ("mtp.*", "*.mtp.*"),
        },
        preset="nemotron3_nano",
        quantizes=("attention", "mixer_feeding_attention", "ssm_mixer", "experts", "shared_experts"),
        readers=("vLLM",),
        tests=("tests/lightning/test_hybrid_qad.py", "tests/bridge/test_bridge_recipe.py"),
    ),
    Family(
        "Mamba hybrids (Jamba, Bamba, FalconH1, Zamba, Zamba2, GraniteMoeHybrid)",
        ("Jamba", "Bamba", "FalconH1", "Zamba", "Zamba2", "GraniteMoeHybrid"),
        experts="fused",
        modules={"ssm_mixer": _STATE_SPACE, "conv1d": ("*conv1d",)},
        quantizes=("attention", "ssm_mixer", "mlp", "experts"),
        tests=("tests/lightning/test_hybrid_qad.py",),
    ),
    Family(
        "Mamba, Mamba-2",
        ("Mamba", "Mamba2"),
        modules={"ssm_mixer": _MIXER},
        preset="fp_embeddings",
        quantizes=("ssm_mixer",),
        tests=("tests/qat/test_hybrid_policy.py",),
    ),
    Family(
        "Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE)",
        ("Qwen3Next", "Qwen3_5", "Qwen3_5Moe"),
        experts="fused",
        modules={"linear_attention": _GATED_DELTANET, "linear_attention_gates": _GATED_DELTANET_GATES},
        quantizes=("attention", "linear_attention", "mlp", "experts"),
        tests=("tests/lightning/test_hybrid_qad.py",),
    ),
    Family(
        "OLMo-Hybrid",
        ("OlmoHybrid",),
        modules={
            "linear_attention": (
                "*linear_attn.q_proj",
                "*linear_attn.k_proj",
                "*linear_attn.v_proj",
                "*linear_attn.g_proj",
                "*linear_attn.o_proj",
            ),
            "linear_attention_gates": ("*linear_attn.a_proj", "*linear_attn.b_proj"),
        },
        quantizes=("attention", "linear_attention", "mlp"),
        tests=("tests/lightning/test_hybrid_qad.py",),
    ),
    Family(
        "RecurrentGemma",
        ("RecurrentGemma",),
        fused_siblings=(("linear_x", "linear_y"),),
        quantizes=("attention", "mlp", "other"),
        tests=("tests/lightning/test_hybrid_qad.py",),
    ),
    Family(
        "Llama 4",
        ("Llama4",),
        experts="transposed",
        expert_classes=("Llama4TextExperts",),
        export=(),
        modules={"router": ("*feed_forward.router",)},
        tests=("tests/qat/test_moe.py",),
        refused="its transposed experts have a modelopt wrapper of their own that no export here writes",
        quantizes=(),
    ),
    Family(
        "DBRX",
        ("Dbrx",),
        experts="fused",
        expert_classes=("DbrxExperts",),
        export=(),
        tests=("tests/lightning/test_fused_experts.py",),
        refused="modelopt 0.47's DBRX expert wrapper fails in calibration ('QuantDbrxExperts' object is not iterable)",
        quantizes=(),
    ),
    Family(
        "Aria (text)",
        ("AriaText",),
        experts="fused",
        expert_classes=("AriaGroupedExpertsGemm",),
        export=(),
        tests=("tests/lightning/test_fused_experts.py",),
        refused="its experts are grouped GEMMs over sorted tokens that modelopt 0.47 neither wraps nor exports",
        quantizes=(),
    ),
    Family(
        "LongCat-Flash",
        ("LongcatFlash",),
        experts="fused",
        expert_classes=("LongcatFlashExperts",),
        export=(),
        tests=("tests/lightning/test_fused_experts.py",),
        refused="its routed and zero-compute experts share one container that modelopt 0.47 neither wraps nor exports",
        quantizes=(),
    ),
    Family(
        "DeepSeek-V4",
        ("DeepseekV4",),
        experts="fused",
        expert_classes=("DeepseekV4GroupedLinear",),
        export=(),
        tests=("tests/lightning/test_fused_experts.py",),
        refused="its attention output's grouped linear (DeepseekV4GroupedLinear, a block-diagonal bmm) gets no "
        "modelopt quantizer, and modelopt's export needs one format across its attention's and KV compressor's "
        "projections of one input",
        quantizes=(),
    ),
    Family(
        "JetMoe",
        ("JetMoe",),
        experts="fused",
        expert_classes=("JetMoeParallelExperts",),
        export=(),
        tests=("tests/lightning/test_fused_experts.py",),
        refused="its experts (one [experts, out, in] weight per projection, run over sorted tokens) have no modelopt "
        "0.47 wrapper",
        quantizes=(),
    ),
    Family(
        "megatron-core grouped experts (moe_grouped_gemm=True)",
        _GROUPED,
        front_ends=(NEMO, BRIDGE),
        experts="grouped",
        expert_classes=_GROUPED,
        export=(),
        tests=("tests/bridge/test_bridge_recipe.py", "tests/nemo/test_moe_megatron.py"),
        refused="grouped GEMMs hold no linear per expert to quantize (CUDA-only; SequentialMLP trains)",
        quantizes=(),
    ),
)


def module_patterns(group: str) -> tuple[str, ...]:
    """Every family's module-name globs of policy group ``group``, in table order, each once."""
    seen: dict[str, None] = {}
    for family in FAMILIES:
        for pattern in family.modules.get(group, ()):
            seen.setdefault(pattern)
    return tuple(seen)


def fused_sibling_sets() -> tuple[tuple[str, ...], ...]:
    """Every family's layers that deploy fused (leaf names), in table order, each once."""
    seen: dict[tuple[str, ...], None] = {}
    for family in FAMILIES:
        for siblings in family.fused_siblings:
            seen.setdefault(siblings)
    return tuple(seen)


def expert_classes(experts: str, refused: bool | None = None) -> tuple[str, ...]:
    """The expert container classes of the families holding their experts as ``experts`` (refused ones only with
    ``refused=True``, supported ones only with ``False``)."""
    return tuple(c for f in FAMILIES if f.experts == experts and (refused is None or bool(f.refused) == refused)
                 for c in f.expert_classes)  # fmt: skip


def refused_classes() -> dict[str, tuple[str, str]]:
    """The module classes that identify a refused family's layout (grouped megatron-core experts aside: refused on
    their own path): class name -> (family name, why it is refused)."""
    return {c: (f.name, f.refused) for f in FAMILIES if f.refused and f.experts != "grouped" for c in f.expert_classes}
