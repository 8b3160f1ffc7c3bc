"""Import fixes Megatron-Bridge 0.6.2 needs where Transformer Engine is absent or nvidia-resiliency-ext is old.

Installed by ``import nemo_fp4qat.bridge`` (before anything imports ``megatron.core`` or ``megatron.bridge``);
each fix does nothing where the condition it answers does not hold:

* ``megatron/bridge/peft/lora_layers.py`` imports ``transformer_engine.pytorch`` unguarded, for annotations
  and ``isinstance`` checks only. Where Transformer Engine is not installed, a stub is visible to that one
  module while its body runs: megatron-core reads a successful ``import transformer_engine`` as "TE present",
  so nothing else may see it.
* nvidia-resiliency-ext 0.4.1 (the newest on PyPI) has no ``__version__``, and megatron-core's checkpointing
  reads it at import (then asserts >= 0.6.0 for its async-save support), so ``import megatron.core`` fails and
  with it modelopt's megatron plugin (megatron-core's parallel linears would get no quantizers). The version is
  set from the package metadata and, below 0.6, the one async-checkpoint module megatron-core probes is hidden:
  checkpoints save synchronously; Bridge still gets the package's in-process restart wrapper.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from typing import Any

__all__ = ["install_import_fixes"]

_LORA = "megatron.bridge.peft.lora_layers"
# lora_layers' own imports, loaded before the stub appears so that none of them sees it
_LORA_DEPS = ("megatron.core.transformer.moe.moe_utils", "megatron.bridge.peft.adapter_wrapper",
              "megatron.bridge.peft.lora_merge")  # fmt: skip
_NVRX_ASYNC = "nvidia_resiliency_ext.checkpointing.async_ckpt.cached_metadata_filesystem_reader"


def _te_stub() -> dict[str, types.ModuleType]:
    te, tp, ops = (types.ModuleType(n) for n in ("transformer_engine", "transformer_engine.pytorch",
                                                  "transformer_engine.pytorch.ops"))  # fmt: skip
    te.__path__, tp.__path__ = [], []  # type: ignore[attr-defined]

    class _Absent:
        def __init__(self, *_: Any, **__: Any) -> None:
            raise RuntimeError("Transformer Engine is not installed")

    for name in ("Sequential", "Linear", "BasicLinear", "AddExtraInput", "MakeExtraOutput", "Identity"):
        setattr(ops, name, type(name, (_Absent,), {}))
    for name in ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "LayerNorm", "RMSNorm"):
        setattr(tp, name, type(name, (_Absent,), {}))
    tp.ops, te.pytorch = ops, tp  # type: ignore[attr-defined]
    return {m.__name__: m for m in (te, tp, ops)}


class _StubbedLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        for dep in _LORA_DEPS:
            importlib.import_module(dep)
        stub = _te_stub()
        saved = {k: sys.modules.get(k) for k in stub}
        sys.modules.update(stub)
        try:
            self.inner.exec_module(module)
        finally:
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v


class _ImportFixes(importlib.abc.MetaPathFinder):
    """Serves lora_layers with the scoped TE stub, and hides nvrx < 0.6's async-checkpoint module."""

    hide_nvrx_async = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname == _NVRX_ASYNC and self.hide_nvrx_async:
            raise ImportError(f"{fullname}: nvidia-resiliency-ext < 0.6.0 (nemo_fp4qat.bridge hides it)")
        if fullname != _LORA or importlib.util.find_spec("transformer_engine") is not None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                spec.loader = _StubbedLoader(spec.loader)
                return spec
        return None


def install_import_fixes() -> None:
    if not any(isinstance(f, _ImportFixes) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportFixes())
    try:
        import nvidia_resiliency_ext as nvrx
    except ImportError:
        return
    if not hasattr(nvrx, "__version__"):
        from importlib.metadata import PackageNotFoundError, version

        try:
            nvrx.__version__ = version("nvidia-resiliency-ext")
        except PackageNotFoundError:
            nvrx.__version__ = "0.0.0"
    major, minor = (int(x) for x in nvrx.__version__.split(".")[:2])
    _ImportFixes.hide_nvrx_async = (major, minor) < (0, 6)
