"""Where things are, for tests in any folder under tests/: the shared helpers are in ``tests/helpers/`` (on the test
session's import path, see ``tests/conftest.py``), the scripts tests launch as processes in ``tests/workers/``."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
CONF = ROOT / "conf"
HELPERS = TESTS / "helpers"
WORKERS = TESTS / "workers"


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a worker process: this one's, the helpers importable (``PYTHONPATH``), and ``extra``."""
    path = os.pathsep.join(p for p in (str(HELPERS), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
