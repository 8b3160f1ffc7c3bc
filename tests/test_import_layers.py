"""The package's floors: no module imports a folder above its own (read from the source, not by importing); no
two modules import each other, directly or round a circle (lazy imports inside functions included); and no module
imports another module's private name (what another module needs is public where it is owned).

architectures, specs, numerics, megatron_cpu -> qat -> monitor, eval -> export -> lightning -> demo -> nemo, bridge,
serve -> cli. The root ``__init__`` only re-exports; a module inside the package importing the root would pull every
floor in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "nemo_fp4qat"
LAYERS = {
    "architectures": 0,
    "specs": 0,
    "transformers_compat": 0,
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


def _from_imports(source: str, module: str, is_package: bool) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, names) for every import of the package in ``source`` (``names`` empty for
    ``import x``)."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "nemo_fp4qat"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] == "nemo_fp4qat":
                out.append((node.lineno, target, [a.name for a in node.names]))
    return out


def _imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) for every import of the package in ``source``."""
    out = []
    for line, target, names in _from_imports(source, module, is_package):
        if target == "nemo_fp4qat" and names:  # `from nemo_fp4qat import x`: x may be a folder
            out += [(line, f"nemo_fp4qat.{n}") for n in names]
        else:
            out.append((line, target))
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
    assert violations("from ...lightning.callback import FP4QATCallback\n", "nemo_fp4qat.qat.policy.rules")
    assert violations("import nemo_fp4qat.export.validate\n", "nemo_fp4qat.numerics.formats")
    assert violations("from nemo_fp4qat import LayerPolicy\n", "nemo_fp4qat.qat.config_io")
    assert violations("def f():\n    from ..demo import pipeline\n", "nemo_fp4qat.eval.tasks")  # lazy, in a function
    assert violations("from ..demo import model\n", "nemo_fp4qat.eval", is_package=True)
    assert not violations("from ...numerics.formats import get_format\n", "nemo_fp4qat.qat.policy.rules")
    assert not violations("from ..policy.rules import is_quantizer\n", "nemo_fp4qat.qat.calibration.calibrate")


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the package's modules it imports (``from .pkg import mod`` counts as importing ``pkg.mod``)."""
    graph: dict[str, set[str]] = {}
    for module, (source, is_package) in sources.items():
        edges = set()
        for _, target, names in _from_imports(source, module, is_package):
            subs = {f"{target}.{n}" for n in names if f"{target}.{n}" in sources}
            edges |= subs
            if not names or len(subs) < len(names):
                edges.add(target)
        graph[module] = {t for t in edges if t in sources and t != module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm): each is a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def private_imports(
    source: str, module: str, is_package: bool = False, modules: frozenset[str] = frozenset()
) -> list[str]:
    """``from other_module import _name`` in ``module``: a private name used outside the module that owns it (a
    private submodule of ``modules``, imported by its package's own modules, is the package's own business)."""
    return [
        f"{module}:{line} imports {name} from {target}"
        for line, target, names in _from_imports(source, module, is_package)
        if target != module
        for name in names
        if name.startswith("_") and not name.startswith("__") and f"{target}.{name}" not in modules
    ]


def _sources() -> dict[str, tuple[str, bool]]:
    return {module: (path.read_text(), is_package) for module, path, is_package in _package_modules()}


def test_no_import_circles_between_the_packages_modules():
    assert import_circles(import_graph(_sources())) == []


def test_no_module_imports_another_modules_private_name():
    sources = _sources()
    modules = frozenset(sources)
    found = [v for m, (source, is_package) in sources.items() for v in private_imports(source, m, is_package, modules)]
    assert found == []


def test_the_checkers_see_circles_and_private_names():
    sources = {
        "nemo_fp4qat.qat": ("from .a import x\n", True),
        "nemo_fp4qat.qat.a": ("def f():\n    from .b import y\n", False),  # lazy: still a circle
        "nemo_fp4qat.qat.b": ("from . import c\n", False),
        "nemo_fp4qat.qat.c": ("from nemo_fp4qat.qat.a import z\n", False),
        "nemo_fp4qat.qat.d": ("from .a import x\n", False),
    }
    assert import_circles(import_graph(sources)) == [["nemo_fp4qat.qat.a", "nemo_fp4qat.qat.b", "nemo_fp4qat.qat.c"]]
    sources["nemo_fp4qat.qat.c"] = ("import torch\n", False)
    assert import_circles(import_graph(sources)) == []
    assert private_imports("from .calibrate import _rank, sync\n", "nemo_fp4qat.qat.calibration.gptq") == [
        "nemo_fp4qat.qat.calibration.gptq:1 imports _rank from nemo_fp4qat.qat.calibration.calibrate"
    ]
    assert private_imports("from .calibration import __all__, sync\n", "nemo_fp4qat.qat.calibration.gptq") == []
    kernel = frozenset({"nemo_fp4qat.numerics._kernel"})  # a private submodule, imported by its sibling
    assert private_imports("from . import _kernel\n", "nemo_fp4qat.numerics.triton", modules=kernel) == []
