"""Qwen3-30B-A3B NVFP4 QAD with Megatron-Bridge: Bridge's own mixture-of-experts SFT recipe at its parallel shape.

Bridge's ``qwen3_30b_a3b_sft_8gpu_h100_bf16_config`` (one node of 8 GPUs: TP 4 x PP 2, expert parallel 4, sequence
parallel; 48 layers of 128 experts, 8 routed per token) with these changes: the run starts from the BF16 model
(``cfg.checkpoint.pretrained_checkpoint``: a Megatron checkpoint made once with
``AutoBridge.import_ckpt("Qwen/Qwen3-30B-A3B", "/ckpts/qwen3_30b_a3b")``), which is also the QAD teacher; a fine-tuning
learning rate; :class:`~nemo_fp4qat.bridge.FP4QATBridgeCallback` with the default policy: the routed and shared
experts in NVFP4 (each projection's input scale tied across a layer's experts, as the engines' fused MoE kernels
need), attention in FP8, routers, embeddings, output and norms in 16 bits; and a unified Hugging Face checkpoint at
the end (TensorRT-LLM's LLM API, vLLM and SGLang load it). The recipe's grouped experts (``moe_grouped_gemm``,
``TEGroupedMLP``) become ``SequentialMLP`` (one linear per expert, the same parameters), which the policy quantizes;
left grouped, the callback refuses the recipe by name.

Run::

    torchrun --nproc-per-node 8 examples/bridge_qwen3_moe_nvfp4_qad.py --base /ckpts/qwen3_30b_a3b \\
        --export-dir /out/qwen3_30b_a3b_nvfp4

``--dryrun`` builds the config, checks the policy against the model's module names (a two-layer copy on the meta
device, every expert included) and prints both without training.
"""

from __future__ import annotations

import argparse
from typing import Any

from nemo_fp4qat import QATConfig
from nemo_fp4qat.bridge import FP4QATBridgeCallback

HF_MODEL = "Qwen/Qwen3-30B-A3B"


def qwen3_moe_nvfp4_qad(base: str | None, export_dir: str | None, train_iters: int = 1000) -> tuple[Any, Any]:
    """Bridge's Qwen3-30B-A3B SFT recipe as an NVFP4 QAD run: ``(ConfigContainer, callback)`` for ``pretrain``.

    Args:
        base: the BF16 model as a Megatron checkpoint (the student's start and the teacher).
        export_dir: where the unified HF checkpoint goes at the end (None: no export).
        train_iters: QAD steps.
    """
    from megatron.bridge.recipes.qwen.h100.qwen3_moe import qwen3_30b_a3b_sft_8gpu_h100_bf16_config

    cfg = qwen3_30b_a3b_sft_8gpu_h100_bf16_config()  # TP 4 x PP 2, EP 4, sequence 2048
    cfg.checkpoint.pretrained_checkpoint = base
    cfg.model.context_parallel_size = 1
    cfg.model.virtual_pipeline_model_parallel_size = None  # the interleaved schedule is not supported
    # the recipe's grouped experts (TEGroupedMLP) are not one linear per expert, which is what the policy quantizes:
    # SequentialMLP holds the same parameters as one linear layer per expert and projection
    cfg.model.moe_grouped_gemm = False
    cfg.train.train_iters = train_iters
    cfg.scheduler.lr_decay_iters = train_iters
    cfg.optimizer.lr, cfg.optimizer.min_lr = 5e-6, 5e-7
    qat = FP4QATBridgeCallback(
        QATConfig(
            policy="default",
            schedule="direct",
            distillation="qad",
            export_dir=export_dir,
            export={"kind": "hf", "hf_model": HF_MODEL},
        )
    )
    qat.install(cfg)
    return cfg, qat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the BF16 model as a Megatron checkpoint (AutoBridge.import_ckpt)")
    parser.add_argument("--export-dir", help="unified HF checkpoint written at the end")
    parser.add_argument("--train-iters", type=int, default=1000)
    parser.add_argument("--dryrun", action="store_true", help="build the config, check the policy, do not train")
    args = parser.parse_args(argv)
    cfg, qat = qwen3_moe_nvfp4_qad(args.base, args.export_dir, args.train_iters)
    if not (args.base or args.dryrun):
        parser.error("--base is required to train: QAD starts from the BF16 model (and distils from it)")
    from nemo_fp4qat.bridge import launch

    return launch(cfg, qat, dryrun=args.dryrun)


if __name__ == "__main__":
    raise SystemExit(main())
