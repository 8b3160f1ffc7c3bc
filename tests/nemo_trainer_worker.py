"""Run by test_nemo_trainer.py (own process: NeMo initialises torch.distributed itself).

A tiny NeMo 2.7.3 ``llm.GPTModel`` trained by ``nl.Trainer`` + ``nl.MegatronStrategy`` on the CPU
(``megatron_cpu_mode``) with ``NeMoFP4QATCallback``: fp8 for two steps, then NVFP4. Dumps JSON.
"""

from __future__ import annotations

import json
import sys

if __name__ == "__main__":
    out = sys.argv[1]
    from nemo_fp4qat.nemo import NeMoFP4QATCallback, megatron_cpu_mode, megatron_module

    with megatron_cpu_mode():
        import lightning.pytorch as pl
        import nemo.lightning as nl
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig
        from nemo.collections import llm
        from nemo.collections.common.tokenizers.bytelevel_tokenizers import ByteLevelTokenizer
        from nemo.collections.llm.gpt.data import mock

        # NeMo 2.7.3 bug: MockDataModule passes create_attention_mask positionally into `seed`, so
        # without Transformer Engine no causal mask is made. Re-route the flag (test-side workaround).
        orig_init = mock._MockGPTDataset.__init__

        def init(self, tokenizer, name, num_samples, seq_length, seed=42, create_attention_mask=False):
            orig_init(self, tokenizer, name, num_samples, seq_length, 42, bool(seed) or create_attention_mask)

        mock._MockGPTDataset.__init__ = init

        cfg = llm.GPTConfig(
            num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32,
            init_method_std=0.02, use_cpu_initialization=True, bias_activation_fusion=False,
            masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
            apply_rope_fusion=False, gradient_accumulation_fusion=False,
            transformer_layer_spec=get_gpt_layer_local_spec(),
        )  # fmt: skip
        data = llm.MockDataModule(seq_length=32, global_batch_size=2, micro_batch_size=2, num_workers=0,
                                  pin_memory=False, tokenizer=ByteLevelTokenizer(),
                                  create_attention_mask=True)  # fmt: skip
        optim = nl.MegatronOptimizerModule(
            config=OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0, use_distributed_optimizer=False)
        )
        model = llm.GPTModel(cfg, tokenizer=data.tokenizer, optim=optim)
        qat = NeMoFP4QATCallback(
            policy="fp_embeddings",
            schedule={"stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "target"}]},
            calibration=4,
        )
        seen: list[dict] = []

        class Probe(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                fc1 = megatron_module(pl_module).decoder.layers[0].mlp.linear_fc1
                seen.append({"step": trainer.global_step, "num_bits": list(fc1.weight_quantizer.num_bits),
                             "block": (fc1.weight_quantizer.block_sizes or {}).get(-1)})  # fmt: skip

        strategy = nl.MegatronStrategy(ckpt_async_save=False)
        trainer = nl.Trainer(accelerator="cpu", devices=1, max_steps=4, strategy=strategy,
                             plugins=nl.MegatronMixedPrecision(precision="32"), callbacks=[qat, Probe()], logger=False,
                             enable_checkpointing=False, limit_val_batches=0, log_every_n_steps=1)  # fmt: skip
        trainer.fit(model, data)
        losses = [float(trainer.callback_metrics.get("reduced_train_loss", float("nan")))]
        with open(out, "w") as f:
            json.dump({"seen": seen, "history": qat.controller.history, "calibrated": qat.controller.calibrated,
                       "loss": losses}, f)  # fmt: skip
