"""Small real models for the tests: a Hugging Face Llama, a megatron-named transformer, and a
LightningModule that trains either on a learnable synthetic token stream."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from torch.utils.data import DataLoader, Dataset

VOCAB = 96


def tiny_llama(seed: int = 0, hidden: int = 64, layers: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


class _MegatronStyleLayer(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(h)
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = nn.Linear(h, 3 * h)
        self.self_attention.linear_proj = nn.Linear(h, h)
        self.pre_mlp_layernorm = nn.LayerNorm(h)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(h, 4 * h)
        self.mlp.linear_fc2 = nn.Linear(4 * h, h)
        self.h = h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.self_attention.linear_qkv(self.input_layernorm(x)).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(
            q.view(b, t, 4, h // 4).transpose(1, 2),
            k.view(b, t, 4, h // 4).transpose(1, 2),
            v.view(b, t, 4, h // 4).transpose(1, 2),
            is_causal=True,
        )
        x = x + self.self_attention.linear_proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.mlp.linear_fc2(F.gelu(self.mlp.linear_fc1(self.pre_mlp_layernorm(x))))


class MegatronStyleGPT(nn.Module):
    """Plain-torch GPT with megatron-core module names (embedding, decoder.layers, output_layer)."""

    def __init__(self, hidden: int = 64, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(VOCAB, hidden)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(_MegatronStyleLayer(hidden) for _ in range(layers))
        self.decoder.final_layernorm = nn.LayerNorm(hidden)
        self.output_layer = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding.word_embeddings(tokens)
        for layer in self.decoder.layers:
            x = layer(x)
        return self.output_layer(self.decoder.final_layernorm(x))


class PatternTokens(Dataset):
    """Token sequences from a few fixed random "phrases": learnable, so the loss falls quickly."""

    def __init__(self, n: int = 256, seq_len: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        phrases = torch.randint(0, VOCAB, (8, seq_len + 1), generator=g)
        self.data = phrases[torch.randint(0, 8, (n,), generator=g)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class LitLM(pl.LightningModule):
    """Causal LM training on token tensors; ``net`` is an HF model or MegatronStyleGPT."""

    def __init__(self, net: nn.Module, lr: float = 3e-3) -> None:
        super().__init__()
        self.net = net
        self.lr = lr
        self.losses: list[float] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.net(tokens)
        return out.logits if hasattr(out, "logits") else out

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def loader(n: int = 128, seq_len: int = 32, batch_size: int = 8, seed: int = 0) -> DataLoader:
    return DataLoader(PatternTokens(n, seq_len, seed), batch_size=batch_size, shuffle=False)


def qad_fit(model: nn.Module, policy: str, steps: int = 1, n: int = 8, calibration: int = 8):
    """``steps`` Lightning QAD steps of a Hugging Face ``model`` under ``policy`` (direct schedule) on the pattern
    tokens; returns (the callback, the LightningModule)."""
    from nemo_fp4qat import FP4QATCallback

    qat = FP4QATCallback(policy=policy, schedule="direct", calibration=calibration, distillation="qad",
                         module_getter=lambda lit: lit.net)  # fmt: skip
    lit = LitLM(model)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[qat])  # fmt: skip
    trainer.fit(lit, loader(n=n, batch_size=4, seq_len=16))
    return qat, lit


FULL = {"patterns": ["*lm_head*", "*embed*", "*norm*"], "weight": "bf16", "group": "full", "optional": True}


def calibrated_tiny_llama(policy, hidden=128, seed=0, kv_cache=None, dtype=torch.float32):
    """A tiny Llama (in ``dtype``) moved off its initialisation, quantized per ``policy`` (a format name or preset)
    and calibrated: what export tests start from."""
    from nemo_fp4qat import LayerPolicy, QATController
    from nemo_fp4qat.qat.policy.rules import POLICY_PRESETS

    model = tiny_llama(seed=seed, hidden=hidden)
    if isinstance(policy, str) and policy not in POLICY_PRESETS:
        policy = LayerPolicy(rules=[FULL], default=policy, kv_cache=kv_cache)
    elif kv_cache:
        policy = LayerPolicy.preset(policy)
        policy.kv_cache = kv_cache
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # move the weights off their initialisation: not a freshly built model
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    model = model.to(dtype)
    ctl = QATController(policy=policy, schedule="direct", calibration=4)
    ctl.prepare(model)
    ctl.calibrate(model, [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(4)])
    ctl.step(model, 0)
    return model


# transformers 5 holds every MoE's experts fused (tests/lightning/test_fused_experts.py runs that layout); the
# per-expert linears of transformers 4 run where it is installed (the nemo environment: NeMo 2.7.3's 4.57)
per_expert_linears = pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) >= 5,
    reason="transformers 5 holds experts fused; this layout runs under transformers 4 (the nemo environment)",
)


def tiny_moe(kind: str = "qwen3", seed: int = 0, hidden: int = 64, layers: int = 2, experts: int = 4) -> nn.Module:
    """A tiny Hugging Face mixture-of-experts causal LM: ``qwen3`` (Qwen3-MoE: ``mlp.gate``, ``mlp.experts.N``),
    ``mixtral`` (``block_sparse_moe.gate``, experts ``w1``/``w2``/``w3``) or ``qwen2`` (Qwen2-MoE: a shared expert
    and its gate beside the routed experts); top-2 routing, every layer sparse."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                  num_experts_per_tok=2)  # fmt: skip
    if kind == "qwen3":
        cfg = Qwen3MoeConfig(
            **common,
            intermediate_size=2 * hidden,
            moe_intermediate_size=hidden // 2,
            num_experts=experts,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            head_dim=hidden // 4,
        )
        return Qwen3MoeForCausalLM(cfg)  # fmt: skip
    if kind == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**common, intermediate_size=hidden // 2, num_local_experts=experts))
    if kind == "qwen2":
        cfg = Qwen2MoeConfig(
            **common,
            intermediate_size=2 * hidden,
            moe_intermediate_size=hidden // 2,
            shared_expert_intermediate_size=hidden,
            num_experts=experts,
            decoder_sparse_step=1,
        )
        return Qwen2MoeForCausalLM(cfg)  # fmt: skip
    raise ValueError(f"unknown tiny MoE kind {kind!r}")
