"""A tiny NeMo 2.7.3 ``llm.GPTModel`` and a resumable mock data module, for the NeMo worker processes
(``nemo_trainer_worker.py``, ``kill_resume_nemo_worker.py``). Call inside ``megatron_cpu_mode()``."""

from __future__ import annotations

from typing import Any


def tiny_gpt(tp: int = 1, devices: int = 1, seq_length: int = 32, pp: int = 1,
             init_std: float = 0.02, ep: int | None = None) -> tuple[Any, Any]:  # fmt: skip
    """(model, data): global batch 2 (micro-batch 1 under pipeline parallelism: two microbatches), 2 layers,
    hidden 64, an untied output layer (as NeMo's Llama configs), dropout off so
    resumed runs can be compared loss for loss, fusions off (CPU); weights drawn with std ``init_std``.
    ``ep``: a mixture-of-experts model (4 SequentialMLP experts, top 2, alltoall dispatcher, no load-balancing loss)
    at that expert-parallel size."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from nemo.collections import llm
    from nemo.collections.common.tokenizers.bytelevel_tokenizers import ByteLevelTokenizer

    torch.manual_seed(1234)
    cfg = llm.GPTConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=seq_length,
        init_method_std=init_std, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
        share_embeddings_and_output_weights=False,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4 if ep else None, moe_grouped_gemm=False),
        **(dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_grouped_gemm=False,
                moe_permute_fusion=False, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
                add_bias_linear=False,
                expert_model_parallel_size=ep) if ep else {}),
    )  # fmt: skip

    data = tiny_data(ByteLevelTokenizer(), devices, tp=tp, pp=pp, seq_length=seq_length)
    return llm.GPTModel(cfg, tokenizer=data.tokenizer, optim=_adam()), data


ADAM_LR = 1e-3  # the tests' NeMo runs: Adam at a constant learning rate


def _adam() -> Any:
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl

    return nl.MegatronOptimizerModule(
        config=OptimizerConfig(optimizer="adam", lr=ADAM_LR, clip_grad=0.0, use_distributed_optimizer=False)
    )


def imported_gpt(path: Any, devices: int = 1, seq_length: int = 32, tp: int = 1) -> tuple[Any, Any]:
    """(model, data) for a NeMo checkpoint imported from Hugging Face (``import_hf_model``): the model class, config
    and tokenizer its context holds (the weights come from ``RestoreConfig``), the tests' optimizer and mock data
    (global batch 2), dropout off, and no load-balancing loss (computed on each data-parallel rank's own tokens, it
    would make an expert-parallel run differ from a one-rank run by design)."""
    from pathlib import Path

    from nemo.lightning import io

    context = io.load_context(Path(path) / "context", subpath="model")
    cfg = context.config
    cfg.seq_length, cfg.hidden_dropout, cfg.attention_dropout = seq_length, 0.0, 0.0
    if cfg.num_moe_experts:
        cfg.moe_router_load_balancing_type = "none"
    data = tiny_data(context.tokenizer, devices, tp=tp, seq_length=seq_length)
    return type(context)(cfg, tokenizer=context.tokenizer, optim=_adam()), data


def tiny_data(tokenizer: Any, devices: int, tp: int = 1, pp: int = 1, seq_length: int = 32) -> Any:
    """NeMo's mock GPT data (global batch 2; micro-batch 1 under pipeline parallelism), resumable."""
    from nemo.collections import llm

    class ResumableMockDataModule(llm.MockDataModule):
        """MockDataModule plus the consumed-samples state NeMo's PreTrainingDataModule keeps, so a
        resumed run continues the data stream where the checkpoint left it (NeMo's mock has none)."""

        def state_dict(self):
            return {"consumed_samples": self.data_sampler.compute_consumed_samples(self.trainer.global_step)}

        def load_state_dict(self, state):
            self.data_sampler.init_consumed_samples = state["consumed_samples"]
            self.data_sampler.prev_consumed_samples = state["consumed_samples"]
            self.data_sampler.if_first_step = 1

    data_parallel = devices // (tp * pp)
    micro_batch = 1 if pp > 1 else 2 // data_parallel
    data = ResumableMockDataModule(seq_length=seq_length, global_batch_size=2, micro_batch_size=micro_batch,
                                   num_workers=0, pin_memory=False, tokenizer=tokenizer,
                                   create_attention_mask=True)  # fmt: skip
    return data
