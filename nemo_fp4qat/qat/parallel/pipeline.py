"""Pipeline parallelism: a forward through every stage (calibration, the QAD teacher), and what a stage holds.

Under pipeline parallelism each rank holds a stage (a run of layers; the first also the embedding,
the last also the output layer) under local names (``decoder.layers.0`` is the stage's first layer).
Calibration forwards happen outside megatron-core's schedule, so a stage cannot run alone: it takes
its input from the previous stage and hands its output to the next, with megatron-core's own
point-to-point communicator, the way the training schedule does. Every stage runs the same
calibration batches in the same order, so the sends and receives pair up.

The amax rule under pipeline parallelism: a stage calibrates the layers it holds, and a layer's amax is
reduced (MAX) over the ranks that hold a copy or shard of that layer (its data- and tensor-parallel
peers in the same stage), never across stages, which hold other layers
(:func:`nemo_fp4qat.qat.calibration.calibrate.sync_amax_across_ranks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

from nemo_fp4qat.qat.parallel.stage_names import stage_layer_offset

__all__ = [
    "StagedForward",
    "every_stage",
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


RESTART_HINT = "load its weights as a pretrained checkpoint instead of resuming"


def this_stage(saved: Any, restart_hint: str = RESTART_HINT) -> Any:
    """This rank's stage entry of an :func:`every_stage` payload (a payload saved without pipeline parallelism
    as it is). ``restart_hint``: how the front end starts a new QAT run from a checkpoint's weights.

    Raises:
        ValueError: the checkpoint was saved at another pipeline-parallel size, or its stages are restored without
            pipeline parallelism: each stage's quantizer state belongs to its own layers.
    """
    if not isinstance(saved, dict) or STAGES_KEY not in saved:
        if pipeline_world_size() > 1 and isinstance(saved, dict) and saved:
            raise ValueError(
                "This checkpoint's QAT state was saved without pipeline parallelism and is being resumed with "
                f"pipeline_model_parallel_size={pipeline_world_size()}: resume at the size it was saved with (to "
                f"start a new QAT run from its weights, {restart_hint})."
            )
        return saved
    stages = saved[STAGES_KEY]
    pp = pipeline_world_size()
    if len(stages) != pp:
        raise ValueError(
            f"This checkpoint's QAT state was saved with pipeline_model_parallel_size={len(stages)} and is being "
            f"resumed with {pp}: each stage's quantizers belong to its own layers. Resume at "
            f"pipeline_model_parallel_size={len(stages)} (to start a new QAT run from its weights at another size, "
            f"{restart_hint})."
        )
    from megatron.core import parallel_state as ps

    return stages[ps.get_pipeline_model_parallel_rank()]


pipeline_layer_offset = stage_layer_offset  # the name this module has exported


def _stage_input_shape(config: Any, tokens: Any) -> tuple[int, int, int]:
    """The hidden states a stage receives for ``tokens`` (batch x sequence): ``(sequence, batch, hidden)``, the
    sequence split over tensor-parallel ranks under sequence parallelism and over context-parallel ranks."""
    from megatron.core import parallel_state as ps

    batch, seq = tokens.shape
    if getattr(config, "sequence_parallel", False):
        seq //= ps.get_tensor_model_parallel_world_size()
    seq //= max(1, getattr(config, "context_parallel_size", 1) or 1)
    return seq, batch, config.hidden_size


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
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    if not first:
        model.set_input_tensor(comm.recv_forward(_stage_input_shape(config, inputs["input_ids"]), is_first_stage=False))
    try:
        out = model(**inputs)
    finally:
        model.set_input_tensor(None)
    if not last:
        comm.send_forward(out, is_last_stage=False)
    return out


class StagedForward:
    """A forward of this rank's stage (a calibration batch, the QAD teacher) that works inside a pipeline schedule
    as well as outside it.

    Megatron-Bridge hands the run's micro-batches to its forward step inside megatron-core's pipeline schedule,
    where a later stage waits in the schedule's receive for the first micro-batch: a calibration forward through
    the schedule's own communicator would be taken for that micro-batch. So the calibration activations travel
    on a group of their own (the world's ranks, :meth:`setup`): a stage receives the previous stage's activation
    for each calibration batch (blocking: the previous stage has calibrated and sent them before it ran its
    first micro-batch), runs its layers, and sends its output on without waiting (:meth:`flush` waits, once the
    next stage is sure to have received it). Every stage runs the same batches in the same order, so sends and
    receives pair up, inside the schedule or at a step's start. The input tensor the schedule set on the stage
    is kept.

    Args:
        forward: one forward of a megatron-core GPT on a batch (``forward(model, batch)``).
    """

    def __init__(self, forward: Callable[[nn.Module, Any], Any]) -> None:
        self.forward = forward
        self.group: Any = None
        self._pending: list[tuple[Any, Any]] = []

    def setup(self) -> None:
        """Create the calibration group (a collective: every rank calls it, once)."""
        import torch.distributed as dist

        if self.group is None:
            self.group = dist.new_group(list(range(dist.get_world_size())))

    def __call__(self, model: nn.Module, batch: Any, input_shape: tuple[int, ...] | None = None) -> Any:
        """This stage's forward of ``model`` on ``batch``; ``input_shape``: the shape of the hidden states it
        receives (by default from the batch's tokens, which stages between the first and the last may not have)."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self.group is None:
            raise RuntimeError("StagedForward.setup() must run on every rank before the first calibration forward.")
        config = model.config
        decoder = model.decoder
        kept = decoder.input_tensor
        if not ps.is_pipeline_first_stage():
            dtype = getattr(config, "pipeline_dtype", None) or config.params_dtype
            if input_shape is None:
                tokens = batch["tokens"] if isinstance(batch, dict) else batch
                input_shape = _stage_input_shape(config, tokens)
            device = next(model.parameters()).device
            hidden = torch.empty(input_shape, dtype=dtype, device=device)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank(), group=self.group)
            model.set_input_tensor(hidden)
        try:
            out = self.forward(model, batch)
        finally:
            decoder.set_input_tensor(kept)
        if not ps.is_pipeline_last_stage():
            sent = out.detach().contiguous()
            self._pending.append((dist.isend(sent, dst=ps.get_pipeline_model_parallel_next_rank(), group=self.group),
                                  sent))  # fmt: skip
        return out

    def flush(self) -> None:
        """Wait for the activations sent to the next stage (kept alive until then)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
