"""Paired comparison of two models scored on the same multiple-choice tasks.

Rows of an accuracy table are scored on the same tasks, and most tasks are answered alike by both
models (both right or both wrong): only the tasks where they disagree carry the difference. The
independent standard errors of two accuracies (``sqrt(p (1 - p) / n)`` each, ~0.05 at 100 tasks)
overstate the uncertainty of their difference, so rows a table claims apart are compared per task:
the mean of the per-task differences with its standard error, and McNemar's exact test on the
disagreeing tasks (scipy's binomial test: under "no difference" each disagreement is a fair coin).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

__all__ = ["PairedDifference", "paired_difference"]


@dataclass(frozen=True)
class PairedDifference:
    """``a`` minus ``b`` on the same ``n`` tasks.

    Attributes:
        n: tasks compared.
        acc_a, acc_b: the two accuracies.
        diff: ``acc_a - acc_b``.
        se: standard error of ``diff`` from the per-task differences (paired).
        only_a, only_b: tasks only ``a`` / only ``b`` answered correctly (the discordant pairs).
        p_value: McNemar's exact two-sided p-value (1.0 when they never disagree).
    """

    n: int
    acc_a: float
    acc_b: float
    diff: float
    se: float
    only_a: int
    only_b: int
    p_value: float

    def separated(self, alpha: float = 0.05) -> bool:
        """Whether the two rows differ at significance ``alpha``."""
        return self.p_value < alpha

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def paired_difference(a: Sequence[bool | int], b: Sequence[bool | int]) -> PairedDifference:
    """Compare per-task correctness ``a`` and ``b`` (same tasks, same order)."""
    if len(a) != len(b):
        raise ValueError(f"paired comparison needs the same tasks: got {len(a)} and {len(b)} outcomes")
    if not a:
        raise ValueError("paired comparison needs at least one task")
    from scipy.stats import binomtest  # lazy: only the evaluation path needs scipy

    n = len(a)
    d = [int(bool(x)) - int(bool(y)) for x, y in zip(a, b, strict=True)]
    only_a, only_b = d.count(1), d.count(-1)
    mean = (only_a - only_b) / n
    var = (sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else 0.0
    disc = only_a + only_b
    p = binomtest(only_a, disc, 0.5).pvalue if disc else 1.0
    return PairedDifference(
        n=n,
        acc_a=sum(map(bool, a)) / n,
        acc_b=sum(map(bool, b)) / n,
        diff=mean,
        se=math.sqrt(var / n),
        only_a=only_a,
        only_b=only_b,
        p_value=float(p),
    )
