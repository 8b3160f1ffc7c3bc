"""Serving backends for an exported checkpoint.

``PyTorchBackend`` rebuilds the model from a unified HF export on the CPU with the plugin's own
unpacker: linear weights are the exported codes x scales, and inputs of NVFP4 / FP8 layers are
quantized with the exported ``input_scale`` (forward pre-hooks), so what is served is what was
exported, not the training model. ``TRTLLMBackend`` hands the directory to TensorRT-LLM's LLM API
when it is importable (GPU machines; not testable on CPUs, kept thin).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cpu_fake_quant import fake_quant_nvfp4
from ..export.unpack import dequantize_linear
from ..export.validate import load_export

__all__ = ["Completion", "PyTorchBackend", "TRTLLMBackend", "load_backend"]


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length" | "cancelled"


def _fp8_fake_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * scale


class PyTorchBackend:
    """A CPU model built from the export directory (unified HF checkpoint)."""

    name = "pytorch"

    def __init__(self, export_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self.dir = Path(export_dir)
        kind, qcfg, (tensors,) = load_export(self.dir)
        if kind != "hf":
            raise ValueError(f"{self.dir} is a {kind} checkpoint; the PyTorch backend serves unified HF exports.")
        raw = json.loads((self.dir / "config.json").read_text())
        raw.pop("quantization_config", None)
        config = AutoConfig.for_model(**raw)
        self.model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.dir)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.tokenizer.padding_side = "left"
        self.algos = self._load(tensors, qcfg, dtype)
        self.lock = threading.Lock()  # one generate() at a time; the server batches requests
        # HF fast tokenizers are not thread-safe ("Already borrowed"): the event loop counts prompt
        # tokens while the executor thread encodes/decodes a batch
        self.tok_lock = threading.Lock()

    def _load(self, tensors: dict[str, torch.Tensor], qcfg: dict[str, Any], dtype: torch.dtype) -> dict[str, str]:
        mixed = qcfg.get("quantized_layers") or {}
        excluded = set(qcfg.get("exclude_modules") or [])
        params = dict(self.model.named_parameters())
        algos: dict[str, str] = {}
        by_mod: dict[str, dict[str, torch.Tensor]] = {}
        for k, v in tensors.items():
            mod, _, attr = k.rpartition(".")
            by_mod.setdefault(mod, {})[attr] = v
        with torch.no_grad():
            for mod, t in by_mod.items():
                algo = mixed.get(mod, {}).get("quant_algo") if mixed else qcfg.get("quant_algo")
                quantized = "weight_scale" in t and mod not in excluded and algo
                if quantized:
                    params[f"{mod}.weight"].copy_(dequantize_linear(t, algo).to(dtype))
                    algos[mod] = str(algo).upper()
                    self._input_hook(mod, algos[mod], t.get("input_scale"))
                for attr, v in t.items():
                    if f"{mod}.{attr}" in params and not (quantized and attr == "weight"):
                        params[f"{mod}.{attr}"].copy_(v.to(dtype))
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        return algos

    def _input_hook(self, mod: str, algo: str, input_scale: torch.Tensor | None) -> None:
        if input_scale is None:
            return
        s = float(input_scale)
        module = self.model.get_submodule(mod)
        if algo == "NVFP4":
            amax = s * 6.0 * 448.0  # input_scale = amax / (6 * 448)
            module.register_forward_pre_hook(lambda m, a: (fake_quant_nvfp4(a[0], amax), *a[1:]))
        elif algo in ("FP8", "W4A8_NVFP4_FP8"):  # W4A8: FP8 per-tensor inputs, input_scale = amax / 448
            module.register_forward_pre_hook(lambda m, a: (_fp8_fake_quant(a[0], s), *a[1:]))

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
