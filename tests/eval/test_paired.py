"""The paired comparison of two rows on the same multiple-choice tasks, against a float64 reference written
from the definitions (McNemar's exact test as a binomial tail summed term by term; the paired standard error
as the sample standard deviation of the per-task differences over sqrt(n))."""

from __future__ import annotations

import math
import random

import pytest

from nemo_fp4qat.eval.paired import paired_difference, paired_perplexity_gap

# core environment only: evaluation reads models through the plugin's own code, tested once


def _mcnemar_exact(only_a: int, only_b: int) -> float:
    m, k = only_a + only_b, min(only_a, only_b)
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2.0**m
    return min(1.0, 2.0 * tail)


@pytest.mark.parametrize("seed", range(6))
def test_paired_difference_matches_the_definitions_on_random_outcomes(seed):
    rng = random.Random(seed)
    n = rng.randint(20, 400)
    pa, pb = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8)
    a = [rng.random() < pa for _ in range(n)]
    b = [x if rng.random() < 0.6 else rng.random() < pb for x in a]  # correlated, as two models on one task set
    r = paired_difference(a, b)
    d = [int(x) - int(y) for x, y in zip(a, b)]
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    assert r.n == n and r.acc_a == sum(a) / n and r.acc_b == sum(b) / n
    assert r.diff == pytest.approx(r.acc_a - r.acc_b, abs=1e-12) and r.diff == pytest.approx(mean, abs=1e-12)
    assert r.se == pytest.approx(sd / math.sqrt(n), rel=1e-9)
    assert (r.only_a, r.only_b) == (d.count(1), d.count(-1))
    assert r.p_value == pytest.approx(_mcnemar_exact(r.only_a, r.only_b), rel=1e-9)
    # symmetric: swapping the rows flips the sign, keeps the evidence
    s = paired_difference(b, a)
    assert s.diff == pytest.approx(-r.diff) and s.p_value == pytest.approx(r.p_value) and s.se == pytest.approx(r.se)


def test_a_consistent_small_advantage_is_separated_where_independent_errors_are_not():
    """120 of 1000 tasks differ, 80 for a: 4 points apart. Independent standard errors (~0.016 each) put the
    rows within 2 of them; the paired test separates them."""
    a = [True] * 500 + [True] * 80 + [False] * 40 + [False] * 380
    b = [True] * 500 + [False] * 80 + [True] * 40 + [False] * 380
    r = paired_difference(a, b)
    assert r.diff == pytest.approx(0.04)
    indep = math.sqrt(r.acc_a * (1 - r.acc_a) / r.n + r.acc_b * (1 - r.acc_b) / r.n)
    assert r.diff < 2 * indep  # not apart by independent errors
    assert r.separated() and r.p_value < 0.001
    assert not paired_difference(a, a).separated() and paired_difference(a, a).p_value == 1.0


def test_small_samples_and_the_record():
    one = paired_difference([True], [False])
    assert (one.diff, one.se, one.only_a, one.only_b) == (1.0, 0.0, 1, 0) and one.p_value == 1.0
    two = paired_difference([True, False], [False, False])  # d = [1, 0]: sd 0.7071, se 0.5
    assert two.se == pytest.approx(0.5) and two.diff == 0.5
    r = paired_difference([True, True, False], [False, True, True])
    assert r.as_dict() == {"n": 3, "acc_a": 2 / 3, "acc_b": 2 / 3, "diff": 0.0, "se": r.se, "only_a": 1, "only_b": 1,
                           "p_value": 1.0}  # fmt: skip
    # apart means strictly below the level
    assert not r.separated(alpha=r.p_value) and r.separated(alpha=1.5)


def test_paired_difference_refuses_unpaired_outcomes():
    with pytest.raises(ValueError) as e:
        paired_difference([True, False, True], [True, False])
    assert str(e.value) == "paired comparison needs the same tasks: got 3 and 2 outcomes"
    with pytest.raises(ValueError) as e:
        paired_difference([], [])
    assert str(e.value) == "paired comparison needs at least one task"


def test_paired_perplexity_gap_is_the_perplexity_ratio_with_scipys_t_interval():
    """Two models' perplexities on the same windows: the gap is exactly ppl_a / ppl_b - 1 (``perplexity``'s own
    figures) and the interval is scipy's t interval of the per-window differences, mapped through exp."""
    import numpy as np
    import torch
    from scipy import stats

    from nemo_fp4qat.eval.evaluation import perplexity

    from tiny_models import VOCAB, tiny_llama

    ids = torch.randint(0, VOCAB, (10 * 32,), generator=torch.Generator().manual_seed(0))
    a, b = perplexity(tiny_llama(seed=1), ids, window=32), perplexity(tiny_llama(seed=2), ids, window=32)
    assert len(a["window_nll"]) == 10 and math.exp(sum(a["window_nll"]) / 10) == pytest.approx(a["ppl"], rel=1e-6)
    g = paired_perplexity_gap(a["window_nll"], b["window_nll"])
    assert g.gap == pytest.approx(a["ppl"] / b["ppl"] - 1, rel=1e-4)  # float32 sums vs float64 means
    d = np.array(a["window_nll"]) - np.array(b["window_nll"])
    lo, hi = stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
    assert (g.low, g.high) == pytest.approx((math.expm1(lo), math.expm1(hi)), rel=1e-9)
    with pytest.raises(ValueError, match="same windows"):
        paired_perplexity_gap([1.0, 2.0], [1.0])
