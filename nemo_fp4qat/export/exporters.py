"""Export a QAT-trained model through modelopt's exporters, atomically and validated.

Two checkpoint kinds:

- ``"hf"``: the unified Hugging Face checkpoint (``hf_quant_config.json`` + ``config.json
  ["quantization_config"]``) that TensorRT-LLM's LLM API, vLLM and SGLang load
  (``modelopt.torch.export.export_hf_checkpoint``; Hugging Face models).
- ``"trtllm"``: the TensorRT-LLM checkpoint NeMo calls "qnemo" (``config.json`` +
  ``rank{N}.safetensors`` + tokenizer), what NeMo's ``TensorRTLLM.export`` builds engines from
  (``modelopt.torch.export.export_tensorrt_llm_checkpoint``; megatron-core and HF models;
  tensor-parallel splitting for any ``tensor_parallel``).

Order of work: :func:`preflight` refuses what a runtime would reject (nothing written); modelopt
writes into a scratch directory; the plugin's validator re-reads what was written and compares it
with the trained model's fake-quantized weights; only then does the directory appear.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..numerics.cpu_shims import modelopt_export_on_cpu
from ..qat.calibration.scale_levers import fold_learned_scales
from ..qat.calibration.w4a8_scaling import w4a8_export_amax
from ..qat.experts.moe import split_expert_name
from ..qat.policy.rules import is_quantizable_linear
from ..specs import from_fields
from .atomic import atomic_directory, write_manifest
from .engine_dtype import round_unquantized_tensors
from .engine_fields import declare_for_engines
from .engine_plan import EnginePlan, deployment_notes, write_engine_plan
from .gpt_oss_mxfp4 import gpt_oss_expert_containers, gpt_oss_preflight, write_gpt_oss_mxfp4
from .mcore_layer_formats import declare_mcore_layer_formats
from .runtime_support import ENGINE_RUNTIMES, HF_ONLY_RUNTIMES, RUNTIMES, ExportRefused, preflight

__all__ = ["EXPORT_KINDS", "ExportConfig", "ExportValidationError", "export_checkpoint"]

log = logging.getLogger("nemo_fp4qat")
EXPORT_KINDS = ("hf", "trtllm")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ExportValidationError(RuntimeError):
    """The written checkpoint failed validation; the scratch directory was removed."""


@dataclass
class ExportConfig:
    """What to export and for which runtime.

    Args:
        kind: ``"hf"`` (unified HF checkpoint) or ``"trtllm"`` (TensorRT-LLM / qnemo checkpoint).
        runtime: the engine the checkpoint is for (:data:`RUNTIMES`): ``"trtllm"``, ``"vllm"`` or ``"sglang"``
            refuse, before anything is written, layers the engine has no kernel for (vLLM and SGLang load
            unified HF checkpoints only); ``"pytorch"`` allows anything modelopt exports (this plugin's server
            unpacks it).
        tensor_parallel: inference tensor-parallel size (``"trtllm"`` kind only).
        dtype: dtype of the unquantized tensors (embeddings, norms, lm_head); None keeps the model's.
            The engines run 16-bit activations, so a checkpoint for one of them holds 16-bit tensors: a bfloat16
            or float16 model's in its own dtype, exactly; a float32 model's in float16, whose 10 mantissa bits
            round them less than bfloat16's 7 (``"float32"`` is refused there). A float32 model's unified HF
            checkpoint is packed from the float32 weights and only its unquantized tensors are rounded, so the
            FP4 / FP8 codes stay the trained ones, and it is validated as written. ``runtime="pytorch"`` keeps a
            float32 model's float32. For a 16-bit model modelopt casts before packing, so a dtype other than
            the training dtype changes rounding (validation then reports the codes that moved).
        decoder_type: modelopt decoder type for ``"trtllm"`` (``"llama"``, ``"gpt"`` ...); inferred if None.
        overwrite: replace an existing directory (only once the new export is complete).
        validate: re-read and check the written checkpoint against the model before publishing it.
        plan: :class:`EnginePlan` (or dict) for the build plan written beside the checkpoint.
        hf_model: for ``"hf"`` of a megatron-core model (NeMo 2, Megatron-Bridge): the Hugging Face folder (or
            hub id) the model was imported from, whose ``config.json`` and tokenizer the checkpoint carries
            (modelopt's ``export_mcore_gpt_to_hf``).
    """

    kind: str = "hf"
    runtime: str = "trtllm"
    tensor_parallel: int = 1
    dtype: str | None = None
    decoder_type: str | None = None
    overwrite: bool = False
    validate: bool = True
    plan: Any = field(default=None)
    hf_model: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in EXPORT_KINDS:
            raise ValueError(
                f"Unknown export kind {self.kind!r}; use 'hf' (unified Hugging Face checkpoint for TRT-LLM's LLM API, "
                "vLLM, SGLang) or 'trtllm' (TensorRT-LLM checkpoint, NeMo's qnemo)."
            )
        if self.runtime not in RUNTIMES:
            raise ValueError(f"Unknown runtime {self.runtime!r}; choose one of {', '.join(RUNTIMES)}.")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"Unknown dtype {self.dtype!r}; choose one of {', '.join(_DTYPES)}.")
        if self.kind == "trtllm" and self.dtype == "float32":
            raise ValueError(
                "dtype='float32' for a TensorRT-LLM checkpoint: TensorRT-LLM checkpoints hold float16 or bfloat16 "
                "tensors (modelopt would silently write float16); use dtype='float16' or 'bfloat16' (None keeps a "
                "16-bit model's dtype and writes a float32 model's in float16), or kind='hf' with runtime='pytorch', "
                "which keeps float32."
            )
        if self.dtype == "float32" and self.runtime in ENGINE_RUNTIMES:
            raise ValueError(
                f"dtype='float32' for runtime={self.runtime!r}: TensorRT-LLM, vLLM and SGLang run 16-bit activations "
                "(vLLM would downcast a float32 checkpoint to bfloat16 unvalidated); use dtype='float16' or "
                "'bfloat16' (None writes a float32 model's unquantized tensors in float16), or runtime='pytorch' for "
                "this plugin's server, which runs float32."
            )
        if self.kind == "trtllm" and self.runtime in HF_ONLY_RUNTIMES:
            raise ValueError(
                f"kind='trtllm' for runtime={self.runtime!r}: vLLM and SGLang load unified HF checkpoints; use "
                "kind='hf'."
            )
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.kind == "hf" and self.tensor_parallel != 1:
            raise ValueError(
                "A unified HF checkpoint is not split by tensor parallelism (the runtime shards it at load time); "
                "set tensor_parallel=1 or use kind='trtllm'."
            )
        self.plan = EnginePlan.resolve_spec(self.plan)


def _trained_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def export_dtype(model: nn.Module, cfg: ExportConfig) -> torch.dtype:
    """The dtype ``cfg``'s checkpoint holds ``model``'s unquantized tensors in (see :class:`ExportConfig`)."""
    if cfg.dtype is not None:
        return _DTYPES[cfg.dtype]
    trained = _trained_dtype(model)
    if (cfg.kind == "trtllm" or cfg.runtime in ENGINE_RUNTIMES) and trained not in (torch.float16, torch.bfloat16):
        return torch.float16  # the 16-bit dtype closest to float32 in range of these tensors (see ExportConfig)
    return trained


def _is_hf_model(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "model_type") and hasattr(model, "save_pretrained")


def _decoder_type(model: nn.Module, given: str | None) -> str:
    if given:
        return given
    if _is_hf_model(model):
        return str(model.config.model_type)
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "gated_linear_unit", False) and getattr(cfg, "normalization", "") == "RMSNorm":
        return "llama"
    return "gpt"


def _export_hf(model: nn.Module, out: Path, cfg: ExportConfig) -> None:
    from modelopt.torch.export import export_hf_checkpoint

    if not _is_hf_model(model):
        _export_mcore_hf(model, out, cfg)
        return
    if gpt_oss_expert_containers(model):  # gpt-oss's own MXFP4 layout, which the engines load as gpt-oss
        write_gpt_oss_mxfp4(model, out, export_dtype(model, cfg))
        return
    # modelopt's HF exporter replaces the weights of the model it is given with packed ones: export a copy
    # so the trained model stays usable (the training run may go on, or be evaluated after export).
    # Tensors a module keeps from its last forward (RecurrentGemma's recurrent state, computed with gradients) cannot
    # be deep-copied; the copy holds them detached (the export writes parameters and buffers, not these).
    kept = {id(t): t.detach().clone() for m in model.modules() for t in vars(m).values()
            if isinstance(t, torch.Tensor) and not t.is_leaf}  # fmt: skip
    work = copy.deepcopy(model, kept)
    _ensure_architectures(work)
    packed, declared = _hf_dtypes(model, cfg)
    with modelopt_export_on_cpu(), _fp8_weights_divided_in_float32(), torch.inference_mode():
        export_hf_checkpoint(work, dtype=packed, export_dir=str(out))
    del work
    round_unquantized_tensors(out, declared)


def _hf_dtypes(model: nn.Module, cfg: ExportConfig) -> tuple[torch.dtype, torch.dtype]:
    """(the dtype modelopt packs from, the dtype the checkpoint declares): a float32 model asked for a 16-bit
    checkpoint is packed from its float32 weights, its unquantized tensors rounded afterwards (engine_dtype.py)."""
    declared = export_dtype(model, cfg)
    if _trained_dtype(model) == torch.float32 and declared != torch.float32:
        return torch.float32, declared
    return declared, declared


def _export_mcore_hf(model: nn.Module, out: Path, cfg: ExportConfig) -> None:
    """A megatron-core GPT to a unified HF checkpoint, in the layout of the HF model it was imported from."""
    try:
        from modelopt.torch.export import export_mcore_gpt_to_hf
    except ImportError:
        export_mcore_gpt_to_hf = None
    if not hasattr(model, "decoder") or export_mcore_gpt_to_hf is None:
        raise ValueError(
            f"kind='hf' exports Hugging Face models and megatron-core GPT models (modelopt >= 0.4x's "
            f"export_mcore_gpt_to_hf); {type(model).__name__} is neither, or this modelopt lacks the exporter. "
            "Use kind='trtllm' (qnemo), which NeMo's TensorRTLLM exporter builds engines from."
        )
    if not cfg.hf_model:
        raise ValueError(
            "kind='hf' of a megatron-core model needs the Hugging Face model it was imported from: set "
            "export={'kind': 'hf', 'hf_model': '/path/to/hf_model'} (its config.json and tokenizer are written "
            "beside the weights), or use kind='trtllm'."
        )
    packed, declared = _hf_dtypes(model, cfg)
    with modelopt_export_on_cpu(), _fp8_weights_divided_in_float32(), torch.inference_mode():
        export_mcore_gpt_to_hf(model, cfg.hf_model, dtype=packed, export_dir=str(out))
    declare_mcore_layer_formats(model, out)
    round_unquantized_tensors(out, declared)


@contextlib.contextmanager
def _fp8_weights_divided_in_float32() -> Iterator[None]:
    """modelopt's unified HF exporter quantizes an FP8 weight as ``(weight / scale).to(float8)`` with a 0-d float32
    scale, which PyTorch's type promotion computes in the weight's dtype: for a bfloat16 model the quotient is
    rounded to bfloat16 before the E4M3 rounding, and codes near an E4M3 boundary land one step away from the ones
    training used (``fake_quant_fp8`` divides in float32, as modelopt's TensorRT-LLM exporter and the FP8 GEMM's
    dequantization do). Inside the block that one division is done in float32; every other format goes to
    modelopt's own function."""
    from modelopt.torch.export import quant_utils, unified_export_hf

    original = unified_export_hf.to_quantized_weight
    fp8 = getattr(quant_utils, "QUANTIZATION_FP8", "fp8")

    def to_quantized_weight(weight: torch.Tensor, weights_scaling_factor: torch.Tensor, quantization: str,
                            *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        sixteen_bit = weight.dtype in (torch.bfloat16, torch.float16)
        if quantization == fp8 and sixteen_bit and weights_scaling_factor.dim() == 0:
            return (weight.float() / weights_scaling_factor.float()).to(torch.float8_e4m3fn)
        return original(weight, weights_scaling_factor, quantization, *args, **kwargs)

    unified_export_hf.to_quantized_weight = to_quantized_weight
    try:
        yield
    finally:
        unified_export_hf.to_quantized_weight = original


@contextlib.contextmanager
def _written_on_cpu(model: nn.Module) -> Iterator[None]:
    """Quantize and write a GPU model's checkpoint from the CPU, then move it back.

    modelopt's exporters compute scales and codes with the tensors' own device, and PyTorch's CUDA division by a
    Python scalar multiplies by its reciprocal (``amax / 448``, ``amax / 6``): on a GPU the exported FP8 scales are an
    ulp off and NVFP4 block scales and codes move (measured on an H200: 73,168 FP4 codes and 33 layers of a bf16
    SmolLM2-shaped model), where the training kernels follow the exporter's CPU arithmetic. A single-process model
    moves to the CPU for the writing (in place: the optimizer keeps its parameters); a model sharded over processes
    stays where it is (its exporter gathers over the process group), and the validator still compares the codes."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    sharded = (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and (torch.distributed.get_world_size() > 1)
    )
    if device.type == "cpu" or sharded:
        yield
        return
    model.to("cpu")
    try:
        yield
    finally:
        model.to(device)


def _ensure_architectures(model: nn.Module) -> None:
    # modelopt's exporters read config.architectures[0]; HF models built from a config lack it
    if _is_hf_model(model) and not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]


@contextlib.contextmanager
def _copyable_config(model: nn.Module) -> Iterator[None]:
    """modelopt's TensorRT-LLM export deep-copies a megatron model's ``config.__dict__``; a Megatron-Bridge model's
    config is its model provider, which also holds process groups and pre-wrap hooks that cannot be copied. For the
    export the model carries a shallow copy of its config without those entries (the export reads none of them),
    and with megatron-core 0.19's ``rope_scaling=False`` read as "no rope scaling"."""
    config = getattr(model, "config", None)
    if config is None or _is_hf_model(model):
        yield
        return
    slim = copy.copy(config)
    for key, value in list(vars(config).items()):
        try:
            copy.deepcopy(value)
        except Exception:  # process groups, closures over them: not part of the exported architecture
            delattr(slim, key)
    if getattr(slim, "rope_scaling", None) is False:  # megatron-core's flag; modelopt reads a dict or None
        slim.rope_scaling = None
    model.config = slim
    try:
        yield
    finally:
        model.config = config


@contextlib.contextmanager
def _rope_fields_modelopt_reads(model: nn.Module) -> Iterator[None]:
    """modelopt's TensorRT-LLM export reads the rotary base from ``config.rope_theta`` (and llama3 scaling from
    ``rope_scaling``); a transformers 5 config holds them in ``rope_parameters`` only, and without them the checkpoint
    omits ``rotary_base`` and TensorRT-LLM runs its default base (10000): another model than trained. For the export
    the config also carries them under the names modelopt reads."""
    config = getattr(model, "config", None)
    rope = getattr(config, "rope_parameters", None) if _is_hf_model(model) else None
    added = []
    if isinstance(rope, dict) and "rope_theta" in rope:
        fields = {"rope_theta": rope["rope_theta"]}
        if rope.get("rope_type", "default") != "default":
            fields["rope_scaling"] = dict(rope)
        for key, value in fields.items():
            if getattr(config, key, None) is None:
                setattr(config, key, value)
                added.append(key)
    try:
        yield
    finally:
        for key in added:
            delattr(config, key)


def _export_trtllm(model: nn.Module, out: Path, cfg: ExportConfig) -> None:
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    _ensure_architectures(model)
    decoder = _decoder_type(model, cfg.decoder_type)
    if decoder == "gpt" and getattr(model, "share_embeddings_and_output_weights", False):
        # modelopt asserts "lm_head not available for decoder gpt" deep inside the export
        raise ExportRefused(
            "This megatron GPT ties its output layer to the word embeddings, which modelopt's TensorRT-LLM export "
            "supports for decoder types such as 'llama' or 'gpt2' but not 'gpt'. Train with "
            "share_embeddings_and_output_weights=False, or pass decoder_type for a decoder that shares them."
        )
    with modelopt_export_on_cpu(), torch.inference_mode(), _copyable_config(model), _rope_fields_modelopt_reads(model):
        export_tensorrt_llm_checkpoint(
            model,
            decoder_type=decoder,
            dtype=export_dtype(model, cfg),
            export_dir=str(out),
            inference_tensor_parallel=cfg.tensor_parallel,
        )


def _save_tokenizer(tokenizer: Any, out: Path, kind: str, nemo_context: str | Path | None) -> None:
    if nemo_context is not None:
        # NeMo's qnemo loader rebuilds the tokenizer from the model context (same as llm.ptq does).
        shutil.copytree(nemo_context, out / "nemo_context", dirs_exist_ok=True)
    if tokenizer is None:
        return
    inner = getattr(tokenizer, "tokenizer", tokenizer)  # NeMo's AutoTokenizer wraps the HF one
    if hasattr(inner, "save_pretrained"):
        # unified HF: beside the weights; qnemo: nemo.export looks in "tokenizer/"
        inner.save_pretrained(str(out if kind == "hf" else out / "tokenizer"))


def _static_nvfp4(q: Any) -> bool:
    """An enabled NVFP4 weight quantizer with static (calibrated or learned) block scales."""
    bs = getattr(q, "block_sizes", None) or {}
    return bool(getattr(q, "is_enabled", False)) and bs.get("type") == "static" and bs.get("scale_bits") == (4, 3)


def _refuse_static_fused_qkv(model: nn.Module) -> None:
    """modelopt's TensorRT-LLM checkpoint writer fuses q/k/v and derives the fused weight's NVFP4 block scales from
    the weights, not from calibrated (static or learned) block scales, so the checkpoint would not hold what was
    trained (measured: about 20% of q/k/v codes differ). Refuse it before anything is written."""
    static = sorted(
        name for name, m in model.named_modules()
        if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "linear_qkv")
        and _static_nvfp4(getattr(m, "weight_quantizer", None))
    )  # fmt: skip
    if static:
        raise ExportRefused(
            f"Export refused, nothing was written: {len(static)} attention q/k/v layers (e.g. {static[0]}) hold "
            "calibrated or learned NVFP4 block scales (calibration weight_scale / learned_scales), which modelopt's "
            "TensorRT-LLM checkpoint writer replaces with block scales derived from the fused q/k/v weights. Export "
            "a unified HF checkpoint (kind='hf'; TensorRT-LLM's LLM API, vLLM and SGLang load it), or keep "
            "attention on weight_scale='max'."
        )


def refuse_moe_trtllm(model: nn.Module) -> None:
    """A TensorRT-LLM checkpoint of a mixture-of-experts model: modelopt's writer supports experts only for some
    decoder types (``build_moe_config`` asserts llama, dbrx, phi3, deepseek or qwen with a bare AssertionError), and
    its stacked expert tensors are not what this plugin's validator reads. The unified HF checkpoint carries every
    expert under its own name and is validated code for code; refuse the other kind before anything is written."""
    experts = [name for name, m in model.named_modules() if split_expert_name(name) and is_quantizable_linear(m)]
    if experts:
        raise ExportRefused(
            f"Export refused, nothing was written: this is a mixture-of-experts model ({len(experts)} routed expert "
            f"linears, e.g. {experts[0]}), and a TensorRT-LLM checkpoint (kind='trtllm') of one is not written or "
            "validated by this plugin. Export a unified HF checkpoint (kind='hf'): TensorRT-LLM's LLM API, vLLM and "
            "SGLang load it with every expert in its trained format."
        )


def export_checkpoint(
    model: nn.Module,
    out_dir: str | Path,
    config: ExportConfig | dict[str, Any] | None = None,
    tokenizer: Any = None,
    nemo_context: str | Path | None = None,
) -> Path:
    """Export ``model`` (with modelopt quantizers) to ``out_dir``; returns the directory.

    Args:
        model: the quantized model (a Hugging Face model for ``kind="hf"``; HF or megatron-core for ``"trtllm"``).
        out_dir: the export directory, written atomically (a scratch sibling renamed at the end).
        config: :class:`ExportConfig` or a dict of its fields (default: a unified HF checkpoint for TensorRT-LLM).
        tokenizer: saved beside the checkpoint when given.
        nemo_context: a NeMo model context directory, copied to ``nemo_context/`` (NeMo's qnemo layout).

    Raises:
        ExportRefused: before anything is written, when the runtime would reject the model.
        ExportValidationError: nothing is published when the written checkpoint does not match the model.
        ConfigError: an unknown or bad field in ``config``.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is not set.

    Example:
        >>> export_checkpoint(model, "out/qnemo", {"kind": "trtllm", "tensor_parallel": 2}, tokenizer=tok)
    """
    cfg = config if isinstance(config, ExportConfig) else from_fields(ExportConfig, dict(config or {}), "export")
    out = Path(out_dir)
    # learned block scales (LSQ) become the plain static scales checkpoints store; the forward is unchanged
    fold_learned_scales(model)
    if gpt_oss_expert_containers(model):  # gpt-oss's own MXFP4 layout
        layers = gpt_oss_preflight(model, cfg.kind)
    else:
        layers = preflight(model, cfg.runtime, cfg.tensor_parallel)
    if cfg.kind == "trtllm":
        refuse_moe_trtllm(model)
        _refuse_static_fused_qkv(model)
    with atomic_directory(out, overwrite=cfg.overwrite) as tmp:
        # W4A8 layers train with 6 x amax (w4a8_scaling); modelopt's exporter needs the true amax
        with w4a8_export_amax(model), _written_on_cpu(model):
            if cfg.kind == "hf":
                _export_hf(model, tmp, cfg)
                declare_for_engines(tmp)
            else:
                _export_trtllm(model, tmp, cfg)
        _save_tokenizer(tokenizer, tmp, cfg.kind, nemo_context)
        formats = sorted({lf.weight.name for lf in layers})
        info = {"final_dir": str(out.resolve()), "formats": formats, "runtime": cfg.runtime}
        write_engine_plan(tmp, cfg.plan, cfg.kind, cfg.tensor_parallel, info)
        for note in deployment_notes(formats) if cfg.runtime == "trtllm" else []:
            log.warning("%s", note)
        if cfg.validate:
            from .validate import validate_export

            report = validate_export(tmp, model=model, runtime=cfg.runtime, require_manifest=False)
            if not report.ok:
                raise ExportValidationError(
                    f"The export to {out} failed validation; nothing was published:\n{report.format()}"
                )
            report.path = str(out)  # where it is published, not the scratch directory it was checked in
            (tmp / "validation.json").write_text(json.dumps(report.to_dict(), indent=2))
        import modelopt

        write_manifest(
            tmp,
            {"kind": cfg.kind, "tensor_parallel": cfg.tensor_parallel, "runtime": cfg.runtime, "formats": formats,
             "modelopt": modelopt.__version__, "producer": "nemo_fp4qat"},
        )  # fmt: skip
    log.info("Exported %s checkpoint (%s) to %s", cfg.kind, ", ".join(formats), out)
    return out
