"""Llama-3-8B NVFP4 QAD with Megatron-Bridge: Bridge's own Llama-3-8B recipe plus one callback.

The recipe is Megatron-Bridge's ``llama3_8b_pretrain_config`` with these changes:

* the run starts from the BF16 model (``cfg.checkpoint.pretrained_checkpoint``: a Megatron checkpoint made once
  with ``AutoBridge.import_ckpt("meta-llama/Meta-Llama-3-8B", "/ckpts/llama3_8b")``), which is also the QAD teacher;
* QAD's parallelism: TP=2 (the shape of Bridge's Llama-3-8B fine-tuning recipe; the teacher is sharded like the
  student and the KL is taken over the vocabulary-parallel logits), CP=1 and PP=1 (context-parallel QAD is
  untested; QAD under pipeline parallelism is refused by name, plain QAT runs under it), data parallel across the
  remaining GPUs with the distributed optimizer; a fine-tuning learning rate;
* :class:`~nemo_fp4qat.bridge.FP4QATBridgeCallback` with the default policy (attention FP8, MLP NVFP4, embeddings,
  output and norms in full precision), NVFP4 from the first step, distillation from the BF16 model, and a unified
  Hugging Face checkpoint for TensorRT-LLM / vLLM / SGLang at the end.

Run (8 GPUs)::

    torchrun --nproc-per-node 8 examples/bridge_llama3_8b_nvfp4_qad.py --base /ckpts/llama3_8b \\
        --export-dir /out/llama3_8b_nvfp4 --data /data/my_corpus_text_document

``python examples/bridge_llama3_8b_nvfp4_qad.py --dryrun`` builds the config and prints it without training.
"""

from __future__ import annotations

import argparse
from typing import Any

from nemo_fp4qat import QATConfig
from nemo_fp4qat.bridge import FP4QATBridgeCallback

HF_MODEL = "meta-llama/Meta-Llama-3-8B"


def llama3_8b_nvfp4_qad(
    base: str | None, export_dir: str | None, data: list[str] | None = None, train_iters: int = 2000
) -> tuple[Any, FP4QATBridgeCallback]:
    """Bridge's Llama-3-8B recipe as an NVFP4 QAD run: ``(ConfigContainer, callback)`` for ``pretrain``.

    Args:
        base: the BF16 model as a Megatron checkpoint (the student's start and the teacher).
        export_dir: where the unified HF checkpoint goes at the end (None: no export).
        data: Megatron indexed dataset prefixes (None: Bridge's mock data).
        train_iters: QAD steps (NVIDIA's QAD runs use on the order of a billion tokens).
    """
    from megatron.bridge.recipes.llama import llama3_8b_pretrain_config

    cfg = llama3_8b_pretrain_config()
    cfg.checkpoint.pretrained_checkpoint = base
    cfg.model.tensor_model_parallel_size = 2
    cfg.model.pipeline_model_parallel_size = 1
    cfg.model.context_parallel_size = 1
    cfg.model.seq_length = cfg.dataset.seq_length = 4096
    cfg.train.train_iters = train_iters
    cfg.train.global_batch_size = 256  # x 4096 tokens: about a billion tokens in 1000 steps
    cfg.train.micro_batch_size = 1
    cfg.optimizer.lr, cfg.optimizer.min_lr = 1e-5, 1e-6
    cfg.scheduler.lr_warmup_iters = 50
    if data:
        cfg.dataset.blend = (data, None)
    qat = FP4QATBridgeCallback(
        QATConfig(
            policy="default",
            schedule="direct",
            distillation="qad",
            export_dir=export_dir,
            export={"kind": "hf", "hf_model": HF_MODEL},
        )
    )
    qat.install(cfg)  # quantizers by policy before DDP, the schedule in Bridge's loop, state beside checkpoints
    return cfg, qat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the BF16 model as a Megatron checkpoint (AutoBridge.import_ckpt)")
    parser.add_argument("--export-dir", help="unified HF checkpoint written at the end")
    parser.add_argument("--data", nargs="*", help="Megatron indexed dataset prefixes (default: mock data)")
    parser.add_argument("--train-iters", type=int, default=2000)
    parser.add_argument("--dryrun", action="store_true", help="build the config, print it, do not train")
    args = parser.parse_args(argv)
    cfg, qat = llama3_8b_nvfp4_qad(args.base, args.export_dir, args.data, args.train_iters)
    if args.dryrun:
        model = cfg.model
        print(f"model: {type(model).__name__} layers={model.num_layers} hidden={model.hidden_size} "
              f"TP={model.tensor_model_parallel_size} PP={model.pipeline_model_parallel_size} "
              f"CP={model.context_parallel_size} seq={model.seq_length}")  # fmt: skip
        print(f"start from: {cfg.checkpoint.pretrained_checkpoint}")
        print(f"train: {cfg.train.train_iters} iters x {cfg.train.global_batch_size} sequences, lr {cfg.optimizer.lr}")
        print(f"qat: {qat.config}")
        return 0
    if not args.base:
        parser.error("--base is required to train: QAD starts from the BF16 model (and distils from it)")
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    pretrain(cfg, qat.forward_step(forward_step), callbacks=[qat])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
