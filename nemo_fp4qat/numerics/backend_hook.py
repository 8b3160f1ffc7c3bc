"""Installs the fake-quant backend (:mod:`nemo_fp4qat.numerics.cpu_backend`) as soon as modelopt's quantization
package has loaded, without importing torch or modelopt itself.

Importing ``nemo_fp4qat`` must not cost torch's and modelopt's import time (the command line's ``--help``, a
Megatron-Bridge process that never quantizes through this package), yet every modelopt quantizer must run with
the backend in place, including quantizers a user creates with modelopt directly after ``import nemo_fp4qat``.
So: if ``modelopt.torch.quantization`` is already imported, the backend is installed now; otherwise a finder on
``sys.meta_path`` installs it right after that package finishes importing (its ``__init__`` has then loaded
everything the backend patches). No library offers a post-import hook; this is the standard-library way.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

__all__ = ["install_when_modelopt_loads"]

_PACKAGE = "modelopt.torch.quantization"


def _install() -> None:
    from .cpu_backend import install_cpu_backend

    install_cpu_backend()


class _AfterModeloptQuantization(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``modelopt.torch.quantization`` to install the backend after it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _PACKAGE:
            return None
        sys.meta_path.remove(self)  # one use, and the real finders must answer without us
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module: Any) -> None:
            exec_module(module)
            _install()

        spec.loader.exec_module = exec_then_install  # type: ignore[method-assign]
        return spec


def install_when_modelopt_loads() -> None:
    """Install the backend now if modelopt's quantization package is loaded, else right after it loads
    (``NEMO_FP4QAT_CPU_BACKEND=0``: never)."""
    if os.environ.get("NEMO_FP4QAT_CPU_BACKEND", "1") == "0":
        return
    if _PACKAGE in sys.modules:
        _install()
    elif not any(isinstance(f, _AfterModeloptQuantization) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterModeloptQuantization())
