"""Test-session rules.

With ``NEMO_FP4QAT_REQUIRE_NEMO=1`` (set by ``make test`` for the ``nemo`` environment) the session
fails if no ``@pytest.mark.nemo`` test was collected or any of them was skipped: the NeMo stack
must really be exercised there, not silently skipped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("repo", suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
settings.load_profile("repo")

sys.path.insert(0, str(Path(__file__).parent / "helpers"))  # the shared helpers (tests/helpers/)

# Triton kernels run on CPU tensors in triton's interpreter; triton reads this when it is imported (its own
# library functions are decorated then), so it is set before any test imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")

_nemo = {"collected": 0, "skipped": [], "passed": 0}


def pytest_collection_modifyitems(config, items):
    _nemo["collected"] = sum(1 for it in items if it.get_closest_marker("nemo"))


def pytest_runtest_logreport(report):
    if "nemo" in report.keywords and report.when in ("setup", "call"):
        if report.skipped:
            _nemo["skipped"].append(report.nodeid)
        elif report.when == "call" and report.passed:
            _nemo["passed"] += 1


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("NEMO_FP4QAT_REQUIRE_NEMO") != "1":
        return
    problems = []
    if _nemo["collected"] == 0:
        problems.append("no @pytest.mark.nemo test was collected")
    if _nemo["skipped"]:
        problems.append(f"{len(_nemo['skipped'])} nemo tests were skipped: {_nemo['skipped'][:5]}")
    if problems:
        sys.stderr.write("\nNEMO_FP4QAT_REQUIRE_NEMO: " + "; ".join(problems) + "\n")
        session.exitstatus = 1
    else:
        sys.stderr.write(f"\nNEMO_FP4QAT_REQUIRE_NEMO: {_nemo['passed']} nemo tests ran and passed\n")


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
