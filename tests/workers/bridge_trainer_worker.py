"""A megatron-core GPT trained with Megatron-Bridge's own ``pretrain`` loop on the CPU, with FP4 QAT.

Usage: ``python bridge_trainer_worker.py OUT_JSON CKPT_DIR`` with env ``MODEL`` (``tiny``: a 2-layer GPT;
``smollm2``: SmolLM2-135M imported from its Hugging Face files through ``AutoBridge``), ``STEPS`` (train_iters,
default 6), ``EXIT_AT`` (stop after that step, saving a checkpoint there), ``SAVE_INTERVAL`` (default 3),
``EXPORT_DIR`` (export at the end of training), ``SWITCH_AT`` (the step FP8 becomes NVFP4, default 2; 0: NVFP4
throughout), ``QAD`` (``1``: distil from the model as loaded), ``MONITOR`` (a ``BridgeQuantizationMonitor`` every 2
steps whose weight error threshold is this value; its report goes to CKPT_DIR/quant_report), ``TP``
(tensor_model_parallel_size; when set, the tiny GPT's matrices are drawn whole from a seed per parameter name and
each rank keeps its shard (the gated fc1's gate and up rows sharded each), so that every TP size starts from the same
model), ``PP`` (pipeline_model_parallel_size; the matrices drawn by their whole-model names,
so that every PP size starts from the same model), ``GATED`` (``0``: a plain MLP). ``MODEL=moe``: the tiny Hugging
Face Qwen3-MoE in ``HF_DIR`` imported through ``AutoBridge`` (4 experts, top 2, policy ``default``), at expert-parallel
size ``EP`` (global batch 4 in micro-batches of 2; its expert input amax recorded by global expert name). A
checkpoint in CKPT_DIR is resumed. Writes losses per step,
the probe layer's formats per step, and the final amax to OUT_JSON (global rank N > 0: OUT_JSON.rankN).
"""

from __future__ import annotations

import json
import os
import sys

STEPS = int(os.environ.get("STEPS", "6"))
EXIT_AT = int(os.environ["EXIT_AT"]) if os.environ.get("EXIT_AT") else None
SAVE_INTERVAL = int(os.environ.get("SAVE_INTERVAL", "3"))
EXPORT_DIR = os.environ.get("EXPORT_DIR")
SWITCH_AT = int(os.environ.get("SWITCH_AT", "2"))
MODEL = os.environ.get("MODEL", "tiny")
QAD = os.environ.get("QAD") == "1"
MONITOR = float(os.environ["MONITOR"]) if os.environ.get("MONITOR") else None
TP = int(os.environ["TP"]) if os.environ.get("TP") else None
PP = int(os.environ.get("PP", "1"))
GATED = os.environ.get("GATED", "1") == "1"  # the tiny GPT's MLP gated (SwiGLU, as Llama's)
EP = int(os.environ.get("EP", "1"))  # expert_model_parallel_size (MODEL=moe)
ETP = int(os.environ["ETP"]) if os.environ.get("ETP") else None  # expert_tensor_parallel_size (MODEL=moe; default TP)
SMALL = MODEL in ("tiny", "moe")
SEQ, VOCAB = (32, 256) if SMALL else (64, 49152)
LR = 3e-3 if SMALL else 1e-5


def same_model_at_any_tp(chunks):
    """Every matrix drawn whole (seeded by its whole-model name), each tensor-parallel rank keeping its shard."""
    import zlib

    import torch
    from megatron.core import parallel_state

    from nemo_fp4qat.qat.parallel.stage_names import stage_layer_offset, to_global_name

    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    offset = stage_layer_offset(chunks[0])
    with torch.no_grad():
        for local, p in chunks[0].named_parameters():
            name = to_global_name(local, offset)
            if p.dim() < 2:
                continue  # norms: ones at any size
            dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
            shape = [n * size if d == dim else n for d, n in enumerate(p.shape)]
            whole = 0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
            if dim is None:
                p.copy_(whole)
            elif name.endswith("mlp.linear_fc1.weight"):  # gated: each rank holds its gate rows, then its up rows
                gate, up = whole.chunk(2, 0)
                p.copy_(torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]]))
            else:
                p.copy_(whole.chunk(size, dim)[rank])
    return chunks


