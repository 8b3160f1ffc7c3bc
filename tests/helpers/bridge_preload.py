"""What every Megatron-Bridge worker (``tests/workers/bridge_trainer_worker.py``) imports, imported once in the fork
server its processes are forked from (``preloaded.py``), under the CPU mode the worker itself enters to import them."""

from nemo_fp4qat.bridge import bridge_cpu_mode

with bridge_cpu_mode():
    import megatron.bridge
    import megatron.bridge.models.gpt_provider
    import megatron.bridge.training.gpt_step
    import megatron.bridge.training.pretrain
    import megatron.core.distributed  # noqa: F401
    import modelopt.torch.quantization  # noqa: F401
    import transformers  # noqa: F401
