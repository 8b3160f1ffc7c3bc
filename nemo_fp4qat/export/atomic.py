"""Atomic export directories: a checkpoint directory appears complete or not at all.

Everything is written into a hidden sibling (``.NAME.partial-*``) that is renamed onto the final
path only after the last file (the manifest) is written. An interrupted export leaves at most a
``.partial`` directory, never a directory at the requested path, and an existing export that is
being replaced survives until the new one is complete; the next export to the same path removes what a
killed one left and reports it (:func:`recover_interrupted`). Hand-written because neither modelopt's
exporters nor NeMo write atomically (they write in place, file by file).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST_NAME", "atomic_directory", "file_sha256", "read_manifest", "recover_interrupted", "write_manifest"]

MANIFEST_NAME = "nemo_fp4qat_manifest.json"

log = logging.getLogger("nemo_fp4qat")


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def recover_interrupted(final: str | Path) -> list[str]:
    """Clean up after an export that was killed (SIGKILL, power loss) before it finished.

    * ``.NAME.partial-PID-*`` left by a process that is no longer alive: removed (it never became ``final``);
      a partial directory of a running process (a concurrent export) is left alone.
    * ``.NAME.old-*``: the previous export, moved aside while a replacement was renamed in. If ``final`` is
      missing the kill came between the two renames: the previous export is put back, so nothing complete
      is lost; otherwise it is removed.

    Returns one line per action, each also logged as a warning (an interrupted export is reported, not hidden).
    """
    final = Path(final)
    actions: list[str] = []
    if not final.parent.is_dir():
        return actions
    for old in sorted(final.parent.glob(f".{final.name}.old-*")):
        if not final.exists():
            os.replace(old, final)
            actions.append(f"restored the previous export {final} from {old.name} (a replacement was interrupted)")
        else:
            shutil.rmtree(old, ignore_errors=True)
            actions.append(f"removed {old} (left by an interrupted replacement)")
    for part in sorted(final.parent.glob(f".{final.name}.partial-*")):
        try:
            pid = int(part.name.rsplit(".partial-", 1)[1].split("-", 1)[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            shutil.rmtree(part, ignore_errors=True)
            actions.append(f"removed the partial export {part} (its process {pid} ended before finishing)")
    for a in actions:
        log.warning("nemo_fp4qat: %s", a)
    return actions


@contextlib.contextmanager
def atomic_directory(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a scratch directory that becomes ``final`` only if the block completes.

    Raises ``FileExistsError`` before anything is written when ``final`` exists and
    ``overwrite`` is false.
    """
    final = Path(final)
    recover_interrupted(final)
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
