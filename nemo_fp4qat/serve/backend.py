"""Serving backends for an exported checkpoint.

``PyTorchBackend`` rebuilds the deployed model on the CPU
(:func:`~nemo_fp4qat.export.deployed_model.load_deployed_model`, also what ``nemo-fp4qat eval``
evaluates): linear weights are the exported codes x scales, and inputs of NVFP4 / FP8 layers are
quantized with the exported ``input_scale``, so what is served is what was exported, not the
training model. ``TRTLLMBackend`` hands the directory to TensorRT-LLM's LLM API
when it is importable (GPU machines; not testable on CPUs, kept thin).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..export.deployed_model import load_deployed_model
from .generation import GenerationRow, SamplingParams, generate_batch

__all__ = ["Completion", "PyTorchBackend", "TRTLLMBackend", "load_backend"]


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length" | "cancelled"


class PyTorchBackend:
    """A CPU model rebuilt from the export directory (unified HF or TensorRT-LLM Llama checkpoint)."""

    name = "pytorch"

    def __init__(self, export_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        self.dir = Path(export_dir)
        deployed = load_deployed_model(self.dir, dtype)
        if deployed.tokenizer is None:
            raise ValueError(f"{self.dir} has no tokenizer; export with tokenizer=... to serve it.")
        self.model, self.tokenizer, self.algos = deployed.model, deployed.tokenizer, deployed.algos
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.tokenizer.padding_side = "left"
        self.lock = threading.Lock()  # one generate() at a time; the server batches requests
        # HF fast tokenizers are not thread-safe ("Already borrowed"): the event loop counts prompt
        # tokens while the executor thread encodes/decodes a batch
        self.tok_lock = threading.Lock()

    @property
    def model_id(self) -> str:
        return self.dir.name

    def count_tokens(self, text: str) -> int:
        with self.tok_lock:
            return len(self.tokenizer(text).input_ids)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt for a chat (the export's own template, with the assistant turn opened)."""
        with self.tok_lock:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def generate_rows(
        self,
        prompts: list[str],
        params: list[SamplingParams],
        cancelled: list[threading.Event | None] | None = None,
        on_step: Callable[[list[GenerationRow]], None] | None = None,
    ) -> list[GenerationRow]:
        """One batch: row ``i`` is ``prompts[i]`` sampled with ``params[i]`` (see :mod:`.generation`)."""
        with self.lock, self.tok_lock:
            return generate_batch(self.model, self.tokenizer, prompts, params, cancelled, on_step)

    def generate(
        self,
        prompts: list[str],
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int | None = None,
        cancel: threading.Event | None = None,
    ) -> list[Completion]:
        """Every prompt with the same sampling parameters (the simple form of :meth:`generate_rows`)."""
        p = SamplingParams(max_tokens, temperature, top_p, tuple(stop or ()), seed)
        rows = self.generate_rows(prompts, [p] * len(prompts), [cancel] * len(prompts))
        return [Completion(r.text, r.prompt_tokens, len(r.token_ids), r.finish_reason or "length") for r in rows]


class TRTLLMBackend:
    """TensorRT-LLM's LLM API over the export directory (GPU machines only)."""

    name = "trtllm"

    def __init__(self, export_dir: str | Path) -> None:
        from tensorrt_llm import LLM  # optional: GPU machines only

        self.dir = Path(export_dir)
        self.llm = LLM(model=str(self.dir))
        self.tokenizer = self.llm.tokenizer

    @property
    def model_id(self) -> str:
        return self.dir.name

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def generate_rows(self, prompts, params, cancelled=None, on_step=None):
        """One LLM API request per row; ``on_step`` once, at the end (no token streaming on this path yet)."""
        from tensorrt_llm import SamplingParams as TRTParams

        outs = self.llm.generate(prompts, [TRTParams(max_tokens=p.max_tokens, temperature=p.temperature,
                                                     top_p=p.top_p, stop=list(p.stop) or None, seed=p.seed)
                                           for p in params])  # fmt: skip
        rows = [GenerationRow(len(o.prompt_token_ids), list(o.outputs[0].token_ids), o.outputs[0].text,
                              finish_reason=o.outputs[0].finish_reason or "stop") for o in outs]  # fmt: skip
        if on_step is not None:
            on_step(rows)
        return rows


def load_backend(export_dir: str | Path, backend: str = "auto") -> PyTorchBackend | TRTLLMBackend:
    """``auto``: TensorRT-LLM when importable and a GPU is present, else the PyTorch CPU backend; ``trtllm`` (the
    spelling of TensorRT-LLM everywhere in this plugin: runtimes, export kinds) or ``pytorch`` to choose."""
    if backend not in ("auto", "trtllm", "pytorch"):
        raise ValueError(f"backend={backend!r}: use 'auto', 'trtllm' (TensorRT-LLM's LLM API, GPUs) or 'pytorch'")
    if backend in ("auto", "trtllm"):
        try:
            import tensorrt_llm  # noqa: F401

            if torch.cuda.is_available():
                return TRTLLMBackend(export_dir)
        except ImportError:
            if backend == "trtllm":
                raise
    return PyTorchBackend(export_dir)
