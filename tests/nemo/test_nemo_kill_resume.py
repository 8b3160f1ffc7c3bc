"""The NeMo path of the kill/resume harness: ``llm.train`` with ``NeMoFP4QATCallback``, NeMo's dist-checkpoints
and ``AutoResume``, SIGKILLed while it exports after the last step; the resumed run equals an uninterrupted one bit for
bit and no unfinished checkpoint or partial export is left (``make reliability`` runs every point)."""

from __future__ import annotations

import pytest
from kill_resume import NEMO, reference, scenario

pytestmark = [pytest.mark.nemo, pytest.mark.slow_nemo]  # the full kill/resume sweep is make reliability

SUBSET = ["export_rename:1"]  # after training: the final checkpoint must be resumable


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    pytest.importorskip("nemo.collections.llm")
    root = tmp_path_factory.mktemp("nemo_kill_resume")
    return root, reference(root, NEMO)


@pytest.mark.parametrize("point", SUBSET)
def test_killed_nemo_run_resumes_to_the_uninterrupted_result(ref, point):
    root, r = ref
    out = scenario(root, r, point)
    assert out.ok, out.problems
    assert out.kills == 1 and out.resumes >= 1
