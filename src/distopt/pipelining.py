"""distopt's DDP as a stage of ``torch.distributed.pipelining``, its schedules unchanged.

[Note: pipeline stages]
torch's ``PipelineStage`` runs one forward and one backward per micro-batch, and knows two
data-parallel wrappers: torch's DDP, whose ``no_sync()`` it enters for every micro-batch but the
last, and FSDP2, which it drives through its own methods. Any other module gets a plain backward
per micro-batch, and ``scale_grads`` divides each ``p.grad``. Under distopt that would reduce the
grads on every micro-batch (and refuse the second one, [Note: grads after the reduction] in
ddp/grads/grad_sync.py), and ``p.grad`` is a marker that holds no grads ([Note: p.grad under
distopt] in ddp/grads/grad_marker.py). ``distopt.pipelining.PipelineStage`` is torch's class with
the three methods that do these things taught distopt's DDP, and nothing else:

* every forward and backward of a micro-batch but the step's last runs inside ``ddp.no_sync()``:
  the grads accumulate in the buffers, and the last micro-batch's backward launches each
  bucket's reduce-scatter as its grads are complete, overlapped with the rest of that backward
  (the schedule says which backward is the last: ``last_backward``). The forward of the last
  micro-batch runs outside too, so that module buffers are broadcast at the start of a step as
  torch's DDP does ([Note: buffer broadcasting] in ddp/module_buffers.py);
* ``scale_grads(n)`` divides the reduced grads this rank holds by ``n`` (``ddp.divide_grads``),
  once the reduction has finished, instead of ``p.grad``. Dividing the reduced fp32 shard is
  exact where the loss would not be: scaling the loss by ``1/n`` scales every activation grad on
  the way, in the model's dtype (bf16 rounds each product), and would be applied on every
  micro-batch; the division is one pass over 1/d of the grads, in the grads' dtype, exact when
  ``n`` is a power of two;
* with sharded grads or params the stage holds its step whole ([Note: a step held whole] in
  ddp/grads/grad_sync.py): under ``no_sync`` a backward reduces nothing and frees nothing, so the
  grads of all micro-batches add up in their pool buffers and the params stay gathered from the
  first forward to the last backward, which reduces each bucket once, as FSDP2's stages do;
* the weight half of a split backward (zero-bubble schedules: ``I`` then ``W``) computes the
  weight grads with ``torch.autograd.grad`` and assigns them to ``p.grad``, which no
  post-accumulate hook sees: it runs inside ``ddp.assigned_grads()``, which puts them into the
  buckets as one backward when it returns (reduced if it is the last one).

The DDP is built on a mesh with a "pp" dimension (``init_device_mesh(..., (pp, dp),
mesh_dim_names=("pp", "dp"))``): it reduces over "dp" as always, and ``ParallelGroups.pp_group``
adds the stages to every verdict on the grads (``verdict_groups``): the optimizer's global norm,
clip coefficient, zero count and fp16 inf/nan verdict, and the DDP's nan check, are reduced over
the stages after the DP (and TP) groups, each element counted once because each stage holds
other params. Params tied across stages (the embedding of the first stage and the head of the
last) are the one exception, see [Note: tied stage params] in distopt/ddp/tied.py.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage

from .cross_rank.stages import agree_over_stages
from .ddp.state import SyncState
from .ddp.wrapper import DistributedDataParallel

__all__ = ["PipelineStage"]


class PipelineStage(TorchPipelineStage):
    """torch's ``PipelineStage`` over a ``distopt.DistributedDataParallel`` stage module.

    Takes torch's arguments; ``group`` defaults to the DDP's pipeline group (the "pp" dimension
    of its mesh), so ``PipelineStage(ddp, stage_index, num_stages, device)`` is enough. See
    [Note: pipeline stages].

    Args:
        submodule: the stage's module wrapped in ``distopt.DistributedDataParallel``, built on a
            mesh with a "pp" dimension (or with ``group`` given here); any other module is a
            TypeError: wrap the stage first.
        stage_index: this stage's place in the pipeline, 0 to ``num_stages - 1``, as torch's.
        num_stages: the number of stages in the pipeline, as torch's.
        device: the device this stage runs on (the module's), as torch's.
        *args: torch's other positional arguments (``input_args``, ``output_args``, ...),
            passed on unchanged.
        group: the pipeline's process group, over which the stages send activations and
            grads; None: the DDP's pipeline group (the "pp" dimension of its mesh), which a
            DDP without one does not have.
        **kwargs: torch's other keyword arguments, passed on unchanged; ``dw_builder`` is
            refused, since it computes the weight grads into ``p.grad``, which distopt's
            buffers never see (zero-bubble schedules work without one).
    """

    submod: DistributedDataParallel
    _distopt_stage = True  # passes the check torch's stage is given: guard_torch_pipeline_stages

    def __init__(self, submodule: DistributedDataParallel, stage_index: int, num_stages: int,
                 device: torch.device, *args: Any, group: dist.ProcessGroup | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(submodule, DistributedDataParallel):
            raise TypeError(
                "distopt.pipelining.PipelineStage takes a distopt.DistributedDataParallel stage "
                f"module, got {type(submodule).__name__}: wrap the stage first, "
                "ddp = distopt.DistributedDataParallel(stage_module, device_mesh=mesh)"
            )
        if kwargs.get("dw_builder") is not None:
            raise ValueError(
                "dw_builder runs its own weight-grad computation into p.grad, which distopt's "
                "buffers never see: drop it (zero-bubble schedules work without one)"
            )
        if group is None:
            group = submodule.parallel.pp_group
        if group is None:
            raise ValueError(
                "the DistributedDataParallel is not a pipeline stage: build it on a mesh with a "
                "'pp' dimension, DistributedDataParallel(stage_module, device_mesh="
                "init_device_mesh(device, (pp, dp), mesh_dim_names=('pp', 'dp'))), or pass the "
                "pipeline's group= here"
            )
        super().__init__(submodule, stage_index, num_stages, device, *args, group=group,
                         **kwargs)
        self._forward_syncs = True

    # ---------------------------------------------------------------- what torch's stage calls

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """torch's forward of one micro-batch, inside ``ddp.no_sync()`` but for the step's last.

        Args:
            fwd_chunk_id: the micro-batch's index in the step; the last (``chunks - 1``) runs
                outside ``no_sync()``, so that module buffers are broadcast as torch's DDP
                broadcasts them ([Note: buffer broadcasting] in ddp/module_buffers.py).
            *args: torch's other arguments (the micro-batch's inputs, ...), passed on.
            **kwargs: the same, by keyword.
        """
        # Only the step's last micro-batch runs outside no_sync(); see [Note: pipeline stages].
        self._forward_syncs = self.chunks is None or fwd_chunk_id == self.chunks - 1
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        """Run the DDP on one micro-batch, inside ``no_sync()`` unless ``forward_one_chunk``
        found it the step's last.

        Args:
            *args: the stage module's positional inputs, passed on unchanged.
            **kwargs: its keyword inputs, passed on unchanged.
        """
        with self._sync_if(self._forward_syncs):
            return self.submod(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                   last_backward: bool = False) -> Any:
        """torch's backward of one micro-batch, inside ``ddp.no_sync()`` but for the step's
        last, which reduces the grads. See [Note: pipeline stages].

        Args:
            backward_type: torch's "full", or "input" and "weight", the two halves of a split
                backward (zero-bubble schedules); a weight half runs inside
                ``ddp.assigned_grads()``, which puts the grads it assigns to ``p.grad`` into the
                buckets.
            bwd_kwargs: torch's arguments of the backward (the stage's outputs, their grads,
                its inputs), passed on unchanged.
            last_backward: whether this is the step's last backward: it runs outside
                ``no_sync()``, so its grads are reduced, and (but for an input half, which makes
                no weight grads) it ends the step held whole.
        """
        base = super().backward_maybe_with_nosync
        if last_backward and backward_type != "input":  # reduces, frees: [Note: a step held
            self.submod.hold_step = False               # whole]; an input half makes no grads
        try:
            with self._sync_if(last_backward):
                if backward_type == "weight":  # assigns p.grad: see [Note: pipeline stages]
                    with self.submod.assigned_grads():
                        return base(backward_type, bwd_kwargs, last_backward)
                return base(backward_type, bwd_kwargs, last_backward)
        finally:
            if last_backward and backward_type != "input":
                self.submod.scheduled(False)  # forwards outside a schedule are checked again

    def clear_runtime_states(self) -> None:
        # Called by every schedule at the start of each step, on every stage.
        super().clear_runtime_states()
        if self.has_backward:
            self._check_new_step()
            # Sharded grads and params reduce and gather once per step, not per micro-batch.
            self.submod.hold_step = not self.submod.options.grad_policy.full_grads
            self.submod.scheduled(True)  # one forward check a step (ddp/stage_methods.py)

    def _check_new_step(self) -> None:
        """A training step starts from zeroed grads, or every stage refuses it before any
        point-to-point message; see [Note: refusals across stages] in cross_rank/stages.py."""
        state = self.submod.sync_state
        problem = None
        if state is not SyncState.IDLE:
            problem = (
                f"pipeline stage {self.stage_index} starts a training step with its grads "
                f"{state.value} (from an earlier step or backward): call optimizer.zero_grad() "
                "before each schedule.step() and optimizer.step() after it; to accumulate more "
                "micro-batches per step, raise the schedule's n_microbatches"
            )
        agree_over_stages(problem, self.group)

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divide the reduced grads this rank holds (``ddp.divide_grads``), where torch's stage
        would divide every ``p.grad``.

        Args:
            grad_scale_factor: the schedule's divisor: the number of micro-batches for a loss
                with mean reduction, 1 (nothing to do) for a sum. Exact when a power of two.
        """
        if grad_scale_factor != 1:
            self.submod.divide_grads(grad_scale_factor)

    def _sync_if(self, sync: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if sync else self.submod.no_sync()
