"""CPU mode for Megatron / NeMo 2 training: a development aid, explicit and opt-in.

megatron-core and NeMo's Megatron path assume CUDA in a handful of places
(``torch.cuda.current_device()`` for buffers and rotary embeddings, CUDA RNG tracker forks,
``torch.cuda.Stream``, ``torch.cuda.synchronize``, ``.cuda()`` / ``device="cuda"`` tensors, config
checks that demand Transformer Engine for the kernel fusions NeMo's model configs enable). Inside
``with megatron_cpu_mode():`` those are answered with the CPU so a tiny model can be trained,
checkpointed and quantized on a laptop or in CI to smoke-test QAT configs.

It never activates when CUDA is available (the context manager is then a no-op with a warning),
and it patches only for the duration of the block. Not for production training.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..megatron_cpu import CudaToCpu, megatron_core_on_cpu, patched, torch_cuda_on_cpu

__all__ = ["cpu_mode_active", "megatron_cpu_mode"]

_ACTIVE = False


# Kernel fusions that need Transformer Engine, Apex or CUDA kernels. Turning them off changes only
# how the same math is computed, so a stock NeMo config (``LlamaConfig`` enables several) builds on a CPU.
CUDA_FUSIONS = (
    "apply_rope_fusion",
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "bias_dropout_fusion",
    "gradient_accumulation_fusion",
    "moe_permute_fusion",
)


def _fusions_off(post_init: Any) -> Any:
    def __post_init__(self: Any) -> None:
        for name in CUDA_FUSIONS:
            if getattr(self, name, False):
                setattr(self, name, False)
        post_init(self)

    return __post_init__


def _mock_dataset_with_mask(mock: Any) -> Any:
    """NeMo's ``MockDataModule`` datasets with the attention mask megatron needs without Transformer Engine.

    NeMo 2.7.3's ``MockDataModule`` passes its ``create_attention_mask`` flag positionally into the
    dataset's ``seed`` parameter, so no mask is made and NeMo's GPT step then refuses to run without TE.
    """
    orig = mock._MockGPTDataset.__init__

    def __init__(self, tokenizer, name, num_samples, seq_length, seed=42, create_attention_mask=False):
        if isinstance(seed, bool):  # the flag arrived in `seed`
            seed = 42
        orig(self, tokenizer, name, num_samples, seq_length, seed, True)

    return __init__


def cpu_mode_active() -> bool:
    return _ACTIVE


@contextlib.contextmanager
def megatron_cpu_mode() -> Iterator[bool]:
    """Run Megatron/NeMo code on the CPU inside this block. Yields whether the mode is active."""
    global _ACTIVE
    if torch.cuda.is_available():
        warnings.warn("megatron_cpu_mode() does nothing on a machine with CUDA.", stacklevel=3)
        yield False
        return
    if _ACTIVE:
        yield True
        return
    with contextlib.ExitStack() as stack:
        torch_cuda_on_cpu(stack)
        if megatron_core_on_cpu(stack):
            from megatron.core.transformer.transformer_config import TransformerConfig

            stack.enter_context(
                patched(TransformerConfig, "__post_init__", _fusions_off(TransformerConfig.__post_init__))
            )
        try:
            from nemo.lightning.io import pl as nemo_io_pl

            # NeMo's dist-checkpoint load asserts CUDA is initialised to move tensors to the current
            # GPU; on a CPU they are already where they belong.
            stack.enter_context(patched(nemo_io_pl, "_fix_tensors_device", lambda ckpt: ckpt))
            from nemo.lightning.pytorch.callbacks.progress_printer import ProgressPrinter

            # NeMo's progress printer gathers megatron's timers from every rank, but only rank 0 prints
            # (Lightning disables progress bars elsewhere): an all-gather only rank 0 enters, which
            # blocks a multi-process gloo run for good. No timer summary on CPU.
            stack.enter_context(patched(ProgressPrinter, "log_megatron_timers", lambda self, timers: None))
            from nemo.collections.llm.gpt.data import mock

            stack.enter_context(patched(mock._MockGPTDataset, "__init__", _mock_dataset_with_mask(mock)))
        except ImportError:  # NeMo not installed
            pass
        stack.enter_context(CudaToCpu())
        _ACTIVE = True
        try:
            yield True
        finally:
            _ACTIVE = False
