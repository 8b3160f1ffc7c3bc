"""An offline rotation of a Llama model's residual stream (QuaRot / SpinQuant's merged rotation ``R1``), for
measuring it as a deployable lever (#17) in ``bench_levers.py``.

The residual stream ``h`` becomes ``h @ Q`` for an orthogonal ``Q``: the embedding rows are rotated, every
RMSNorm's gamma is folded into the linears that read the norm (RMSNorm commutes with an orthogonal ``Q`` only
with unit gamma), the readers' input columns are rotated (``W @ Q``), the writers' output rows (``o_proj``,
``down_proj``: ``Q.T @ W``), and ``lm_head`` (untied from the embedding: the final norm's gamma folds into it
alone) reads the rotated stream. The full-precision function is unchanged (``check`` measures it); only the
values the quantizers see move: a Hadamard ``Q`` spreads each channel's outliers over the channels it mixes.

``Q`` is block-diagonal: Sylvester Hadamard blocks of ``block`` channels (16 = one NVFP4 block, so each block's
values are mixed among themselves only; 64 mixes four). Plain model code: the exported checkpoint is a normal
Llama with untied embeddings (``tie_word_embeddings`` false), which costs one more vocab x hidden matrix
(SmolLM2-135M: 28 M parameters, +21%). Benchmark code, not a product option: on the demo model it made NVFP4
PTQ much worse than none at both block sizes measured (``results/levers.md``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn


def block_hadamard(dim: int, block: int) -> torch.Tensor:
    """Orthogonal ``dim x dim`` float64 matrix: ``dim / block`` normalized Sylvester Hadamard blocks."""
    from scipy.linalg import hadamard

    if dim % block:
        raise ValueError(f"hidden size {dim} is not a multiple of the Hadamard block {block}")
    h = torch.from_numpy(hadamard(block)).double() / block**0.5
    return torch.block_diag(*[h] * (dim // block))


@torch.no_grad()
def rotate_residual_stream(model: Any, block: int) -> Any:
    """A rotated copy of a Hugging Face Llama-family ``model`` (the original is left as it was)."""
    m = copy.deepcopy(model)
    inner = m.model
    q = block_hadamard(m.config.hidden_size, block)

    def fold_norm_into(norm: nn.Module, readers: list[nn.Linear]) -> None:
        g = norm.weight.double()
        for lin in readers:
            lin.weight.copy_(((lin.weight.double() * g) @ q).to(lin.weight.dtype))
        norm.weight.fill_(1.0)

    def rotate_writer(lin: nn.Linear) -> None:
        lin.weight.copy_((q.T @ lin.weight.double()).to(lin.weight.dtype))
        if lin.bias is not None:
            lin.bias.copy_((lin.bias.double() @ q).to(lin.bias.dtype))

    emb = inner.embed_tokens.weight
    if m.lm_head.weight.data_ptr() == emb.data_ptr():  # tied: untie, the final gamma folds into lm_head alone
        m.lm_head.weight = nn.Parameter(emb.detach().clone())
    m.config.tie_word_embeddings = False
    emb.copy_((emb.double() @ q).to(emb.dtype))
    for layer in inner.layers:
        att, mlp = layer.self_attn, layer.mlp
        fold_norm_into(layer.input_layernorm, [att.q_proj, att.k_proj, att.v_proj])
        rotate_writer(att.o_proj)
        fold_norm_into(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj])
        rotate_writer(mlp.down_proj)
    fold_norm_into(inner.norm, [m.lm_head])
    return m


@torch.no_grad()
def check(original: nn.Module, rotated: nn.Module, batch: torch.Tensor) -> float:
    """Largest relative difference of the two models' logits on ``batch`` (float32 rounding only: ~1e-5)."""
    a, b = original(batch).logits, rotated(batch).logits
    return float((a - b).abs().max() / a.abs().max())
