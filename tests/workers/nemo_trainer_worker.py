"""Run by test_nemo_trainer.py (own process: NeMo initialises torch.distributed itself).

A tiny NeMo 2.7.3 ``llm.GPTModel`` trained by ``nl.Trainer`` + ``nl.MegatronStrategy`` on the CPU
(``megatron_cpu_mode``) with ``NeMoFP4QATCallback``: fp8 for two steps, then NVFP4. Dumps JSON.

``DEVICES=2`` (``TP=1`` or ``2``, or ``PP=2``) runs two processes; each writes ``OUT.rank<N>`` with every
quantizer's amax (under ``PP`` also by global layer name), so the test can compare ranks.
``BASE=CKPT`` starts from that checkpoint (``RestoreConfig``), so runs at different parallel sizes start alike.

``worker.py OUT [MODE CKPT [CKPT2]]``: MODE ``full`` (default) trains ``STEPS`` steps; ``pretrain`` trains
``STEPS // 2`` steps without QAT and saves a NeMo (dist-)checkpoint to CKPT; ``save`` trains ``STEPS`` steps
and saves a mid-run checkpoint to CKPT after step ``STEPS // 2``; ``resume`` resumes CKPT and trains to ``STEPS``.
QAD (``distillation=True``, one BF16 step then NVFP4): ``qad`` restores the base CKPT with ``RestoreConfig``
(the teacher comes from it) and trains ``STEPS``, saving a mid-run checkpoint to CKPT2 (when given) after step
``STEPS // 2``; ``qad_resume`` resumes CKPT2 without ``RestoreConfig`` (the teacher path comes back from the
checkpoint), so its last steps can be compared with the uninterrupted ``qad`` run's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

STEPS = int(os.environ.get("STEPS", "4"))
DEVICES = int(os.environ.get("DEVICES", "1"))  # > 1: processes on gloo (Lightning launches the others)
TP = int(os.environ.get("TP", "1"))  # tensor parallel size; data parallel = DEVICES // (TP * PP)
PP = int(os.environ.get("PP", "1"))  # pipeline parallel size
EP = int(os.environ["EP"]) if os.environ.get("EP") else None  # set: a mixture-of-experts model at this EP size
ETP = int(os.environ["ETP"]) if os.environ.get("ETP") else None  # the experts' tensor-parallel size (default: TP)
BASE = os.environ.get("BASE")  # a checkpoint to start from (RestoreConfig), as a recipe restores a base model
EXPORT_DIR = os.environ.get("EXPORT_DIR")  # set: the callback exports a TRT-LLM checkpoint at the end of fit
# set: a QuantizationMonitor (measuring every 2 steps) watches the run, and at this step an Inf is put into the
# input of layer 0's linear_fc2 (as the Lightning test in test_monitor.py does)
NVFP4_FROM_START = os.environ.get("NVFP4_FROM_START") == "1"  # set: NVFP4 from the first step (no BF16/FP8 stage)
# MONITOR_ACTION: the monitor's action (default warn); its report goes beside OUT
INJECT_INF_STEP = int(os.environ["INJECT_INF_STEP"]) if os.environ.get("INJECT_INF_STEP") else None
# POLICY: the policy preset (default fp_embeddings)
# set: the model is the Hugging Face folder HF_DIR imported into NeMo (mode ``import`` writes that checkpoint to CKPT;
# the other modes start from it), and the end-of-fit export is a unified HF checkpoint in HF_DIR's layout
HF_DIR = os.environ.get("HF_DIR")

if __name__ == "__main__":
    out = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "full"
    ckpt = sys.argv[3] if len(sys.argv) > 3 else None
    # where the mid-run checkpoint goes (pretrain: its only one; qad: optional, the run continues past it)
    save_to = (sys.argv[4] if len(sys.argv) > 4 else None) if mode == "qad" else ckpt
    save_to = save_to if mode in ("pretrain", "qad", "save") else None
    qad = mode.startswith("qad")
    from nemo_fp4qat.nemo import NeMoFP4QATCallback, import_hf_model, megatron_cpu_mode, megatron_module

    if mode == "import":  # and the imported model's logits against the Hugging Face model's
        import torch
        from transformers import AutoModelForCausalLM

        from nemo_fp4qat.nemo import load_nemo_model, megatron_logits

        import_hf_model(HF_DIR, ckpt)
        tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = AutoModelForCausalLM.from_pretrained(HF_DIR, dtype=torch.float32).eval()(tokens).logits
        with megatron_cpu_mode():
            got = megatron_logits(load_nemo_model(ckpt), tokens)[..., : ref.shape[-1]]
        with open(out, "w") as f:
            json.dump({"logits_max_abs_diff": float((got - ref).abs().max()), "logits_max": float(ref.abs().max())}, f)
        sys.exit(0)

    with megatron_cpu_mode():
        import lightning.pytorch as pl
        import nemo.lightning as nl
        import torch
        from nemo_tiny import imported_gpt, tiny_gpt

        if HF_DIR:
            model, data = imported_gpt(ckpt, devices=DEVICES, tp=TP)
        else:
            model, data = tiny_gpt(tp=TP, devices=DEVICES, pp=PP, init_std=float(os.environ.get("INIT_STD", "0.02")),
                                   ep=EP)  # fmt: skip
        stages = [{"start": 0, "format": "bf16"}, {"start": 1, "format": "target"}] if qad else [
            {"start": 0, "format": "fp8"}, {"start": 2, "format": "target"}]  # fmt: skip
        if NVFP4_FROM_START:
            stages = [{"start": 0, "format": "target"}]
        qat = NeMoFP4QATCallback(
            policy=os.environ.get("POLICY", "fp_embeddings"),
            schedule={"stages": stages},
            # the block scale search runs at the switch to NVFP4: data-parallel ranks calibrate on different samples
            # and must still clip their replicas alike; the export must still validate code for code
            calibration={
                "num_samples": int(os.environ.get("CALIB_SAMPLES", "4")),
                "block_scale_search": os.environ.get("BLOCK_SEARCH", "1") == "1",
            },
            export_dir=EXPORT_DIR,
            export={"kind": "hf", "hf_model": HF_DIR} if HF_DIR else None,
            distillation=True if qad else None,
        )
        seen: list[dict] = []
        marks: dict[str, list[float]] = {}
        losses: dict[int, float] = {}

        def first_fc1(module):  # layer 0's fc1 (a MoE model's first local expert's)
            mlp = module.decoder.layers[0].mlp
            return mlp.experts.local_experts[0].linear_fc1 if EP else mlp.linear_fc1

        def fc1_of(pl_module):
            return first_fc1(megatron_module(pl_module))

        def fingerprint(pl_module):
            w = fc1_of(pl_module).weight.detach().double()
            return [float(w.sum()), *w.flatten()[:4].tolist()]

        class Probe(pl.Callback):
            def on_train_start(self, trainer, pl_module):
                marks["start_fc1"] = fingerprint(pl_module)  # after any restore, before the first step

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                q = getattr(fc1_of(pl_module), "weight_quantizer", None)
                if q is None:  # pretrain mode: no QAT
                    return
                bits = q.num_bits if isinstance(q.num_bits, int) else list(q.num_bits)  # an int while BF16 (off)
                seen.append({"step": trainer.global_step, "num_bits": bits, "enabled": q.is_enabled,
                             "block": (q.block_sizes or {}).get(-1),
                             "amax": None if q.amax is None else float(q.amax)})  # fmt: skip

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses[trainer.global_step] = float(trainer.callback_metrics["reduced_train_loss"])
                if save_to and trainer.global_step == STEPS // 2:
                    marks["saved_fc1"] = fingerprint(pl_module)
                    q = getattr(fc1_of(pl_module), "weight_quantizer", None)
                    marks["saved_amax"] = None if q is None else float(q.amax)
                    trainer.save_checkpoint(save_to)  # inside fit, where NeMo's ModelCheckpoint saves

            def on_train_end(self, trainer, pl_module):
                # found through the trainer, not this script's global: NeMo pickles this class (and what its
                # methods name) into the export's context
                cb = next((c for c in trainer.callbacks if isinstance(c, NeMoFP4QATCallback)), None)
                d = cb.qad_distiller if cb is not None else None
                if d is None:  # not a QAD run
                    return
                if PP > 1:  # a stage alone has no logits to compare; the losses are compared with the PP=1 run's
                    marks["qad_check"] = {"teacher_path": cb.qad_teacher_path, "teacher_bytes": d.teacher_bytes()}
                    return
                # the per-token loss NeMo reduces, on a real batch, against a float64 KL of the two models' logits
                b, mm = cb.controller.calib_batches[0], megatron_module(pl_module)
                inputs = {"input_ids": b["tokens"], "position_ids": b["position_ids"],
                          "attention_mask": b.get("attention_mask")}  # fmt: skip
                with torch.no_grad():
                    kd = mm(**inputs, labels=b["labels"])
                    s_logits, t_logits = mm(**inputs).double(), d.teacher(**inputs).double()
                    if TP > 1:  # vocabulary-parallel logits: the reference softmax takes the whole vocabulary
                        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region as gather

                        s_logits, t_logits = gather(s_logits), gather(t_logits)
                p = torch.log_softmax(t_logits, -1)
                ref = (p.exp() * (p - torch.log_softmax(s_logits, -1))).sum(-1)
                w = first_fc1(d.teacher).weight.detach().double()
                marks["qad_check"] = {"kd": kd.flatten().tolist(), "ref": ref.flatten().tolist(),
                                      "logit_diff": float((s_logits - t_logits).abs().max()),
                                      "teacher_fc1": [float(w.sum()), *w.flatten()[:4].tolist()],
                                      "teacher_bytes": d.teacher_bytes(),
                                      "student_bytes": sum(p.numel() * p.element_size() for p in mm.parameters()),
                                      "teacher_path": cb.qad_teacher_path}  # fmt: skip

        class InjectInf(pl.Callback):
            handle = None

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if trainer.global_step == INJECT_INF_STEP:

                    def inject(module, args):
                        x = args[0].clone()
                        x.view(-1)[7] = float("inf")
                        return (x, *args[1:])

                    layer = megatron_module(pl_module).decoder.layers[0].mlp.linear_fc2
                    self.handle = layer.register_forward_pre_hook(inject)

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if self.handle is not None:
                    self.handle.remove()
                    self.handle = None

        extra = []
        if INJECT_INF_STEP is not None:
            from nemo_fp4qat import QuantizationMonitor

            monitor = QuantizationMonitor(every_n_steps=2, module_getter=megatron_module, out_dir=str(Path(out).parent),
                                          action=os.environ.get("MONITOR_ACTION", "warn"))  # fmt: skip
            extra = [monitor, InjectInf()]
        max_steps = STEPS // 2 if mode == "pretrain" else STEPS
        strategy = nl.MegatronStrategy(ckpt_async_save=False, tensor_model_parallel_size=TP,
                                       pipeline_model_parallel_size=PP, expert_model_parallel_size=EP or 1,
                                       expert_tensor_parallel_size=ETP,
                                       # megatron-core requires sequence parallelism beside tensor x expert parallel
                                       sequence_parallel=bool(EP and EP > 1 and TP > 1))  # fmt: skip
        trainer = nl.Trainer(accelerator="cpu", devices=DEVICES, max_steps=max_steps, strategy=strategy,
                             plugins=nl.MegatronMixedPrecision(precision="32"), logger=False,
                             callbacks=[Probe()] if mode == "pretrain" else [qat, Probe(), *extra],
                             enable_checkpointing=False, limit_val_batches=0, log_every_n_steps=1)  # fmt: skip
        # QAT from a checkpoint trained without it, the way NeMo recipes load a base model
        restore = ckpt if mode == "qad" else BASE
        if restore:
            nl.AutoResume(restore_config=nl.RestoreConfig(path=restore, load_artifacts=False)).setup(trainer, model)
        resume_from = {"qad_resume": sys.argv[4] if len(sys.argv) > 4 else None, "resume": ckpt}.get(mode)
        trainer.fit(model, data, ckpt_path=resume_from)
        if mode == "pretrain":
            with open(out, "w") as f:
                json.dump(marks, f)
            sys.exit(0)
        final_q = fc1_of(model).weight_quantizer
        rank = torch.distributed.get_rank() if DEVICES > 1 else 0
        amax = {n: m.amax.flatten().tolist() for n, m in megatron_module(model).named_modules()
                if type(m).__name__ == "TensorQuantizer" and m.is_enabled and m.amax is not None}  # fmt: skip
        with open(f"{out}.rank{rank}" if DEVICES > 1 else out, "w") as f:
            from megatron.core import parallel_state

            from nemo_fp4qat.qat.parallel.stage_names import stage_layer_offset, to_global_name

            tp = parallel_state.get_tensor_model_parallel_world_size()
            mm, offset = megatron_module(model), stage_layer_offset(megatron_module(model))

            from nemo_fp4qat.qat.parallel.groups import first_local_expert, global_expert_name

            expert_offset = first_local_expert(mm) if EP else 0

            def global_name(name):  # a stage's local layer index (and a rank's local expert index) -> the model's
                return global_expert_name(to_global_name(name, offset), expert_offset)

            weights = {global_name(n): p.detach().double().flatten()[:64].tolist() for n, p in mm.named_parameters()}
            json.dump({**marks, "tp": tp, "pp": parallel_state.get_pipeline_model_parallel_world_size(),
                       "pp_rank": parallel_state.get_pipeline_model_parallel_rank(), "layer_offset": offset,
                       "global_amax": {global_name(n): a for n, a in amax.items()}, "weights": weights,
                       "amax": amax, "seen": seen, "history": qat.controller.history,
                       "calibrated": qat.controller.calibrated, "losses": losses, "final_amax": float(final_q.amax),
                       "final_num_bits": list(final_q.num_bits), "final_fc1": fingerprint(model),
                       "block_clips": sorted(qat.controller.block_clips),
                       "nonfinite": [[f.layer, f.step, f.metric, f.value] for f in monitor.findings
                                     if f.problem == "nonfinite"] if extra else None,
                       "pins": qat.controller.pins}, f)  # fmt: skip
