"""``QATAutoResume``: NeMo's ``AutoResume``, plus a resume when the only ``-last`` checkpoint is unfinished.

NeMo's ``ModelCheckpoint`` marks each checkpoint unfinished until it is complete, and ``AutoResume`` resumes
only from a finished ``*-last`` one. A run killed while it writes its *first* ``-last`` checkpoint (the only
one, so far) therefore stops with ``ValueError: Last checkpoint is unfinished ... Please remove the checkpoint
manually``, although a finished step checkpoint (saved just before it, ``save_top_k``) is on disk. Here that case
resumes from the newest finished checkpoint instead (the same rule NeMo uses between several ``-last`` ones:
the latest modified). The unfinished one is left for NeMo's ``ModelCheckpoint.setup`` to delete, on rank 0
with a barrier, as it does at every start. Every other case is NeMo's own behaviour.
"""

from __future__ import annotations

from pathlib import Path

from nemo.lightning import AutoResume
from nemo.lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint

__all__ = ["QATAutoResume"]


class QATAutoResume(AutoResume):
    """Drop-in for ``nl.AutoResume`` (same arguments) that survives a kill during the first checkpoint."""

    def _checkpoint_dir(self) -> Path | None:
        if self.resume_from_directory:
            return Path(self.resume_from_directory)
        from nemo.utils.app_state import AppState

        log_dir = AppState().log_dir
        return Path(log_dir) / "checkpoints" if log_dir is not None else None

    def _find_trainer_ckpt_path(self) -> Path | None:
        directory = self._checkpoint_dir()
        if directory is not None and directory.is_dir():
            dirs = [d for d in directory.iterdir() if d.is_dir()]
            lasts = [d for d in dirs if d.match("*last")]
            finished = [d for d in dirs if not ModelCheckpoint.is_checkpoint_unfinished(d)]
            if lasts and not any(d in finished for d in lasts) and not any(d.match("*end") for d in dirs):
                if finished:
                    newest = max(finished, key=lambda d: d.lstat().st_mtime)
                    from nemo.utils import logging

                    logging.warning(
                        f"nemo_fp4qat: the only -last checkpoint in {directory} is unfinished (the run was killed "
                        f"while writing it); resuming from the newest finished one, {newest.name}"
                    )
                    return newest
        return super()._find_trainer_ckpt_path()
