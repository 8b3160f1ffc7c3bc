"""Calibration batches: collected from a dataloader (kept on the CPU), moved to the model's device and run
without gradients; every calibration-time pass (modelopt's calibration, the statistics of smoothing and of
the block scale search) goes through :func:`forward_batches`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["collect_batches", "default_forward", "forward_batches"]


def _batch_rows(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        for v in batch.values():
            if isinstance(v, torch.Tensor) and v.dim():
                return int(v.shape[0])
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_rows(batch[0])
    return 1


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: _map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_tensors(v, fn) for v in batch)
    return batch


def _take_rows(batch: Any, n: int) -> Any:
    return _map_tensors(batch, lambda t: t[:n] if t.dim() else t)


def collect_batches(batches: Iterable[Any], num_samples: int, seq_len: int | None = None) -> list[Any]:
    """Take batches until ``num_samples`` rows are collected; keep them on the CPU."""
    out: list[Any] = []
    seen = 0
    for batch in batches:
        need = num_samples - seen
        rows = _batch_rows(batch)
        if rows > need:
            batch = _take_rows(batch, need)
            rows = need
        if seq_len is not None:
            batch = _map_tensors(batch, lambda t: t[:, :seq_len] if t.dim() >= 2 else t)
        out.append(_map_tensors(batch, lambda t: t.detach().to("cpu")))
        seen += rows
        if seen >= num_samples:  # stop here, not at the next batch: a dataloader pull can cost a whole batch's I/O
            break
    if not out:
        raise ValueError("Calibration data is empty: the dataloader yielded no batch.")
    return out


def default_forward(model: nn.Module, batch: Any) -> Any:
    """Forward one batch: ``model(**batch)`` for dicts (Hugging Face), ``model(batch[0])`` for
    (inputs, targets) pairs, ``model(batch)`` for a tensor."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(batch[0])
    return model(batch)


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def forward_batches(model: nn.Module, batches: Iterable[Any], forward_fn: Callable[[nn.Module, Any], Any]) -> None:
    """``forward_fn`` over ``batches``, each moved to the model's device, without gradients: every
    calibration-time pass (modelopt's calibration, the statistics of smoothing and of the block scale search)."""
    device = _device_of(model)
    with torch.no_grad():
        for b in batches:
            forward_fn(model, _map_tensors(b, lambda t: t.to(device)))
