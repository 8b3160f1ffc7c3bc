"""Llama-3 NVFP4 QAD with Megatron-Bridge: Bridge's own Llama-3 recipes at their parallel shapes, plus one callback.

Two sizes, each Bridge's recipe with these changes:

* ``--size 8b``: ``llama3_8b_pretrain_config`` at TP 2 (the shape of Bridge's Llama-3-8B fine-tuning recipe),
  PP 1, data parallel across the remaining GPUs; your indexed corpus with ``--data``.
* ``--size 70b``: ``llama3_70b_sft_config`` at its own shape, TP 8 x PP 4 (32 GPUs: four 8-GPU nodes), on its
  fine-tuning data (SQuAD by default; your packed SFT data with ``--dataset-root``).
* Both: the run starts from the BF16 model (``cfg.checkpoint.pretrained_checkpoint``: a Megatron checkpoint made once
  with ``AutoBridge.import_ckpt("meta-llama/Meta-Llama-3-70B", "/ckpts/llama3_70b")``), which is also the QAD teacher
  (a frozen copy of each rank's shard of its stage, beside the student's; the KL is taken over the
  vocabulary-parallel logits of the last stage); CP 1 (context-parallel QAD is untested); a fine-tuning learning
  rate; :class:`~nemo_fp4qat.bridge.FP4QATBridgeCallback` with the default policy (attention FP8, MLP NVFP4,
  embeddings, output and norms in full precision), NVFP4 from the first step, distillation from the BF16 model,
  and a unified Hugging Face checkpoint for TensorRT-LLM / vLLM / SGLang at the end (every stage's shards merged
  on global rank 0, which needs host memory for the whole model: about 140 GB for 70B in BF16).

Run::

    torchrun --nproc-per-node 8 examples/bridge_llama3_nvfp4_qad.py --size 8b --base /ckpts/llama3_8b \\
        --export-dir /out/llama3_8b_nvfp4 --data /data/my_corpus_text_document
    # four nodes of 8 GPUs (torchrun --nnodes 4 ... or your launcher):
    torchrun --nnodes 4 --nproc-per-node 8 ... examples/bridge_llama3_nvfp4_qad.py --size 70b \\
        --base /ckpts/llama3_70b --export-dir /out/llama3_70b_nvfp4

``--dryrun`` builds the config, checks the policy against the model's module names (a two-layer copy on the meta
device) and prints both without training.
"""

from __future__ import annotations

import argparse
from typing import Any

from nemo_fp4qat import QATConfig
from nemo_fp4qat.bridge import FP4QATBridgeCallback

HF_MODELS = {"8b": "meta-llama/Meta-Llama-3-8B", "70b": "meta-llama/Meta-Llama-3-70B"}


def llama3_nvfp4_qad(
    size: str,
    base: str | None,
    export_dir: str | None,
    data: list[str] | None = None,
    dataset_root: str | None = None,
    train_iters: int = 2000,
) -> tuple[Any, FP4QATBridgeCallback]:
    """Bridge's Llama-3 recipe as an NVFP4 QAD run: ``(ConfigContainer, callback)`` for ``pretrain``.

    Args:
        size: ``"8b"`` (pretrain recipe at TP 2) or ``"70b"`` (SFT recipe at TP 8 x PP 4).
        base: the BF16 model as a Megatron checkpoint (the student's start and the teacher).
        export_dir: where the unified HF checkpoint goes at the end (None: no export).
        data: Megatron indexed dataset prefixes for the 8B run (None: Bridge's mock data).
        dataset_root: packed SFT data for the 70B run (None: the recipe's SQuAD).
        train_iters: QAD steps (NVIDIA's QAD runs use on the order of a billion tokens).

    Raises:
        ValueError: an unknown ``size``.
    """
    if size == "8b":
        from megatron.bridge.recipes.llama import llama3_8b_pretrain_config

        cfg = llama3_8b_pretrain_config()
        cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size = 2, 1
        cfg.model.seq_length = cfg.dataset.seq_length = 4096
        cfg.train.global_batch_size = 256  # x 4096 tokens: about a billion tokens in 1000 steps
        if data:
            cfg.dataset.blend = (data, None)
    elif size == "70b":
        from megatron.bridge.recipes.llama import llama3_70b_sft_config

        cfg = llama3_70b_sft_config()  # TP 8 x PP 4, sequence 4096
        cfg.train.global_batch_size = 128
        if dataset_root:
            cfg.dataset.dataset_root = dataset_root
    else:
        raise ValueError(f"size={size!r}: choose '8b' or '70b'.")
    cfg.checkpoint.pretrained_checkpoint = base
    cfg.model.context_parallel_size = 1
    cfg.model.virtual_pipeline_model_parallel_size = None  # the interleaved schedule is not supported
    cfg.train.train_iters = train_iters
    cfg.train.micro_batch_size = 1
    cfg.optimizer.lr, cfg.optimizer.min_lr = 1e-5, 1e-6
    cfg.scheduler.lr_warmup_iters = 50
    qat = FP4QATBridgeCallback(
        QATConfig(
            policy="default",
            schedule="direct",
            distillation="qad",
            export_dir=export_dir,
            export={"kind": "hf", "hf_model": HF_MODELS[size]},
        )
    )
    qat.install(cfg)  # quantizers by policy before DDP, the schedule in Bridge's loop, state beside checkpoints
    return cfg, qat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(HF_MODELS), default="8b")
    parser.add_argument("--base", help="the BF16 model as a Megatron checkpoint (AutoBridge.import_ckpt)")
    parser.add_argument("--export-dir", help="unified HF checkpoint written at the end")
    parser.add_argument("--data", nargs="*", help="8b: Megatron indexed dataset prefixes (default: mock data)")
    parser.add_argument("--dataset-root", help="70b: packed SFT data (default: the recipe's SQuAD)")
    parser.add_argument("--train-iters", type=int, default=2000)
    parser.add_argument("--dryrun", action="store_true", help="build the config, check the policy, do not train")
    args = parser.parse_args(argv)
    cfg, qat = llama3_nvfp4_qad(args.size, args.base, args.export_dir, args.data, args.dataset_root,
                                args.train_iters)  # fmt: skip
    if not (args.base or args.dryrun):
        parser.error("--base is required to train: QAD starts from the BF16 model (and distils from it)")
    from nemo_fp4qat.bridge import launch

    return launch(cfg, qat, dryrun=args.dryrun)


if __name__ == "__main__":
    raise SystemExit(main())
