"""Atomic export directories: a checkpoint directory appears complete or not at all.

Everything is written into a hidden sibling (``.NAME.partial-*``) that is renamed onto the final
path only after the last file (the manifest) is written. An interrupted export leaves at most a
``.partial`` directory, never a directory at the requested path, and an existing export that is
being replaced survives until the new one is complete. Hand-written because neither modelopt's
exporters nor NeMo write atomically (they write in place, file by file).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST_NAME", "atomic_directory", "file_sha256", "read_manifest", "write_manifest"]

MANIFEST_NAME = "nemo_fp4qat_manifest.json"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path, info: dict[str, Any]) -> Path:
    """Record every file with its size and sha256; written last, so it marks completeness."""
    directory = Path(directory)
    files = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }
    path = directory / MANIFEST_NAME
    path.write_text(json.dumps({**info, "files": files}, indent=2))
    return path


def read_manifest(directory: Path) -> dict[str, Any] | None:
    path = Path(directory) / MANIFEST_NAME
    return json.loads(path.read_text()) if path.is_file() else None


@contextlib.contextmanager
def atomic_directory(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a scratch directory that becomes ``final`` only if the block completes.

    Raises ``FileExistsError`` before anything is written when ``final`` exists and
    ``overwrite`` is false.
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise FileExistsError(
            f"Export directory {final} already exists; choose another path or pass overwrite=True (--overwrite)."
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
