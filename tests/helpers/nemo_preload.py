"""What every NeMo 2 worker (``tests/workers/nemo_trainer_worker.py``) imports, imported once in the fork server its
processes are forked from (``preloaded.py``), under the CPU mode the worker itself enters to import them."""

from nemo_fp4qat.nemo import megatron_cpu_mode

with megatron_cpu_mode():
    import transformers  # noqa: F401
