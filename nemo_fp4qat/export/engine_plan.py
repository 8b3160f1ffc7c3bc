"""The TensorRT-LLM engine build plan written beside an exported checkpoint.

TensorRT-LLM is not installable on CPU machines, so the plan is the hand-off: the build limits,
KV-cache precision and plugins, plus the exact ``trtllm-build`` / ``trtllm-bench`` (engine path)
and ``trtllm-serve`` (LLM API, unified HF checkpoint) commands to run on the GPU machine.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..specs import from_fields

__all__ = ["EnginePlan", "write_engine_plan"]

PLAN_JSON = "engine_plan.json"
PLAN_SH = "build_engine.sh"


@dataclass
class EnginePlan:
    """Limits of the TensorRT-LLM engine to build from an export.

    Args:
        max_input_len / max_seq_len: longest prompt / prompt + generation, in tokens.
        max_batch_size / max_beam_width / max_num_tokens: scheduler limits.
        kv_cache_dtype: ``"auto"`` (the checkpoint's ``kv_cache_quant_algo`` or the model dtype) or ``"fp8"``.
        plugins: extra ``trtllm-build`` plugin flags (``{"gemm_plugin": "auto"}`` ...). ``gemm_plugin: "auto"``
            becomes ``nvfp4`` for a checkpoint with NVFP4 layers: TensorRT-LLM's ``FP4Linear`` runs its FP4 GEMM
            only under that plugin (FP8 layers keep TensorRT's own FP8 GEMM).
    """

    max_input_len: int = 2048
    max_seq_len: int = 4096
    max_batch_size: int = 8
    max_beam_width: int = 1
    max_num_tokens: int = 8192
    kv_cache_dtype: str = "auto"
    plugins: dict[str, str] = field(default_factory=lambda: {"gemm_plugin": "auto", "gpt_attention_plugin": "auto"})

    def __post_init__(self) -> None:
        if self.max_input_len <= 0 or self.max_seq_len <= self.max_input_len:
            raise ValueError(
                f"EnginePlan needs 0 < max_input_len < max_seq_len, got {self.max_input_len} / {self.max_seq_len}; "
                "max_seq_len counts prompt plus generated tokens."
            )
        for k in ("max_batch_size", "max_beam_width", "max_num_tokens"):
            if getattr(self, k) <= 0:
                raise ValueError(f"EnginePlan.{k} must be positive, got {getattr(self, k)}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"EnginePlan.kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")

    @classmethod
    def resolve_spec(cls, spec: EnginePlan | dict[str, Any] | None) -> EnginePlan:
        if spec is None:
            return cls()
        return spec if isinstance(spec, cls) else from_fields(cls, spec, "engine plan")

    def build_plugins(self, formats: list[str]) -> dict[str, str]:
        """The ``trtllm-build`` plugin flags for a checkpoint holding ``formats`` (see ``plugins``)."""
        plugins = dict(self.plugins)
        if plugins.get("gemm_plugin") == "auto" and any(f.startswith("nvfp4") for f in formats):
            plugins["gemm_plugin"] = "nvfp4"
        return plugins

    def commands(self, checkpoint_dir: str, kind: str, tensor_parallel: int = 1,
                 formats: list[str] | None = None) -> list[str]:  # fmt: skip
        ckpt = shlex.quote(str(checkpoint_dir))
        engine = shlex.quote(str(checkpoint_dir).rstrip("/") + "_engine")
        if kind == "trtllm":
            build = [
                "trtllm-build", "--checkpoint_dir", ckpt, "--output_dir", engine,
                "--max_input_len", str(self.max_input_len), "--max_seq_len", str(self.max_seq_len),
                "--max_batch_size", str(self.max_batch_size), "--max_beam_width", str(self.max_beam_width),
                "--max_num_tokens", str(self.max_num_tokens),
            ]  # fmt: skip
            for k, v in self.build_plugins(formats or []).items():
                build += [f"--{k}", v]
            launcher = f"mpirun -n {tensor_parallel} " if tensor_parallel > 1 else ""
            bench = (
                f"{launcher}trtllm-bench --model {ckpt} throughput --engine_dir {engine} "
                f"--dataset dataset.jsonl --max_batch_size {self.max_batch_size}"
            )
            return [" ".join(build), bench]
        kv = f" --kv_cache_dtype {self.kv_cache_dtype}" if self.kv_cache_dtype != "auto" else ""
        return [
            f"trtllm-serve {ckpt} --tp_size {tensor_parallel} --max_batch_size {self.max_batch_size} "
            f"--max_seq_len {self.max_seq_len} --max_num_tokens {self.max_num_tokens}{kv}",
            f"trtllm-bench --model {ckpt} throughput --backend pytorch --dataset dataset.jsonl --tp {tensor_parallel}",
        ]


def deployment_notes(formats: list[str] | None) -> list[str]:
    """Where the engines run the checkpoint's formats as trained (from their loaders and kernels, December 2026)."""
    fmts = {f.lower() for f in formats or []}
    notes = []
    if any(f.startswith("nvfp4") for f in fmts):
        notes.append(
            "NVFP4 layers run as trained (FP4 weights and activations) on Blackwell GPUs only: TensorRT-LLM has no "
            "NVFP4 kernel before Blackwell; vLLM and SGLang run them weight-only on Hopper / Ada (16-bit "
            "activations, not what was trained); no engine runs NVFP4 on a CPU (nemo-fp4qat serve does, unpacked)."
        )
    if any(f.startswith("mx") for f in fmts):
        notes.append("MX layers: TensorRT-LLM serves MXFP4 only as W4A8_MXFP4_FP8 / W4A16_MXFP4, on Blackwell.")
    return notes


def write_engine_plan(directory: Path, plan: EnginePlan, kind: str, tensor_parallel: int, info: dict[str, Any]) -> None:
    """Write ``engine_plan.json`` and ``build_engine.sh`` into ``directory``."""
    final_dir = info.get("final_dir", str(directory))
    cmds = plan.commands(final_dir, kind, tensor_parallel, info.get("formats"))
    notes = deployment_notes(info.get("formats"))
    payload = {**asdict(plan), "checkpoint_kind": kind, "tensor_parallel": tensor_parallel, **info, "commands": cmds,
               "deployment": notes}  # fmt: skip
    (Path(directory) / PLAN_JSON).write_text(json.dumps(payload, indent=2))
    script = [
        "#!/usr/bin/env bash",
        "# Written by nemo-fp4qat export; run on a GPU machine with TensorRT-LLM.",
        "set -e",
    ]
    script += [f"# {n}" for n in notes] + cmds
    if kind == "hf":  # task scores of the deployed checkpoint, as lm-evaluation-harness computes them
        script += [
            "# lm-evaluation-harness on the served checkpoint (vLLM backend; pip install lm-eval vllm):",
            f"# lm_eval --model vllm --model_args pretrained={shlex.quote(final_dir)},tensor_parallel_size="
            f"{tensor_parallel},dtype=bfloat16 --tasks hellaswag,mmlu --batch_size auto --output_path lm_eval",
        ]
    (Path(directory) / PLAN_SH).write_text("\n".join(script) + "\n")
