"""Nemotron 3 Nano (30B-A3B) NVFP4 QAD with Megatron-Bridge: NVIDIA's published NVFP4 recipe on Bridge's own recipe.

Bridge's ``nemotron_3_nano_pretrain_8gpu_h100_bf16_config`` (one node of 8 GPUs, expert parallel 8; 52 hybrid layers
``MEMEM*E...``: Mamba-2 mixers, 6 attention layers, 23 MoE layers of 128 routed experts, 6 per token, and a shared
expert) with these changes: the run starts from the BF16 model (``cfg.checkpoint.pretrained_checkpoint``: a Megatron
checkpoint made once with ``AutoBridge.import_ckpt("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", ...)``), which is
also the QAD teacher; a fine-tuning learning rate; :class:`~nemo_fp4qat.bridge.FP4QATBridgeCallback` with the
``nemotron3_nano`` preset, the recipe of NVIDIA's published NVFP4 checkpoint: every attention layer and the Mamba
layer feeding each one in 16 bits (found from the layer pattern: layers 4, 11, 18 ... feed attention layers 5, 12,
19 ...), the other Mamba layers and the routed and shared experts in NVFP4, routers, embeddings, output and norms in
16 bits, an FP8 KV cache; and a unified Hugging Face checkpoint at the end, for vLLM. The recipe's grouped experts
(``moe_grouped_gemm``, ``TEGroupedMLP``) become ``SequentialMLP`` (one linear per expert, the same parameters), which
the policy quantizes; left grouped, the callback refuses the recipe by name.

The run needs GPUs with ``mamba_ssm`` (megatron-core's Mamba mixer runs its CUDA kernels) and Transformer Engine;
without ``mamba_ssm`` it stops before building anything, naming it. Run::

    torchrun --nproc-per-node 8 examples/bridge_nemotron3_nano_nvfp4_qad.py --base /ckpts/nemotron3_nano \\
        --export-dir /out/nemotron3_nano_nvfp4

``--dryrun`` (any machine) builds the config, checks the policy against the model's module names (every layer of the
pattern on the meta device, every expert included) and prints the plan: each layer's format and the rule that gave it
("feeds attention layer N"), without training.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from nemo_fp4qat import QATConfig
from nemo_fp4qat.bridge import FP4QATBridgeCallback

HF_MODEL = "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"


def nemotron3_nano_nvfp4_qad(base: str | None, export_dir: str | None, train_iters: int = 1000) -> tuple[Any, Any]:
    """Bridge's Nemotron 3 Nano recipe as an NVFP4 QAD run: ``(ConfigContainer, callback)`` for ``pretrain``.

    Args:
        base: the BF16 model as a Megatron checkpoint (the student's start and the teacher).
        export_dir: where the unified HF checkpoint goes at the end (None: no export).
        train_iters: QAD steps.
    """
    from megatron.bridge.recipes.nemotronh.h100.nemotron_3_nano import nemotron_3_nano_pretrain_8gpu_h100_bf16_config

    cfg = nemotron_3_nano_pretrain_8gpu_h100_bf16_config()  # EP 8, sequence 8192
    cfg.checkpoint.pretrained_checkpoint = base
    # the recipe's grouped experts (TEGroupedMLP) are not one linear per expert, which is what the policy quantizes:
    # SequentialMLP holds the same parameters as one linear layer per expert and projection
    cfg.model.moe_grouped_gemm = False
    cfg.train.train_iters = train_iters
    cfg.scheduler.lr_decay_iters = train_iters
    cfg.optimizer.lr, cfg.optimizer.min_lr = 5e-6, 5e-7
    qat = FP4QATBridgeCallback(
        QATConfig(
            policy="nemotron3_nano",
            schedule="direct",
            distillation="qad",
            export_dir=export_dir,
            export={"kind": "hf", "runtime": "vllm", "hf_model": HF_MODEL},
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
    if not (args.base or args.dryrun):
        parser.error("--base is required to train: QAD starts from the BF16 model (and distils from it)")
    if not args.dryrun and importlib.util.find_spec("mamba_ssm") is None:
        parser.error("training needs mamba_ssm (pip install mamba-ssm, on a CUDA machine: megatron-core's Mamba mixer "
                     "runs its kernels) and Transformer Engine; --dryrun plans the run on any machine")  # fmt: skip
    cfg, qat = nemotron3_nano_nvfp4_qad(args.base, args.export_dir, args.train_iters)
    from nemo_fp4qat.bridge import launch

    return launch(cfg, qat, dryrun=args.dryrun)


if __name__ == "__main__":
    raise SystemExit(main())
