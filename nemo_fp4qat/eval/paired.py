"""Paired comparison of two models scored on the same multiple-choice tasks.

Rows of an accuracy table are scored on the same tasks, and most tasks are answered alike by both
models (both right or both wrong): only the tasks where they disagree carry the difference. The
independent standard errors of two accuracies (``sqrt(p (1 - p) / n)`` each, ~0.05 at 100 tasks)
overstate the uncertainty of their difference, so rows a table claims apart are compared per task:
the mean of the per-task differences with its standard error, and McNemar's exact test on the
disagreeing tasks (scipy's binomial test: under "no difference" each disagreement is a fair coin).

Perplexities on the same text are compared the same way, window by window: with every window scoring the same
number of tokens, ``ppl_a / ppl_b = exp(mean_i(nll_a_i - nll_b_i))``, so the per-window differences of mean
negative log-likelihood give the ratio and a t interval for it (:func:`paired_perplexity_gap`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

__all__ = ["PairedDifference", "PairedGap", "paired_difference", "paired_perplexity_gap"]


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


@dataclass(frozen=True)
class PairedGap:
    """Perplexity ``a`` over perplexity ``b`` minus 1, on the same ``n`` windows of text.

    Attributes:
        n: windows compared.
        gap: ``ppl_a / ppl_b - 1``.
        low, high: the two-sided t interval of ``gap`` at ``confidence`` (from the per-window differences).
        confidence: the interval's level.
    """

    n: int
    gap: float
    low: float
    high: float
    confidence: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def paired_perplexity_gap(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> PairedGap:
    """Compare per-window mean negative log-likelihoods ``a`` and ``b`` (same windows, same order, each window the
    same number of tokens; :func:`~nemo_fp4qat.eval.evaluation.perplexity`'s ``window_nll``)."""
    if len(a) != len(b):
        raise ValueError(f"paired perplexity needs the same windows: got {len(a)} and {len(b)}")
    if len(a) < 2:
        raise ValueError("paired perplexity needs at least two windows for an interval")
    from scipy.stats import t as student_t  # lazy: only the evaluation path needs scipy

    n = len(a)
    d = [x - y for x, y in zip(a, b, strict=True)]
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
    half = float(student_t.ppf(0.5 + confidence / 2, n - 1)) * se
    return PairedGap(n=n, gap=math.expm1(mean), low=math.expm1(mean - half), high=math.expm1(mean + half),
                     confidence=confidence)  # fmt: skip
