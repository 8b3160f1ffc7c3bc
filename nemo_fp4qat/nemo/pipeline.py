"""Pipeline parallelism: a forward through every stage for calibration, and what a stage holds.

Under pipeline parallelism each rank holds a stage (a run of layers; the first also the embedding,
the last also the output layer) under local names (``decoder.layers.0`` is the stage's first layer).
Calibration forwards happen outside megatron-core's schedule, so a stage cannot run alone: it takes
its input from the previous stage and hands its output to the next, with megatron-core's own
point-to-point communicator, the way the training schedule does. Every stage runs the same
calibration batches in the same order, so the sends and receives pair up.

The amax rule under pipeline parallelism: a stage calibrates the layers it holds, and a layer's amax is
reduced (MAX) over the ranks that hold a copy or shard of that layer (its data- and tensor-parallel
peers in the same stage), never across stages, which hold other layers
(:func:`nemo_fp4qat.qat.calibration.sync_amax_across_ranks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.nn as nn

from ..qat.stage_names import stage_layer_offset, to_global_name

__all__ = [
    "every_stage",
    "gather_pipeline_model",
    "modelopt_single_process",
    "pipeline_forward",
    "pipeline_layer_offset",
    "pipeline_world_size",
    "this_stage",
]

# The key of a checkpoint payload that holds one entry per pipeline stage.
STAGES_KEY = "pipeline_stages"


def pipeline_world_size() -> int:
    """The pipeline-parallel size of the run (1 without megatron's parallel state)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1
    return ps.get_pipeline_model_parallel_world_size()


def every_stage(payload: Any) -> Any:
    """``payload`` of every pipeline stage, in stage order, for the checkpoint's common state (a collective over
    the pipeline group); ``payload`` itself without pipeline parallelism."""
    pp = pipeline_world_size()
    if pp == 1:
        return payload
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    stages: list[Any] = [None] * pp
    dist.all_gather_object(stages, payload, group=ps.get_pipeline_model_parallel_group())
    return {STAGES_KEY: stages}


def this_stage(saved: Any) -> Any:
    """This rank's stage entry of an :func:`every_stage` payload (a payload saved without pipeline parallelism
    as it is).

    Raises:
        ValueError: the checkpoint was saved at another pipeline-parallel size, or its stages are restored without
            pipeline parallelism: each stage's quantizer state belongs to its own layers.
    """
    if not isinstance(saved, dict) or STAGES_KEY not in saved:
        if pipeline_world_size() > 1 and isinstance(saved, dict) and saved:
            raise ValueError(
                "This checkpoint's QAT state was saved without pipeline parallelism and is being resumed with "
                f"pipeline_model_parallel_size={pipeline_world_size()}: resume at the size it was saved with (to "
                "start a new QAT run from its weights, restore it with RestoreConfig instead of resuming)."
            )
        return saved
    stages = saved[STAGES_KEY]
    pp = pipeline_world_size()
    if len(stages) != pp:
        raise ValueError(
            f"This checkpoint's QAT state was saved with pipeline_model_parallel_size={len(stages)} and is being "
            f"resumed with {pp}: each stage's quantizers belong to its own layers. Resume at "
            f"pipeline_model_parallel_size={len(stages)} (to start a new QAT run from its weights at another size, "
            "restore it with RestoreConfig instead of resuming)."
        )
    from megatron.core import parallel_state as ps

    return stages[ps.get_pipeline_model_parallel_rank()]


pipeline_layer_offset = stage_layer_offset  # the name this module has exported


def pipeline_forward(model: nn.Module, inputs: dict[str, Any]) -> Any:
    """One forward of this rank's stage inside a forward of the whole pipeline.

    Receives the previous stage's hidden states (unless this is the first stage), runs the stage on
    ``inputs`` (megatron-core ``GPTModel.forward`` keywords), and sends its output on (unless this is the
    last stage). Returns the stage's output: logits on the last stage, hidden states on the others.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    config = model.config
    comm = P2PCommunicator(pp_group=ps.get_pipeline_model_parallel_group(), config=config)
    batch, seq = inputs["input_ids"].shape
    if getattr(config, "sequence_parallel", False):
        seq //= ps.get_tensor_model_parallel_world_size()
    seq //= max(1, getattr(config, "context_parallel_size", 1) or 1)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    if not first:
        model.set_input_tensor(comm.recv_forward((seq, batch, config.hidden_size), is_first_stage=False))
    try:
        out = model(**inputs)
    finally:
        model.set_input_tensor(None)
    if not last:
        comm.send_forward(out, is_last_stage=False)
    return out


def _global_controller_state(state: dict[str, Any], offset: int) -> dict[str, Any]:
    out = dict(state)
    out["current"] = {to_global_name(m, offset): f for m, f in state["current"].items()}
    out["ramps"] = {to_global_name(q, offset): r for q, r in state["ramps"].items()}
    return out


@contextlib.contextmanager
def modelopt_single_process() -> Iterator[None]:
    """modelopt sees no process group inside the block (its ``distributed`` helpers report one process).

    The model :func:`gather_pipeline_model` assembles lives on one rank; modelopt's TensorRT-LLM exporter would
    otherwise read the run's world size as tensor parallelism and wait for the other ranks to merge shards.
    """
    from modelopt.torch.utils import distributed as mdist

    original = mdist.is_initialized
    mdist.is_initialized = lambda: False
    try:
        yield
    finally:
        mdist.is_initialized = original


def gather_pipeline_model(pl_module: Any, module: nn.Module, controller: Any) -> nn.Module | None:
    """The whole model of a pipeline-parallel run, assembled on global rank 0 (``None`` on the other ranks).

    A collective: every rank sends its stage's tensors (weights and quantizer buffers, under the whole
    model's layer names) and schedule state to rank 0, which builds the model without pipeline
    parallelism from the run's own NeMo config (``configure_model`` of a copy with
    ``pipeline_model_parallel_size=1``), inserts the quantizers from the run's policy, puts every stage's
    quantizers in their trained formats and loads every stage's tensors. The result holds exactly what the
    stages trained, so the export and its validation see every layer. Rank 0 needs the host memory of the
    whole model.

    Raises:
        ValueError: tensor parallelism together with pipeline parallelism (the shards are not merged here).
    """
    import copy

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        raise ValueError(
            "An end-of-training export of a run with both tensor and pipeline parallelism is not supported: export "
            "from its checkpoint with a run at pipeline_model_parallel_size=1, or train with one of the two."
        )
    offset = pipeline_layer_offset(module)
    payload = None
    if ps.get_data_parallel_rank(with_context_parallel=True) == 0:  # one copy of each stage
        payload = {
            "tensors": {
                to_global_name(k, offset): v.detach().cpu()
                for k, v in module.state_dict().items()
                if isinstance(v, torch.Tensor)
            },
            "controller": _global_controller_state(controller.state_dict(), offset),
            "stage": ps.get_pipeline_model_parallel_rank(),
        }
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    stages = sorted((p for p in gathered if p is not None), key=lambda p: p["stage"])
    tensors = {k: v for p in stages for k, v in p["tensors"].items()}
    state = dict(stages[0]["controller"])
    state["current"] = {m: f for p in stages for m, f in p["controller"]["current"].items()}
    state["ramps"] = {q: r for p in stages for q, r in p["controller"]["ramps"].items()}

    config = copy.deepcopy(pl_module.config)
    config.pipeline_model_parallel_size = 1
    with torch.random.fork_rng(devices=[]):  # building initializes weights; the run's RNG streams stay as they are
        whole = config.configure_model(pl_module.tokenizer, pre_process=True, post_process=True)
    whole = whole.to(next(module.parameters()).dtype)
    rebuilt = type(controller)(
        policy=controller.policy,
        schedule=controller.schedule,
        calibration=controller.calibration,
        share_fused_amax=controller.share_fused_amax,
    )
    rebuilt.total_steps = controller.total_steps
    rebuilt.prepare(whole)
    rebuilt.sync_to_checkpoint(whole, state, tensors)
    whole.load_state_dict(tensors, strict=True)
    return whole.eval()
