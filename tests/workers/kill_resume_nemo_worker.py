"""One training process of the kill/resume harness (:mod:`kill_resume`), NeMo path.

``python kill_resume_nemo_worker.py RUN_DIR [EVENT:N]``

The way a NeMo user trains: ``llm.train`` with a tiny ``llm.GPTModel`` on ``nl.Trainer`` +
``MegatronStrategy`` (CPU mode), ``NeMoFP4QATCallback`` (three precision switches, the switch to NVFP4
recalibrating), NeMo's own ``ModelCheckpoint`` (dist-checkpoints every 2 steps plus ``-last``, each marked
unfinished until complete) behind ``NeMoLogger``, ``QATAutoResume(resume_if_exists=True)`` (NeMo's
``AutoResume``, plus a resume when the first ``-last`` checkpoint was torn), and a TensorRT-LLM
checkpoint exported at the end of fit. With ``EVENT:N`` the process SIGKILLs itself at the N-th occurrence
of EVENT in this process:

* ``calib``, ``switch``, ``step``: as in the Lightning worker;
* ``ckpt_torn``: right after the N-th dist-checkpoint's files are written, with its largest file cut in
  half (the unfinished marker still on disk, as when a process dies mid-write);
* ``ckpt_marker``: the N-th checkpoint complete on disk but its unfinished marker not yet removed;
* ``export_weights``, ``export_manifest``, ``export_rename``: the stages of the export.

Writes what the harness compares: ``losses.jsonl`` and, at a clean end, ``final.json`` (sha256 of every
tensor of the megatron module's state, formats, switch history), as the Lightning worker does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).parent

import lightning.pytorch as pl  # noqa: E402
from kill_resume_worker import KillSwitch, install_export_kill_points, state_digest  # noqa: E402

STEPS = 8
SCHEDULE = {
    "stages": [
        {"start": 0, "format": "fp8"},
        {"start": 2, "format": "mxfp8"},
        {"start": 4, "format": "fp6"},
        {"start": 6, "format": "target"},
    ]
}


def _install_nemo_kill_points(ks: KillSwitch, callback) -> None:
    import modelopt.torch.export.model_config_export as trtllm_export
    from nemo.lightning.ckpt_utils import ckpt_to_dir
    from nemo.lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint
    from nemo.lightning.pytorch.strategies.megatron_strategy import MegatronStrategy

    install_export_kill_points(ks, callback, [(trtllm_export, "save_file")])
    save = MegatronStrategy.save_checkpoint

    def save_then_maybe_tear(self, checkpoint, filepath, storage_options=None):
        save(self, checkpoint, filepath, storage_options=storage_options)
        if ks.hit("ckpt_torn"):
            files = [p for p in ckpt_to_dir(filepath).rglob("*") if p.is_file()]
            biggest = max(files, key=lambda p: p.stat().st_size)
            os.truncate(biggest, biggest.stat().st_size // 2)
            ks.die()

    MegatronStrategy.save_checkpoint = save_then_maybe_tear
    remove_marker = ModelCheckpoint.remove_checkpoint_unfinished_marker

    def marker_kept_if_killed(checkpoint_path, barrier_before=False):
        ks.here("ckpt_marker")
        return remove_marker(checkpoint_path, barrier_before=barrier_before)

    ModelCheckpoint.remove_checkpoint_unfinished_marker = staticmethod(marker_kept_if_killed)


class Record(pl.Callback):
    """Appends each step's loss to ``losses.jsonl``; dies at ``step:N``. Holds no open file and lives at module
    level: NeMo serializes the trainer's callbacks into each checkpoint's and the export's context."""

    def __init__(self, run: Path, ks: KillSwitch) -> None:
        self.run, self.ks = run, ks

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = float(trainer.callback_metrics["reduced_train_loss"])
        with (self.run / "losses.jsonl").open("a") as f:
            f.write(json.dumps({"step": trainer.global_step, "loss": loss, "pid": os.getpid()}) + "\n")
        if self.ks.event == "step" and trainer.global_step == self.ks.at:  # by global step, not per process
            self.ks.die()


def main(run_dir: str, spec: str | None) -> None:
    from nemo_fp4qat.nemo import NeMoFP4QATCallback, QATAutoResume, megatron_cpu_mode, megatron_module

    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    ks = KillSwitch(spec)
    with megatron_cpu_mode():
        import nemo.lightning as nl
        from nemo.collections import llm
        from nemo_tiny import tiny_gpt

        model, data = tiny_gpt()
        qat = NeMoFP4QATCallback(policy="fp_embeddings", schedule=SCHEDULE, calibration=4,
                                 export_dir=str(run / "export"))  # fmt: skip
        _install_nemo_kill_points(ks, qat)

        trainer = nl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                             strategy=nl.MegatronStrategy(ckpt_async_save=False),
                             plugins=nl.MegatronMixedPrecision(precision="32"), callbacks=[qat, Record(run, ks)],
                             limit_val_batches=0, log_every_n_steps=1, enable_progress_bar=False)  # fmt: skip
        # as NeMo's recipes configure it, every checkpoint kept (each one a resume point the harness can test)
        ckpt = nl.ModelCheckpoint(dirpath=str(run / "ckpt"), filename="{step}", every_n_train_steps=2,
                                  monitor="reduced_train_loss", save_top_k=-1, save_last=True)  # fmt: skip
        log = nl.NeMoLogger(log_dir=str(run / "log"), name="qat", use_datetime_version=False, ckpt=ckpt)
        resume = QATAutoResume(resume_if_exists=True, resume_ignore_no_checkpoint=True,
                               resume_from_directory=str(run / "ckpt"))  # fmt: skip
        llm.train(model, data, trainer, log=log, resume=resume)
        final = {
            "state": state_digest(megatron_module(model)),
            "formats": {k: list(v) for k, v in sorted(qat.controller.current.items())},
            "history": qat.controller.history,
            "global_step": trainer.global_step,
            "events": ks.seen,
        }
    tmp = run / f".final.json.{os.getpid()}"
    tmp.write_text(json.dumps(final, indent=1, default=str))
    os.replace(tmp, run / "final.json")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
