"""Test-session rules.

A test marked ``twice`` also runs in the ``nemo`` environment and must say why (the marker's reason); collection
fails otherwise. With ``NEMO_FP4QAT_REQUIRE_NEMO=1`` (set by ``make test`` for the ``nemo`` environment) the session
fails if no ``@pytest.mark.nemo`` test was collected or any of them was skipped: the NeMo stack
must really be exercised there, not silently skipped. ``NEMO_FP4QAT_REQUIRE_BRIDGE=1`` does the same for
``@pytest.mark.bridge`` in the ``bridge`` environment.
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

# marker -> the variable that makes a session fail when none of its tests ran or any was skipped
_REQUIRED = {"nemo": "NEMO_FP4QAT_REQUIRE_NEMO", "bridge": "NEMO_FP4QAT_REQUIRE_BRIDGE"}
# counted from the test reports, which a pytest-xdist controller receives from its workers (it collects nothing)
_seen: dict[str, dict] = {m: {"ran": set(), "skipped": [], "passed": 0} for m in _REQUIRED}


def pytest_collection_modifyitems(config, items):
    unexplained = sorted({it.nodeid.split("::")[0] for it in items if (m := it.get_closest_marker("twice")) is not None
                          and not (m.args and isinstance(m.args[0], str) and m.args[0].strip())})  # fmt: skip
    if unexplained:
        raise pytest.UsageError(f"@pytest.mark.twice needs its reason (what the nemo env changes): {unexplained}")


def pytest_runtest_logreport(report):
    for marker, seen in _seen.items():
        if marker in report.keywords and report.when in ("setup", "call"):
            seen["ran"].add(report.nodeid)
            if report.skipped:
                seen["skipped"].append(report.nodeid)
            elif report.when == "call" and report.passed:
                seen["passed"] += 1


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: its controller checks the whole session
        return
    for marker, var in _REQUIRED.items():
        if os.environ.get(var) != "1":
            continue
        seen, problems = _seen[marker], []
        if not seen["ran"]:
            problems.append(f"no @pytest.mark.{marker} test ran")
        if seen["skipped"]:
            problems.append(f"{len(seen['skipped'])} {marker} tests were skipped: {seen['skipped'][:5]}")
        if problems:
            sys.stderr.write(f"\n{var}: " + "; ".join(problems) + "\n")
            session.exitstatus = 1
        else:
            sys.stderr.write(f"\n{var}: {seen['passed']} {marker} tests ran and passed\n")


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
