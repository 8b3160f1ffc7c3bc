"""SIGKILL during calibration, at a switch, mid-checkpoint and mid-export; the resumed run equals an
uninterrupted one bit for bit (a representative subset: ``make reliability`` runs every point)."""

from __future__ import annotations

import pytest
from kill_resume import reference, scenario

# core environment only: the Lightning kill/resume subset; make reliability runs every point on both paths

SUBSET = ["calib:2", "ckpt:5", "export_manifest:1", "random:0"]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill_resume")
    return root, reference(root)


@pytest.mark.parametrize("point", SUBSET)
def test_killed_run_resumes_to_the_uninterrupted_result(ref, point):
    root, r = ref
    out = scenario(root, r, point)
    assert out.ok, out.problems
    assert out.resumes >= 1 or point.startswith("random")
