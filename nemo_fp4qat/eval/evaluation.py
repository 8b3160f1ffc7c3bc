"""Evaluation: perplexity, multiple-choice accuracy, throughput, peak memory, weight memory.

All metrics are deterministic for a given model and data: perplexity uses fixed, non-overlapping
windows from the start of the text and is token-weighted; multiple choice scores each choice by the
log-likelihood of its tokens given the input.
"""

from __future__ import annotations

import inspect
import json
import math
import resource
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..numerics.formats import format_of_quantizer

__all__ = [
    "EvalResult",
    "choice_log_likelihoods",
    "evaluate",
    "load_mc_tasks",
    "multiple_choice_accuracy",
    "multiple_choice_outcomes",
    "perplexity",
    "quantized_weight_memory",
]


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def perplexity(
    model: nn.Module,
    token_ids: torch.Tensor | Sequence[int],
    window: int = 512,
    max_windows: int | None = None,
    batch_size: int = 4,
) -> dict[str, float]:
    """Token-weighted perplexity over consecutive non-overlapping windows of ``window`` tokens.

    Each window predicts its tokens 1..window-1 from the ones before (the first token of a window
    has no context and is not scored). Returns ``ppl``, ``nll`` (mean per token), ``tokens`` scored,
    ``tokens_per_s`` of the forward passes and ``window_nll`` (each window's mean per token, in order: what a
    paired comparison of two models on the same text needs, :func:`~nemo_fp4qat.eval.paired.paired_perplexity_gap`).
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    n_win = ids.numel() // window
    if max_windows is not None:
        n_win = min(n_win, max_windows)
    if n_win == 0:
        raise ValueError(f"Need at least {window} tokens for one window, got {ids.numel()}.")
    windows = ids[: n_win * window].view(n_win, window)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll_sum, count = 0.0, 0
    per_window: list[float] = []
    t = time.perf_counter()
    for i in range(0, n_win, batch_size):
        b = windows[i : i + batch_size].to(device)
        logits = _logits(model, b)[:, :-1].float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1), reduction="none")
        per_window += nll.view(b.shape[0], -1).double().mean(1).tolist()
        nll_sum += float(nll.sum())
        count += b[:, 1:].numel()
    dt = time.perf_counter() - t
    model.train(was_training)
    mean = nll_sum / count
    return {"ppl": math.exp(mean), "nll": mean, "tokens": count, "tokens_per_s": n_win * window / dt,
            "window_nll": per_window}  # fmt: skip


def load_mc_tasks(path: str | Path) -> list[dict[str, Any]]:
    """A JSONL file of ``{"input": str, "choices": [str, ...], "answer": int | str}``."""
    tasks = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        t = json.loads(line)
        missing = {"input", "choices", "answer"} - set(t)
        if missing:
            raise ValueError(f"{path}:{i + 1}: missing fields {sorted(missing)}")
        if isinstance(t["answer"], str):
            if t["answer"] not in t["choices"]:
                raise ValueError(f"{path}:{i + 1}: answer {t['answer']!r} is not one of the choices")
            t["answer"] = t["choices"].index(t["answer"])
        tasks.append(t)
    return tasks


@torch.no_grad()
def choice_log_likelihoods(model: nn.Module, tokenizer: Any, task: dict[str, Any]) -> list[tuple[float, int]]:
    """(total log-likelihood, token count) of each choice's tokens given the task's input.

    A Hugging Face causal LM runs the input once and the choices as one batch on its key/value cache
    (the input is most of a task's tokens, so far fewer tokens run than with the input repeated per
    choice); other models score the choices as one right-padded batch of input + choice.

    A task with an empty input (BIG-bench-style sentence choice) scores its choices unconditionally, as
    lm-evaluation-harness does: from the tokenizer's start-of-text token (``bos_token_id``, else
    ``eos_token_id``), so every token of a choice is scored.

    Raises:
        ValueError: a choice has no tokens, or the input is empty and the tokenizer has no start-of-text
            (or end-of-text) token to score from.
    """
    device = next(model.parameters()).device
    ctx = tokenizer(task["input"], add_special_tokens=False)["input_ids"]
    conts = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in task["choices"]]
    if not all(conts):
        raise ValueError("every choice of a multiple-choice task needs at least one token; drop the empty choice")
    if not ctx:
        start = getattr(tokenizer, "bos_token_id", None)
        start = start if start is not None else getattr(tokenizer, "eos_token_id", None)
        if start is None:
            raise ValueError(
                "this task's input is empty, and the tokenizer has no bos_token_id or eos_token_id to score its "
                "choices from: give the task an input, or use a tokenizer with a start-of-text token"
            )
        ctx = [int(start)]
    longest = max(len(c) for c in conts)
    if _has_kv_cache(model):
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        first = model(torch.tensor([ctx], device=device), use_cache=True, **keep)  # only the last logits
        cache = first.past_key_values
        cache.batch_repeat_interleave(len(conts))
        ids = torch.zeros(len(conts), longest, dtype=torch.long, device=device)
        for i, c in enumerate(conts):
            ids[i, : len(c)] = torch.tensor(c, device=device)
        # right-padded: a causal model's scores of real tokens ignore the padding after them
        mask = torch.ones(len(conts), len(ctx) + longest, dtype=torch.long, device=device)
        rest = model(ids, past_key_values=cache, attention_mask=mask, use_cache=False).logits
        # token j of a choice is predicted by the input's last position (j = 0) or by choice token j - 1
        logits = torch.cat([first.logits[:, -1:].expand(len(conts), 1, -1), rest[:, :-1]], dim=1)
        logp = torch.log_softmax(logits.float(), dim=-1)
        return [
            (float(logp[i, torch.arange(len(c), device=device), ids[i, : len(c)]].sum()), len(c))
            for i, c in enumerate(conts)
        ]
    ids = torch.zeros(len(conts), len(ctx) + longest, dtype=torch.long, device=device)
    for i, c in enumerate(conts):
        ids[i, : len(ctx) + len(c)] = torch.tensor(ctx + c, device=device)
    logp = torch.log_softmax(_logits(model, ids)[:, :-1].float(), dim=-1)
    out = []
    for i, c in enumerate(conts):
        pos = torch.arange(len(ctx) - 1, len(ctx) - 1 + len(c), device=device)
        out.append((float(logp[i, pos, ids[i, pos + 1]].sum()), len(c)))
    return out


def _has_kv_cache(model: nn.Module) -> bool:
    """A transformers causal LM whose cache can be repeated per choice (``DynamicCache``)."""
    try:
        from transformers import PreTrainedModel
        from transformers.cache_utils import DynamicCache
    except ImportError:
        return False
    return (
        isinstance(model, PreTrainedModel)
        and getattr(model.config, "is_encoder_decoder", False) is False
        and hasattr(DynamicCache, "batch_repeat_interleave")
    )


def multiple_choice_outcomes(
    model: nn.Module, tokenizer: Any, tasks: Iterable[dict[str, Any]]
) -> list[tuple[bool, bool]]:
    """Per task, whether the choice with the highest total log-likelihood given the input is the answer,
    and whether the one with the highest per-token log-likelihood is: what a paired comparison of two
    models on the same tasks needs (:func:`nemo_fp4qat.eval.paired.paired_difference`)."""
    model.eval()
    out = []
    for t in tasks:
        ll = choice_log_likelihoods(model, tokenizer, t)
        best = max(range(len(ll)), key=lambda i: ll[i][0])
        best_norm = max(range(len(ll)), key=lambda i: ll[i][0] / ll[i][1])
        out.append((best == t["answer"], best_norm == t["answer"]))
    return out


def multiple_choice_accuracy(model: nn.Module, tokenizer: Any, tasks: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Accuracy choosing, per task, the choice with the highest total log-likelihood given the input
    (``acc``) and with the highest per-token log-likelihood (``acc_norm``)."""
    res = multiple_choice_outcomes(model, tokenizer, tasks)
    n = len(res)
    return {"acc": sum(r[0] for r in res) / max(1, n), "acc_norm": sum(r[1] for r in res) / max(1, n), "n": n}


