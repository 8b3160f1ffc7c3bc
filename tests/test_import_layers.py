"""The package's floors: no module imports a folder above its own (read from the source, not by importing).

numerics, megatron_cpu -> qat -> monitor, eval -> export -> lightning -> demo -> nemo, bridge, serve -> cli. The root
``__init__`` only re-exports; a module inside the package importing the root would pull every floor in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "nemo_fp4qat"
LAYERS = {
    "specs": 0,
    "numerics": 0,
    "megatron_cpu": 0,
    "qat": 1,
    "monitor": 2,
    "eval": 2,
    "export": 3,
    "lightning": 4,
    "demo": 5,
    "nemo": 6,
    "bridge": 6,
    "serve": 6,
    "cli": 7,
}


def _folder(module: str) -> str | None:
    """Top folder of a dotted module inside the package (``None`` for the package root itself)."""
    parts = module.split(".")
    assert parts[0] == "nemo_fp4qat", module
    return parts[1] if len(parts) > 1 else None


def _imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) for every import of the package in ``source``."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "nemo_fp4qat"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != "nemo_fp4qat":
                continue
            if target == "nemo_fp4qat":  # `from nemo_fp4qat import x`: x may be a folder
                out += [(node.lineno, f"nemo_fp4qat.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, target))
    return out


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Imports in ``module``'s source that go to a higher floor (or to the package root)."""
    own = _folder(module)
    if own is None:
        return []  # the root __init__ re-exports the public API
    bad = []
    for line, target in _imports(source, module, is_package):
        folder = _folder(target)
        if folder is None or (folder not in LAYERS and folder != own):
            bad.append(f"{module}:{line} imports {target} (the package root pulls in every floor)")
        elif folder != own and LAYERS[folder] > LAYERS[own]:
            bad.append(f"{module}:{line} imports {target}: {folder} is above {own}")
    return bad


def _package_modules() -> list[tuple[str, Path, bool]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out.append((".".join(parts), path, is_package))
    return out


def test_every_folder_has_a_floor():
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    assert folders | modules == set(LAYERS), "a new folder needs its floor in LAYERS (and in docs/architecture.md)"


@pytest.mark.parametrize("module,path,is_package", _package_modules(), ids=lambda v: v if isinstance(v, str) else "")
def test_no_import_runs_up_the_floors(module, path, is_package):
    assert violations(path.read_text(), module, is_package) == []


def test_the_checker_sees_upward_imports():
    """The rule itself: a relative, an absolute and a root import upward are each caught."""
    assert violations("from ..lightning.callback import FP4QATCallback\n", "nemo_fp4qat.qat.policy")
    assert violations("import nemo_fp4qat.export.validate\n", "nemo_fp4qat.numerics.formats")
    assert violations("from nemo_fp4qat import LayerPolicy\n", "nemo_fp4qat.qat.config_io")
    assert violations("def f():\n    from ..demo import pipeline\n", "nemo_fp4qat.eval.tasks")  # lazy, in a function
    assert violations("from ..demo import model\n", "nemo_fp4qat.eval", is_package=True)
    assert not violations("from ..numerics.formats import get_format\n", "nemo_fp4qat.qat.policy")
    assert not violations("from .policy import is_quantizer\n", "nemo_fp4qat.qat.calibration")