if __name__ == "__main__":
    out_json, ckpt = sys.argv[1], sys.argv[2]
    if int(os.environ.get("RANK", "0")) > 0:
        out_json = f"{out_json}.rank{os.environ['RANK']}"
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    from nemo_fp4qat import QATConfig
    from nemo_fp4qat.bridge import BridgeQuantizationMonitor, FP4QATBridgeCallback, bridge_cpu_mode

    with bridge_cpu_mode():
        import torch
        from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
        from megatron.bridge.training.callbacks import Callback
        from megatron.bridge.training.config import (
            CheckpointConfig,
            ConfigContainer,
            DistributedInitConfig,
            LoggerConfig,
            MockGPTDatasetConfig,
            OptimizerConfig,
            RNGConfig,
            SchedulerConfig,
            TokenizerConfig,
            TrainingConfig,
            ValidationConfig,
        )
        from megatron.bridge.training.gpt_step import forward_step
        from megatron.bridge.training.pretrain import pretrain
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.transformer.enums import AttnBackend
        from megatron.core.utils import unwrap_model

        cpu_fields = dict(
            transformer_layer_spec=local_layer_spec, attention_backend=AttnBackend.local, bf16=False, fp16=False,
            params_dtype=torch.float32, pipeline_dtype=torch.float32, bias_activation_fusion=False,
            bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
            cross_entropy_loss_fusion=False, attention_dropout=0.0, hidden_dropout=0.0, seq_length=SEQ,
        )  # fmt: skip
        if MODEL == "tiny":
            model = GPTModelProvider(
                num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, vocab_size=VOCAB,
                make_vocab_size_divisible_by=128, position_embedding_type="rope", normalization="RMSNorm",
                activation_func=torch.nn.functional.silu, gated_linear_unit=GATED, add_bias_linear=False,
                share_embeddings_and_output_weights=False, tensor_model_parallel_size=TP or 1,
                pipeline_model_parallel_size=PP, **cpu_fields,
            )  # fmt: skip
            if TP is not None or PP > 1:
                model.register_pre_wrap_hook(same_model_at_any_tp)
        else:  # a Hugging Face model, through Bridge's own conversion (weights loaded in a pre-wrap hook)
            from megatron.bridge import AutoBridge

            from nemo_fp4qat.demo.model import smollm2_hf_dir

            hf_dir = os.environ["HF_DIR"] if MODEL == "moe" else str(smollm2_hf_dir())
            model = AutoBridge.from_hf_pretrained(hf_dir, dtype=torch.float32).to_megatron_provider(load_weights=True)
            if MODEL == "moe":  # SequentialMLP experts (no grouped GEMM) and no fused permutation: both need TE
                cpu_fields.update(moe_grouped_gemm=False, moe_permute_fusion=False, expert_model_parallel_size=EP,
                                  moe_token_dispatcher_type="alltoall", autocast_dtype=torch.float32,
                                  tensor_model_parallel_size=TP or 1, pipeline_model_parallel_size=PP,
                                  expert_tensor_parallel_size=ETP)  # fmt: skip
            for k, v in cpu_fields.items():
                setattr(model, k, v)
        cfg = ConfigContainer(
            model=model,
            train=TrainingConfig(train_iters=STEPS, global_batch_size=4 if SMALL else 2,
                                 micro_batch_size=2 if SMALL else 1, exit_interval=EXIT_AT),
            validation=ValidationConfig(eval_interval=1000, eval_iters=0),
            optimizer=OptimizerConfig(optimizer="adam", lr=LR, min_lr=LR / 10, weight_decay=0.01, clip_grad=1.0,
                                      bf16=False, fp16=False, params_dtype=torch.float32,
                                      use_distributed_optimizer=False),
            scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=2, lr_decay_iters=STEPS,
                                      start_weight_decay=0.01, end_weight_decay=0.01,
                                      weight_decay_incr_style="constant"),
            ddp=DistributedDataParallelConfig(check_for_nan_in_grad=False, grad_reduce_in_fp32=False,
                                              overlap_grad_reduce=False, overlap_param_gather=False,
                                              use_distributed_optimizer=False),
            dataset=MockGPTDatasetConfig(seq_length=SEQ, random_seed=1234, reset_position_ids=False,
                                         reset_attention_mask=False, eod_mask_loss=False,
                                         num_dataset_builder_threads=1, dataloader_type="single", num_workers=0,
                                         pin_memory=False, split="98,1,1"),
            logger=LoggerConfig(log_interval=1),
            tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB),
            checkpoint=CheckpointConfig(save=ckpt, load=ckpt, save_interval=SAVE_INTERVAL, ckpt_format="torch_dist",
                                        async_save=False, fully_parallel_save=False, fully_parallel_load=False),
            rng=RNGConfig(seed=1234),
            dist=DistributedInitConfig(distributed_backend="gloo"),
            mixed_precision=None,
        )  # fmt: skip
        world = int(os.environ["WORLD_SIZE"])
        qat = FP4QATBridgeCallback(
            QATConfig(
                policy="default" if MODEL == "moe" else "fp_embeddings",
                schedule={
                    "stages": [{"start": 0, "format": "fp8"}, {"start": SWITCH_AT, "format": "target"}][
                        1 if SWITCH_AT == 0 else 0 :
                    ]
                },
                # the first global batch (MODEL=moe: each data-parallel rank its part of it)
                calibration={"num_samples": (4 // (world // PP) if MODEL == "moe" else 4) if SMALL else 2},
                distillation="qad" if QAD else None,
                export_dir=EXPORT_DIR,
            )
        )
        qat.install(cfg)
        record: dict = {"losses": {}, "formats": {}, "resumed": qat.resuming}

        def dump():  # after every step too: Bridge's exit_interval ends the process from inside pretrain
            with open(out_json, "w") as f:
                json.dump(record, f, indent=1)

        def fc1(context):
            mlp = unwrap_model(context.model[0]).decoder.layers[0].mlp
            return mlp.experts.local_experts[0].linear_fc1 if MODEL == "moe" else mlp.linear_fc1

        class Probe(Callback):
            def on_train_step_end(self, context):
                step = int(context.state.train_state.step) + 1  # Bridge counts the step after this event
                if "lm loss" in context.loss_dict:  # the last pipeline stage's
                    record["losses"][step] = float(context.loss_dict["lm loss"])
                q = fc1(context).weight_quantizer
                record["formats"][step] = [str(q.num_bits), bool(q.block_sizes)]
                dump()

            def on_train_end(self, context):
                layer = fc1(context)
                record["fc1_weight_amax"] = float(layer.weight_quantizer.amax)
                record["fc1_input_amax"] = float(layer.input_quantizer.amax)
                record["fc1_weight_sum"] = float(layer.weight.detach().double().sum())
                record["history"] = qat.controller.history
                from megatron.core import parallel_state

                record["tp"] = parallel_state.get_tensor_model_parallel_world_size()
                record["pp"] = parallel_state.get_pipeline_model_parallel_world_size()
                if MODEL == "moe":  # every expert's input amax, by its global index
                    from nemo_fp4qat.qat.parallel.groups import first_local_expert, global_expert_name

                    module = unwrap_model(context.model[0])
                    offset = first_local_expert(module)
                    record["expert_input_amax"] = {
                        global_expert_name(n, offset): float(m.input_quantizer.amax)
                        for n, m in module.named_modules() if ".local_experts." in n and n.endswith("linear_fc1")
                    }  # fmt: skip

        callbacks = [qat, Probe()]
        if MONITOR is not None:
            monitor = BridgeQuantizationMonitor(qat, every_n_steps=2, thresholds={"max_weight_rel_err": MONITOR})
            callbacks.append(monitor)
        pretrain(cfg, qat.forward_step(forward_step), callbacks=callbacks)
        if MONITOR is not None:
            record["monitor"] = {"report": str(monitor.report),
                                 "findings": [(f.step, f.problem) for f in monitor.findings],
                                 "finding_layers": sorted({f.layer for f in monitor.findings}),
                                 "measured": [(r["step"], r["stage"]) for r in monitor.records],
                                 "expert_tokens": [r.get("expert_tokens") for r in monitor.records]}  # fmt: skip
        if EXPORT_DIR and qat.exported is not None:
            from nemo_fp4qat.export.validate import validate_export

            rep = validate_export(qat.exported)  # as a deployer sees it: the files alone
            at_export = json.loads((qat.exported / "validation.json").read_text())  # checked against the model
            errors = [str(p) for p in rep.errors]
            record["export"] = {"path": str(qat.exported), "ok": rep.ok, "errors": errors, "algo": rep.quant_algo,
                                "layers": rep.layers, "numeric": at_export["numeric"]}  # fmt: skip
        dump()
