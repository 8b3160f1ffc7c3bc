"""Batched generation with a KV cache, per-row sampling, stop strings, logprobs, cancellation and
per-token callbacks (what streaming needs).

Hand-written instead of ``transformers``' ``generate``: serving needs, per row of one batch, its own
stop strings, its own cancellation (a streaming client that disconnects frees its row while the
others go on), the log-probabilities of each chosen token with the top alternatives, and a callback
after every decode step; ``generate`` offers these only for batch size 1 (streamers) or not at all.
The model is any Hugging Face causal LM (here the deployed model of an export); prompts are
left-padded, prefilled once, then decoded one token per step reusing ``past_key_values``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["GenerationRow", "SamplingParams", "TokenLogprob", "generate_batch"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int | None = None  # None: no logprobs; 0: the chosen token's only; k: and the top k


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class GenerationRow:
    """One prompt's generation as it progresses (``text`` grows; ``finish_reason`` set at the end)."""

    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"


def _sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    if p.temperature <= 0:
        return logits.argmax(-1)
    probs = F.softmax(logits.float() / p.temperature, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < p.top_p  # the smallest set whose mass reaches top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def generate_batch(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    params: Sequence[SamplingParams],
    cancelled: Sequence[threading.Event | None] | None = None,
    on_step: Callable[[list[GenerationRow]], None] | None = None,
) -> list[GenerationRow]:
    """Generate for every prompt (row ``i`` with ``params[i]``); ``on_step(rows)`` after each decode step."""
    device = next(model.parameters()).device
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True, return_token_type_ids=False).to(device)
    ids, mask = enc.input_ids, enc.attention_mask
    rows = [GenerationRow(prompt_tokens=int(m.sum())) for m in mask]
    gens = []
    for p in params:
        g = None
        if p.temperature > 0 and p.seed is not None:
            g = torch.Generator(device=device).manual_seed(p.seed)
        gens.append(g)
    eos = tokenizer.eos_token_id
    max_steps = max(p.max_tokens for p in params)
    past = None
    step_ids = ids
    with torch.no_grad():
        for _ in range(max_steps):
            positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, -step_ids.shape[1] :]
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=past,
                        use_cache=True)  # fmt: skip
            past = out.past_key_values
            logits = out.logits[:, -1, :]
            logp = F.log_softmax(logits.float(), dim=-1)
            next_ids = torch.full((len(rows),), eos if eos is not None else 0, dtype=torch.long, device=device)
            for i, (row, p) in enumerate(zip(rows, params)):
                if row.finish_reason is not None:
                    continue
                if cancelled is not None and cancelled[i] is not None and cancelled[i].is_set():
                    row.finish_reason = "cancelled"
                    continue
                tok = int(_sample(logits[i : i + 1], p, gens[i])[0])
                next_ids[i] = tok
                if eos is not None and tok == eos:
                    row.finish_reason = "stop"
                    continue
                row.token_ids.append(tok)
                if p.top_logprobs is not None:
                    top = []
                    if p.top_logprobs > 0:
                        vals, idx = logp[i].topk(p.top_logprobs)
                        top = [(tokenizer.decode([int(t)]), float(v)) for v, t in zip(vals, idx)]
                    row.logprobs.append(TokenLogprob(tokenizer.decode([tok]), float(logp[i, tok]), top))
                text = tokenizer.decode(row.token_ids, skip_special_tokens=True)
                hit = [text.index(s) for s in p.stop if s and s in text]
                if hit:
                    row.text, row.finish_reason = text[: min(hit)], "stop"
                    continue
                # hold back an incomplete multi-byte character (decoded as U+FFFD) until it completes
                row.text = text[:-1] if text.endswith("\ufffd") else text
                if len(row.token_ids) >= p.max_tokens:
                    row.text, row.finish_reason = text, "length"
            if on_step is not None:
                on_step(rows)
            if all(r.finish_reason is not None for r in rows):
                break
            step_ids = next_ids[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
    for r in rows:
        if r.finish_reason is None:
            r.finish_reason = "length"
    return rows