def quantized_weight_memory(model: nn.Module, weight_formats: dict[str, str] | None = None) -> dict[str, float]:
    """Bytes of all parameters when linear weights are stored in their quantized format (scales
    included) and everything else in bf16; ``ratio_vs_bf16`` compares with an all-bf16 model.

    Formats come from ``weight_formats`` (module or fused expert projection name -> format name) for a model
    rebuilt from an export, whose weights are stored dequantized, else from the modules' weight quantizers.
    """
    from ..numerics.formats import get_format

    weight_formats = weight_formats or {}
    total_bf16 = 0.0
    total_q = 0.0
    handled: set[int] = set()
    bits_hist: dict[str, int] = {}

    def count(numel: int, fmt: Any) -> None:
        nonlocal total_bf16, total_q
        total_bf16 += numel * 2
        total_q += fmt.weight_bytes(numel) if not fmt.is_full_precision else numel * 2
        bits_hist[fmt.name] = bits_hist.get(fmt.name, 0) + numel

    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        q = getattr(m, "weight_quantizer", None)
        if isinstance(w, torch.Tensor) and (q is not None or name in weight_formats) and id(w) not in handled:
            handled.add(id(w))
            count(w.numel(), get_format(weight_formats[name]) if name in weight_formats else format_of_quantizer(q))
        # fused expert containers (transformers 5): one 3-D weight per projection, a weight quantizer per expert
        # (or, transposed, one for all of them)
        for proj in ("gate_up_proj", "up_proj", "down_proj"):
            w = m._parameters.get(proj)
            per_expert = getattr(m, f"{proj}_weight_quantizers", None)
            shared = getattr(m, f"{proj}_weight_quantizer", None)
            exported = weight_formats.get(f"{name}.{proj}")  # a model rebuilt from an export: the projection's
            if w is None or w.dim() != 3 or id(w) in handled:
                continue
            if per_expert is None and shared is None and not exported:
                continue
            handled.add(id(w))
            for i in range(w.shape[0]):
                q = per_expert[i] if per_expert is not None else shared
                count(w[i].numel(), get_format(exported) if exported else format_of_quantizer(q))
    for p in model.parameters():
        if id(p) not in handled:
            handled.add(id(p))
            total_bf16 += p.numel() * 2
            total_q += p.numel() * 2
            bits_hist["bf16"] = bits_hist.get("bf16", 0) + p.numel()
    n = sum(bits_hist.values())
    avg_bits = 8 * total_q / max(1, n)
    return {
        "bytes": total_q,
        "bytes_bf16": total_bf16,
        "ratio_vs_bf16": total_q / total_bf16,
        "bits_per_weight": avg_bits,
    }


