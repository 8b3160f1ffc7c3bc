"""YAML in, objects out: hydra ``_target_`` instantiation for policies, schedules and callbacks.

Files may name their class with ``_target_`` (what NeMo/hydra users write) or leave it out, in
which case the caller's class is used. Uses hydra's ``instantiate`` rather than a custom loader so
``${...}`` interpolation and nested ``_target_`` objects work as in any hydra config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["instantiate_yaml", "load_yaml"]


def load_yaml(path: str | Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"Config file {str(p)!r} does not exist.")
    cfg = OmegaConf.to_container(OmegaConf.load(p), resolve=True)
    if not isinstance(cfg, dict):
        raise ValueError(f"{p} must hold a mapping at the top level, got {type(cfg).__name__}.")
    return cfg


def instantiate_yaml(path: str | Path, default_target: type | None = None) -> Any:
    """Build the object a YAML file describes (hydra ``instantiate``)."""
    from hydra.utils import instantiate

    cfg = load_yaml(path)
    if "_target_" not in cfg:
        if default_target is None:
            raise ValueError(f"{path} has no _target_; add e.g. '_target_: nemo_fp4qat.LayerPolicy'.")
        cfg = {"_target_": f"{default_target.__module__}.{default_target.__qualname__}", **cfg}
    return instantiate(cfg, _convert_="all")
