"""Run a NeMo-Run task (a recipe) in Megatron CPU mode, in whatever process its executor starts.

``run.run(on_cpu(recipe), executor=run.LocalExecutor())`` smoke-tests a QAT recipe on a laptop or
in CI. The recipe travels *serialized* inside the wrapper: fiddle builds every nested config before
calling a function, and NeMo's model configs (``LlamaConfig`` enables Transformer-Engine fusions)
must be built inside :func:`megatron_cpu_mode`, not before it. A development aid, like the mode.
"""

from __future__ import annotations

from typing import Any

__all__ = ["on_cpu", "run_on_cpu"]


def on_cpu(task: Any) -> Any:
    """Wrap a ``run.Partial`` (e.g. ``llm.pretrain`` / ``llm.finetune`` recipe) so it runs in CPU mode."""
    import nemo_run as run
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    return run.Partial(run_on_cpu, task=ZlibJSONSerializer().serialize(task))


def run_on_cpu(task: str) -> Any:
    """Build and call a serialized ``run.Partial`` inside :func:`megatron_cpu_mode` (the executor's side)."""
    import fiddle as fdl
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    from .cpu_mode import megatron_cpu_mode

    with megatron_cpu_mode():
        return fdl.build(ZlibJSONSerializer().deserialize(task))()