@dataclass
class EvalResult:
    ppl: float
    nll: float
    tokens: int
    tokens_per_s: float
    peak_rss_mb: float
    weight_bytes: float
    weight_ratio_vs_bf16: float
    bits_per_weight: float
    acc: float | None = None
    acc_norm: float | None = None
    window_nll: list[float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def evaluate(
    model: nn.Module,
    token_ids: torch.Tensor,
    window: int = 512,
    max_windows: int | None = None,
    tokenizer: Any = None,
    mc_tasks: list[dict[str, Any]] | None = None,
    weight_formats: dict[str, str] | None = None,
) -> EvalResult:
    """Perplexity (+ multiple choice if given), throughput, peak memory and weight memory
    (``weight_formats``: see :func:`quantized_weight_memory`)."""
    p = perplexity(model, token_ids, window=window, max_windows=max_windows)
    mem = quantized_weight_memory(model, weight_formats)
    acc = multiple_choice_accuracy(model, tokenizer, mc_tasks) if (mc_tasks and tokenizer is not None) else {}
    if torch.cuda.is_available() and next(model.parameters()).is_cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak so far (Linux: KiB)
    return EvalResult(
        ppl=p["ppl"],
        nll=p["nll"],
        tokens=p["tokens"],
        tokens_per_s=p["tokens_per_s"],
        peak_rss_mb=peak,
        weight_bytes=mem["bytes"],
        weight_ratio_vs_bf16=mem["ratio_vs_bf16"],
        bits_per_weight=mem["bits_per_weight"],
        acc=acc.get("acc"),
        acc_norm=acc.get("acc_norm"),
        window_nll=p["window_nll"],
    )
