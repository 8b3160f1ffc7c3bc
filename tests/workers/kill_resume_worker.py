"""One training process of the kill/resume harness (:mod:`kill_resume`), Lightning path.

``python kill_resume_worker.py RUN_DIR [EVENT:N]``

Trains a tiny Llama with ``FP4QATCallback`` (a schedule with three precision switches, each recalibrating),
checkpoints every 2 steps (``last.ckpt`` too), resumes from ``last.ckpt`` when there is one, and exports a
unified HF checkpoint at the end of fit. With ``EVENT:N`` the process SIGKILLs itself at the N-th
occurrence of EVENT in this process:

* ``step``: after optimizer step N (global step N) has run;
* ``calib``: inside the N-th calibration forward (first calibration or a switch's recalibration);
* ``switch``: right after the N-th precision switch of this process (formats changed and recalibrated,
  before the step that uses them);
* ``ckpt``: halfway through writing the N-th checkpoint file (a torn file on disk);
* ``export_weights``: halfway through writing the exported weights;
* ``export_manifest``: with every export file written but the manifest (the completeness mark);
* ``export_rename``: just before the finished export directory is renamed into place.

Everything the harness compares is written by this process: ``losses.jsonl`` (one line per step,
appended and flushed) and, at a clean end, ``final.json`` (sha256 of every tensor of the model state,
the controller's formats and switch history), written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

HERE = Path(__file__).parent

STEPS = 12
SCHEDULE = {
    "stages": [
        {"start": 0, "format": "fp8"},
        {"start": 3, "format": "mxfp8"},
        {"start": 6, "format": "fp6"},
        {"start": 9, "format": "target"},
    ]
}


def _die() -> None:
    # the whole process group, as a scheduler kills a job: NeMo's spawned helper processes die with it (a
    # SIGKILL of this process alone left them orphaned, blocked on their socket, after the test ended)
    os.killpg(os.getpgid(0), signal.SIGKILL)


class KillSwitch:
    """Counts occurrences of the named events; SIGKILLs this process at the configured one."""

    def __init__(self, spec: str | None) -> None:
        self.event, self.at = (spec.split(":")[0], int(spec.split(":")[1])) if spec else (None, 0)
        self.seen: dict[str, int] = {}

    def hit(self, event: str) -> bool:
        """Count ``event``; True when this occurrence is the kill point (the caller dies, maybe mid-write)."""
        self.seen[event] = self.seen.get(event, 0) + 1
        return event == self.event and self.seen[event] == self.at

    def here(self, event: str) -> None:
        if self.hit(event):
            _die()

    die = staticmethod(_die)


def install_export_kill_points(ks: KillSwitch, callback, weight_writers: list[tuple[object, str]]) -> None:
    """The kill points both paths share: calibration forwards, precision switches and the export's stages.
    ``weight_writers``: (module, name) of each ``save_file`` the exporter calls, bound at its import."""
    import nemo_fp4qat.export.exporters as exporters
    import nemo_fp4qat.qat.controller as controller_module

    run_calibration = controller_module.run_calibration

    def calibration_that_may_die(model, batches, algorithm, forward_fn):
        def forward(m, batch):
            ks.here("calib")
            return forward_fn(m, batch)

        return run_calibration(model, batches, algorithm, forward)

    controller_module.run_calibration = calibration_that_may_die
    ctl = callback.controller
    step = ctl.step

    def step_and_maybe_die(model, global_step):
        events = step(model, global_step)
        if events:
            ks.here("switch")
        return events

    ctl.step = step_and_maybe_die

    for module, name in weight_writers:
        save_file = getattr(module, name)

        def torn_save_file(tensors, filename, *a, _save=save_file, **kw):
            _save(tensors, filename, *a, **kw)
            if ks.hit("export_weights"):
                os.truncate(filename, os.path.getsize(filename) // 2)
                _die()

        setattr(module, name, torn_save_file)
    write_manifest = exporters.write_manifest  # bound there by name

    def manifest_then_maybe_die(directory, info):
        ks.here("export_manifest")
        return write_manifest(directory, info)

    exporters.write_manifest = manifest_then_maybe_die
    replace = os.replace

    def replace_maybe_die(src, dst):  # only the export's final rename moves a ".partial-" directory
        if ".partial-" in str(src):
            ks.here("export_rename")
        return replace(src, dst)

    os.replace = replace_maybe_die


def _install_kill_points(ks: KillSwitch, callback) -> None:
    import fsspec.implementations.local as fs_local
    import safetensors.torch
    import transformers.modeling_utils

    # transformers binds safe_save_file at its import, before any patch
    install_export_kill_points(ks, callback, [(safetensors.torch, "save_file"),
                                              (transformers.modeling_utils, "safe_save_file")])  # fmt: skip
    write = fs_local.LocalFileOpener.write

    def torn_write(self, data):  # Lightning writes each checkpoint with one write() through fsspec
        if ks.hit("ckpt"):
            write(self, data[: len(data) // 2])
            self.flush()
            _die()
        return write(self, data)

    fs_local.LocalFileOpener.write = torn_write


def _canonical(obj):
    """A pickled object's content in a form that does not depend on the process (sets sorted)."""
    if isinstance(obj, dict):
        return {str(k): _canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(repr(_canonical(v)) for v in obj)
    return repr(obj)


def state_digest(module) -> dict[str, str]:
    """sha256 of every tensor of the module's state, bytes for bytes. megatron-core's ``_extra_state`` (modelopt
    pickles its quantizer state into it) is compared by content: pickle bytes vary between processes."""
    import pickle

    import torch

    def digest(k, v) -> str:
        raw = v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        if k.endswith("._extra_state") and raw:
            raw = json.dumps(_canonical(pickle.loads(raw))).encode()  # nosec: our own process's state
        return hashlib.sha256(raw).hexdigest()

    return {k: digest(k, v) for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def main(run_dir: str, spec: str | None) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from nemo_fp4qat import FP4QATCallback

    from tiny_models import LitLM, loader, tiny_llama

    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    ks = KillSwitch(spec)
    torch.manual_seed(0)
    lit = LitLM(tiny_llama(seed=1, hidden=128))
    qat = FP4QATCallback(
        policy="default",
        schedule=SCHEDULE,
        calibration=16,
        module_getter=lambda m: m.net,
        export_dir=str(run / "export"),
    )
    _install_kill_points(ks, qat)
    losses = (run / "losses.jsonl").open("a")

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            losses.write(json.dumps({"step": trainer.global_step, "loss": float(loss), "pid": os.getpid()}) + "\n")
            losses.flush()
            if ks.event == "step" and trainer.global_step == ks.at:  # counted by global step, not per process
                _die()

    ck = ModelCheckpoint(dirpath=run / "ckpt", every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[qat, Record(), ck], default_root_dir=run)  # fmt: skip
    last = run / "ckpt" / "last.ckpt"
    # one batch per epoch: every step sees the same batch (see tests/lightning/test_qat_callback._resume_run)
    trainer.fit(lit, loader(n=8, batch_size=8), ckpt_path=str(last) if last.exists() else None)
    final = {
        "state": state_digest(lit),
        "formats": {k: list(v) for k, v in sorted(qat.controller.current.items())},
        "history": qat.controller.history,
        "global_step": trainer.global_step,
        "events": ks.seen,  # how often each kill point occurred in this process (the harness's range)
    }
    tmp = run / f".final.json.{os.getpid()}"
    tmp.write_text(json.dumps(final, indent=1, default=str))
    os.replace(tmp, run / "final.json")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
