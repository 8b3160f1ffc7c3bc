"""Run by test_nemo_trainer.py (own process: NeMo initialises torch.distributed itself).

A tiny NeMo 2.7.3 ``llm.GPTModel`` trained by ``nl.Trainer`` + ``nl.MegatronStrategy`` on the CPU
(``megatron_cpu_mode``) with ``NeMoFP4QATCallback``: fp8 for two steps, then NVFP4. Dumps JSON.

``DEVICES=2`` (``TP=1`` or ``2``) runs two processes; each writes ``OUT.rank<N>`` with every
quantizer's amax, so the test can compare ranks.

``worker.py OUT [MODE CKPT]``: MODE ``full`` (default) trains ``STEPS`` steps; ``first`` trains
``STEPS // 2`` and saves a NeMo (dist-)checkpoint to CKPT; ``resume`` continues from CKPT to ``STEPS``.
"""

from __future__ import annotations

import json
import os
import sys

STEPS = int(os.environ.get("STEPS", "4"))
DEVICES = int(os.environ.get("DEVICES", "1"))  # > 1: processes on gloo (Lightning launches the others)
TP = int(os.environ.get("TP", "1"))  # tensor parallel size; data parallel = DEVICES // TP
EXPORT_DIR = os.environ.get("EXPORT_DIR")  # set: the callback exports a TRT-LLM checkpoint at the end of fit

if __name__ == "__main__":
    out = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "full"
    ckpt = sys.argv[3] if len(sys.argv) > 3 else None
    from nemo_fp4qat.nemo import NeMoFP4QATCallback, megatron_cpu_mode, megatron_module

    with megatron_cpu_mode():
        import lightning.pytorch as pl
        import nemo.lightning as nl
        import torch
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig
        from nemo.collections import llm
        from nemo.collections.common.tokenizers.bytelevel_tokenizers import ByteLevelTokenizer

        torch.manual_seed(1234)

        cfg = llm.GPTConfig(
            num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32,
            init_method_std=0.02, hidden_dropout=0.0, attention_dropout=0.0,  # deterministic: resume compares losses
            use_cpu_initialization=True, bias_activation_fusion=False,
            masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
            apply_rope_fusion=False, gradient_accumulation_fusion=False,
            share_embeddings_and_output_weights=False,  # an output layer of its own, as NeMo's Llama configs
            transformer_layer_spec=get_gpt_layer_local_spec(),
        )  # fmt: skip

        class ResumableMockDataModule(llm.MockDataModule):
            """MockDataModule plus the consumed-samples state NeMo's PreTrainingDataModule keeps, so a
            resumed run continues the data stream where the checkpoint left it (NeMo's mock has none)."""

            def state_dict(self):
                return {"consumed_samples": self.data_sampler.compute_consumed_samples(self.trainer.global_step)}

            def load_state_dict(self, state):
                self.data_sampler.init_consumed_samples = state["consumed_samples"]
                self.data_sampler.prev_consumed_samples = state["consumed_samples"]
                self.data_sampler.if_first_step = 1

        data = ResumableMockDataModule(seq_length=32, global_batch_size=2, micro_batch_size=2 * TP // DEVICES,
                                  num_workers=0, pin_memory=False, tokenizer=ByteLevelTokenizer(),
                                  create_attention_mask=True)  # fmt: skip
        optim = nl.MegatronOptimizerModule(
            config=OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0, use_distributed_optimizer=False)
        )
        model = llm.GPTModel(cfg, tokenizer=data.tokenizer, optim=optim)
        qat = NeMoFP4QATCallback(
            policy="fp_embeddings",
            schedule={"stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "target"}]},
            calibration=4,
            export_dir=EXPORT_DIR,
        )
        seen: list[dict] = []
        marks: dict[str, list[float]] = {}
        losses: dict[int, float] = {}

        def fc1_of(pl_module):
            return megatron_module(pl_module).decoder.layers[0].mlp.linear_fc1

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
                seen.append({"step": trainer.global_step, "num_bits": list(q.num_bits),
                             "block": (q.block_sizes or {}).get(-1), "amax": float(q.amax)})  # fmt: skip

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses[trainer.global_step] = float(trainer.callback_metrics["reduced_train_loss"])
                if mode in ("first", "pretrain") and trainer.global_step == STEPS // 2:
                    marks["saved_fc1"] = fingerprint(pl_module)
                    trainer.save_checkpoint(ckpt)  # inside fit, where NeMo's ModelCheckpoint saves

        max_steps = STEPS // 2 if mode in ("first", "pretrain") else STEPS
        strategy = nl.MegatronStrategy(ckpt_async_save=False, tensor_model_parallel_size=TP)
        trainer = nl.Trainer(accelerator="cpu", devices=DEVICES, max_steps=max_steps, strategy=strategy,
                             plugins=nl.MegatronMixedPrecision(precision="32"), logger=False,
                             callbacks=[Probe()] if mode == "pretrain" else [qat, Probe()],
                             enable_checkpointing=False, limit_val_batches=0, log_every_n_steps=1)  # fmt: skip
        if mode == "finetune":  # QAT from a checkpoint trained without it, the way NeMo recipes load a base model
            nl.AutoResume(restore_config=nl.RestoreConfig(path=ckpt, load_artifacts=False)).setup(trainer, model)
        trainer.fit(model, data, ckpt_path=ckpt if mode == "resume" else None)
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

            tp = parallel_state.get_tensor_model_parallel_world_size()
            json.dump({**marks, "tp": tp, "amax": amax, "seen": seen, "history": qat.controller.history,
                       "calibrated": qat.controller.calibrated, "losses": losses, "final_amax": float(final_q.amax),
                       "final_num_bits": list(final_q.num_bits)}, f)  # fmt: skip
