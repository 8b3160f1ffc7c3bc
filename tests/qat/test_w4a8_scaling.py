"""W4A8's training amax: ``6 * amax`` such that the fake quantizer's per-tensor scale ``A / (6 * 448)``
equals the exporter's ``(A / 6) / 448`` bit for bit (float32, as modelopt computes both)."""

from __future__ import annotations

import pytest
import torch

from nemo_fp4qat.qat.calibration.w4a8_scaling import training_amax

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")


def test_training_amax_makes_both_per_tensor_scales_equal_within_two_ulps():
    g = torch.Generator().manual_seed(0)
    amax = torch.rand(100_000, generator=g) * 20 + 1e-4
    plain = amax * 6.0
    assert ((plain / 2688.0) != ((plain / 6.0) / 448.0)).float().mean() > 0.1  # the mismatch is common
    held = training_amax(plain)
    assert torch.equal(held / 2688.0, (held / 6.0) / 448.0)
    ulps = held.view(torch.int32) - plain.view(torch.int32)
    assert int(ulps.min()) >= 0 and int(ulps.max()) <= 2
    agree = (plain / 2688.0) == ((plain / 6.0) / 448.0)
    assert torch.equal(held[agree], plain[agree])  # values that already agree are kept
