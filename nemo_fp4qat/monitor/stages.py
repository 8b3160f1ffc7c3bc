"""Monitoring a pipeline-parallel run: every stage measures the layers it holds, so findings and measurements are
exchanged between the stages (a collective over every rank; torch.distributed is imported when called).

A stage's finding is acted on by every rank at the end of the step, once per layer group (a group found on
several stages is rolled back one stage, not one per stage); the report on global rank 0 gathers every stage's
layers.
"""

from __future__ import annotations

from typing import Any

from .findings import Finding, add_finding

__all__ = ["exchange_findings", "merge_stage_records"]


def exchange_findings(
    pending: list[tuple[dict[str, Any], str | None]], findings: list[Finding], action: str
) -> tuple[list[str], bool]:
    """Every rank's findings of this step (``(asdict(finding), layer group)``) added to ``findings`` on every rank.

    Returns the layer groups found (sorted, each once) and whether any rank found anything.
    """
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pending)
    groups: set[str] = set()
    found = False
    for fd, group in (item for items in everyone for item in items):
        add_finding(findings, fd["step"], fd["layer"], fd["problem"], fd["metric"], fd["value"], fd["threshold"],
                    action)  # fmt: skip
        found = True
        if group is not None:
            groups.add(group)
    return sorted(groups), found


def merge_stage_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every stage's measurements merged (same steps on every stage): one record per step with every layer."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, records)
    merged: dict[tuple[int, bool], dict[str, Any]] = {}
    for stage_records in everyone:
        for r in stage_records:
            into = merged.setdefault((r["step"], r["final"]), {**r, "layers": {}})
            into["layers"].update(r["layers"])
            into["seconds"] = max(into["seconds"], r["seconds"])
    return sorted(merged.values(), key=lambda r: (r["step"], r["final"]))
