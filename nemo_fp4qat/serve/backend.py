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
from dataclasses import dataclass
from pathlib import Path

import torch

from ..export.deployed_model import load_deployed_model

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
        from transformers import StoppingCriteria, StoppingCriteriaList

        class Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):  # stop between tokens when cancelled
                return bool(cancel is not None and cancel.is_set())

        with self.tok_lock:
            enc = self.tokenizer(prompts, return_tensors="pt", padding=True, return_token_type_ids=False)
        sample = temperature > 0
        with self.lock, torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(
                **enc,
                max_new_tokens=max_tokens,
                do_sample=sample,
                temperature=temperature if sample else None,
                top_p=top_p if sample else None,
                top_k=None,
                pad_token_id=self.tokenizer.pad_token_id,
                stopping_criteria=StoppingCriteriaList([Cancelled()]),
            )
        results = []
        n_prompt = enc.input_ids.shape[1]
        for i in range(len(prompts)):
            new = out[i, n_prompt:]
            eos = self.tokenizer.eos_token_id
            ids = new.tolist()
            if eos is not None and eos in ids:
                ids = ids[: ids.index(eos)]
            with self.tok_lock:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
            reason = "length" if len(ids) >= max_tokens else "stop"
            for s in stop or []:
                if s and s in text:
                    text, reason = text[: text.index(s)], "stop"
            if cancel is not None and cancel.is_set():
                reason = "cancelled"
            prompt_tokens = int(enc.attention_mask[i].sum())
            results.append(Completion(text, prompt_tokens, len(ids), reason))
        return results


class TRTLLMBackend:
    """TensorRT-LLM's LLM API over the export directory (GPU machines only)."""

    name = "tensorrt_llm"

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

    def generate(self, prompts, max_tokens, temperature=0.0, top_p=1.0, stop=None, seed=None, cancel=None):
        from tensorrt_llm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed)
        outs = self.llm.generate(prompts, params)
        return [Completion(o.outputs[0].text, len(o.prompt_token_ids), len(o.outputs[0].token_ids),
                           o.outputs[0].finish_reason or "stop") for o in outs]  # fmt: skip


def load_backend(export_dir: str | Path, backend: str = "auto") -> PyTorchBackend | TRTLLMBackend:
    """``auto``: TensorRT-LLM when importable and a GPU is present, else the PyTorch CPU backend."""
    if backend in ("auto", "tensorrt_llm"):
        try:
            import tensorrt_llm  # noqa: F401

            if torch.cuda.is_available():
                return TRTLLMBackend(export_dir)
        except ImportError:
            if backend == "tensorrt_llm":
                raise
    return PyTorchBackend(export_dir)
