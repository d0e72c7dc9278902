"""The optimizer class that DistributedOptimizer and BasicOptimizer share.

Construction wires the parts (optim/construction.py; docs/design.md, "Who calls whom"): the
param groups and one inner torch optimizer per class (optim/param_groups.py), the DDP's buffers
laid out for the owners of whole tensors (layout/model_layout.py), the fp32 main params of this
rank's part (optim/main_params.py), the groups that grad statistics reduce over (with tensor
parallelism, parallel/tensor_parallel.py) and the step pipeline (optim/step.py). This module
keeps the training API (``step``, ``zero_grad``, the params' syncs) and what checkpoints read.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..cross_rank.stages import stages_agree
from ..ddp.torch_compat import torch_dcp
from ..ddp.wrapper import DistributedDataParallel
from ..host_memory import release_freed_host_memory
from ..layout.elementwise import ShardPiece
from ..options import StepOptions
from . import grad_stats
from .amp import AFTER_STEP, TorchGradScaler, hand_unscale_to, refuse_attribute_protocol
from .construction import OptimizerConstruction
from .fault_tolerance import FaultTolerantSteps
from .loss_scalers import LossScaler
from .offload import OffloadTier
from .step import StepResult
from .tied import tied_grads
from .torch_state import ParamScalars, scalar_entries


class BufferOptimizer(OptimizerConstruction, torch.optim.Optimizer):
    """What DistributedOptimizer and BasicOptimizer share: main params over a DDP's buffers,
    the inner torch optimizers and the step. Not constructed directly; see
    distopt.optim.optimizers."""

    _sharded: bool
    # torch.amp.GradScaler.step(opt) calls step(grad_scaler=scaler); see [Note: torch's
    # GradScaler] in optim/amp.py.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        models: Sequence[DistributedDataParallel],
        optimizer_cls: type[torch.optim.Optimizer],
        params: Iterable[Any] | None,
        options: StepOptions,
        loss_scaler: LossScaler | None,
        model_parallel_group: dist.ProcessGroup | None,
        optimizer_kwargs: dict[str, Any],
    ) -> None:
        # One pipeline stage's refusal is every stage's: [Note: refusals across stages] in
        # cross_rank/stages.py.
        pp_group = models[0].parallel.pp_group
        with stages_agree(pp_group):
            self._construct(models, optimizer_cls, params, options, loss_scaler,
                            model_parallel_group, optimizer_kwargs)
        # [Note: torch's DCP state dicts] in ddp/torch_compat/torch_dcp.py.
        torch_dcp.register_optimizer(self)
        hand_unscale_to(BufferOptimizer)  # [Note: torch's GradScaler]
        # After the agreement, so that every stage reaches its collectives; see
        # [Note: tied stage params] in optim/tied.py.
        self._tied = tied_grads(self.models, pp_group) if pp_group is not None else None
        replicas = self.models[0].parallel.managed_replicas
        self._fault_tolerance = (None if replicas is None
                                 else FaultTolerantSteps(replicas, self))
        if self._tied is not None:
            for main in [m for m in self._pipeline.counted
                         if self.piece_info(m)[0] in self._tied.copies]:
                del self._pipeline.counted[main]

    # ------------------------------------------------------------------ training API

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: ``loss`` multiplied by the loss scale, if any (the
        loss itself without a ``loss_scaler``), so that small fp16 grads do not underflow; the
        step divides the grads by the same scale."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grad buffers (the buffers stay allocated whatever ``set_to_none`` says);
        not ``set_to_none``, each ``p.grad`` there reads zeros until the next backward."""
        for model in self.models:
            model.zero_grad_buffer(set_to_none=set_to_none)
        if self.local_params is not None:  # torch DDP's ignore list: their own p.grad
            self.local_params.zero_grad(set_to_none=set_to_none)
        if self._fault_tolerance is not None:  # [Note: fault-tolerant replicas]
            self._fault_tolerance.begin_step()

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], Any] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> Any:
        """Finish the grad sync, then unscale, clip and step this rank's shard, and gather the
        params. Returns the step's ``StepResult``, or with a ``closure`` what the closure
        returned, as torch.optim does (the ``StepResult`` is then ``last_step_result``).

        Args:
            closure: torch.optim's loss closure, or None: called once, with grad enabled,
                before the step; it runs forward and backward on every rank (and usually
                ``zero_grad()`` first), as under torch DDP. See [Note: step(closure)].
            grad_scaler: passed by ``torch.amp.GradScaler.step(opt)``, whose scale and inf/nan
                verdict the step then uses instead of a ``loss_scaler`` (the optimizer may not
                have both); None when called directly. See [Note: torch's GradScaler] in
                optim/amp.py.
        """
        if closure is None:
            return self._step(grad_scaler)
        # [Note: step(closure)]
        # As torch.optim's: the closure (forward and backward, on every rank) runs once under
        # enable_grad, the step follows as after a backward in the loop, and what the closure
        # returned is returned untouched; the StepResult is kept in last_step_result.
        with torch.enable_grad():
            loss = closure()
        self._step(grad_scaler)
        return loss

    def _step(self, grad_scaler: torch.amp.GradScaler | None) -> StepResult:
        loss_scaler = self._loss_scaler_for(grad_scaler)
        for model in self.models:
            model.finish_grad_sync()
            model.take_grad_writes()
            model.finish_param_sync()
        self.adopt_param_writes()
        if self._tied is not None:  # see [Note: tied stage params] in optim/tied.py
            self._tied.sum_(self.models[0].comm_stats)
        unused = {main for model in self.models for param in model.unused_params
                  for main in self._mains_of.get(param, ())}
        try:
            # A step that failed on some replica group changes nothing anywhere in this group;
            # see [Note: fault-tolerant replicas] in parallel/managed_replicas.py.
            if self._fault_tolerance is not None and not self._fault_tolerance.commit():
                result = StepResult(updated=False)
            else:
                result = self._pipeline.run(loss_scaler, unused)
        finally:
            # See [Note: p.grad under distopt] in ddp/grads/grad_marker.py.
            for model in self.models:
                model.grad_reads.reset(AFTER_STEP)
        if result.updated and not self._first_step_done:
            # The state was just created between the step's temporaries; see
            # [Note: stranded host memory] in host_memory.py.
            self._first_step_done = True
            release_freed_host_memory()
        if result.updated:
            self.state.made = True  # on every rank alike: [Note: opt.state by model param]
            self._gather_params()
        for owned in self._owned:
            owned.note_params_written()
        if self._offload is not None:  # anything read outside the chunks' window, dropped
            self._offload.release()
        self.last_step_result = result
        return result

    @property
    def offload_tier(self) -> OffloadTier | None:
        """Where the masters and state rest between steps (``offload_dir``), or None."""
        return self._offload

    def settle_offloaded(self) -> None:
        """With ``offload_dir``: state made or loaded outside a step moved into the tier,
        and the tier's pages dropped from the process (after a load or a save)."""
        tier = self._offload
        if tier is None:
            return
        chunk = 0
        for owned in self._owned:
            for bucket in range(owned.num_buckets):
                tier.place_state(chunk, owned.bucket_main_params(bucket), self.optimizer.state)
                chunk += 1
        tier.release()

    def _unscaled_by(self, grad_scaler: torch.amp.GradScaler) -> None:
        """``grad_scaler.unscale_(self)`` ran: from now until the step, ``p.grad`` of the
        models' params reads the unscaled grads ([Note: torch's GradScaler] in optim/amp.py).
        """
        inverse = float(grad_stats.inverse_scale(1.0 / grad_scaler.get_scale(), self._device))
        for model in self.models:
            model.grad_reads.unscale = inverse

    def _loss_scaler_for(self, grad_scaler: torch.amp.GradScaler | None) -> Any:
        # Checked on every rank before the grad sync's collectives.
        if grad_scaler is None:
            if hasattr(self, "grad_scale") or hasattr(self, "found_inf"):
                refuse_attribute_protocol()
            return self.loss_scaler
        if self.loss_scaler is not None:
            raise ValueError(
                "the optimizer has a loss_scaler and torch.amp.GradScaler steps it too, so the "
                "grads would be unscaled by one scale and the loss scaled by the other: use "
                "one of the two (drop loss_scaler=, or call opt.step() instead of "
                "scaler.step(opt))"
            )
        return TorchGradScaler(grad_scaler, self, self._device)

    def _gather_params(self) -> None:
        """Bring every rank's model params up to date (nothing to do when replicated)."""

    def sync_model_params(self) -> None:
        """Make every rank's model params the cast of the fp32 main params (after loading them).

        Collective over the data-parallel group when the state is sharded.
        """
        for model in self.models:
            model.finish_param_sync()
        for owned in self._owned:
            owned.copy_params_out()
        if self._sharded:
            for model in self.models:
                model.start_param_sync(overlap=False)
        for owned in self._owned:
            owned.note_params_written()
        self.settle_offloaded()

    def held_params(self) -> list[torch.Tensor]:
        """The model params this rank holds between steps, buffer by buffer: each buffer's
        whole ``param_data``, or with sharded params this rank's ``param_shards``."""
        return [t for model in self.models for buf in model.flat_buffers
                for t in buf.param_storage()]

    def load_held_params(self, values: list[torch.Tensor]) -> None:
        """Copy ``values`` (``held_params()`` of a rank built alike) into the params this rank
        holds, as distopt's own write (not one the next step adopts into the main params)."""
        for model in self.models:
            model.finish_param_sync()
        with torch.no_grad():
            for held, value in zip(self.held_params(), values, strict=True):
                held.copy_(value)
        for owned in self._owned:
            owned.note_params_written()

    def _model_param_scalars(self, param: Any) -> ParamScalars | None:
        """``opt.state[param]`` for a model param of this optimizer; None for any other key."""
        groups = [mps for mps in self.model_param_groups if any(p is param for p in mps)]
        if not groups or param in self._piece_owner:
            return None
        names = {p: n for model in self.models for p, n in model.param_names.items()}
        same_group = {id(p) for p in groups[0]}
        best = None
        for main in self.main_params:
            owner = self.piece_info(main)[0]
            if main in self.state and id(owner) in same_group:
                if owner is param:
                    best = main
                    break
                best = main if best is None else best
        scalars = {} if best is None else scalar_entries(dict.__getitem__(self.state, best))
        return ParamScalars(names.get(param, "?"), scalars)

    def adopt_param_writes(self) -> None:
        """Make the fp32 main params follow whatever was written into the model's params since
        distopt last wrote them (a load into the module, ``p.copy_``); each step and each
        state dict does it first. See [Note: writes into the params] in optim/main_params.py;
        params whose ``.data`` was rebound (``vector_to_parameters``) are taken back into the
        buffers first ([Note: params rebound] in ddp/buffers/rebound_params.py)."""
        for model in self.models:
            model.adopt_rebound_params()
        for owned in self._owned:
            owned.adopt_param_writes()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the buffers are laid out, and the shards dealt, for the param groups given
        at construction.

        Args:
            param_group: torch.optim's new group; pass it in ``params=[...]`` when building
                the optimizer instead.
        """
        raise NotImplementedError(
            "distopt optimizers fix their param groups at construction: pass every group in "
            "params=[...] when building the optimizer"
        )

    @property
    def main_params(self) -> list[nn.Parameter]:
        """The fp32 pieces the inner optimizer updates, in param-group order."""
        return [m for g in self.param_groups for m in g["params"]]

    def main_grad(self, main: nn.Parameter) -> torch.Tensor | None:
        """The fp32 grad the step gives the main param ``main`` as its ``.grad`` (a view of
        the reduced grads, or their fp32 copy; None where the step makes one per bucket):
        readable after the grad sync, though ``main.grad`` is None outside the step."""
        return self._main_grads[main]

    def piece_info(self, main: nn.Parameter) -> tuple[nn.Parameter, ShardPiece]:
        """The model param the piece ``main`` (one of ``main_params``, of this rank) belongs
        to, and where the piece lies in it."""
        owned, piece = self._piece_owner[main]
        return owned.model_param(piece), piece

    # ------------------------------------------------------------------ for checkpoints
    # The interface checkpoint/format.py's ``Optimizer`` protocol names, and nothing else.

    @property
    def tied_copies(self) -> frozenset[nn.Parameter]:
        """Params tied across pipeline stages whose elements another stage counts and saves
        (this rank's copies of them); see [Note: tied stage params] in optim/tied.py."""
        return frozenset() if self._tied is None else self._tied.copies

    @property
    def sharded(self) -> bool:
        """Whether each rank owns a shard of the main params and the state (ZeRO), rather than
        all of them."""
        return self._sharded

    def pieces(self) -> list[tuple[nn.Parameter, ShardPiece, nn.Parameter]]:
        """``(model param, piece, fp32 main param)`` of every piece this rank owns, in
        param-group order (with ``store_param_remainders`` the main params hold their values
        only inside ``main_params_materialized()``)."""
        return [(*self.piece_info(main), main) for main in self.main_params]

    @contextlib.contextmanager
    def main_params_materialized(self) -> Iterator[None]:
        """Inside the block every main param holds its fp32 master values, to be read or
        written (checkpoints do both). With ``store_param_remainders`` they are rebuilt for
        the block (a transient of this rank's whole shard) and split back into this rank's
        shard of the params and the remainders after it; see [Note: param remainders]."""
        if not self.options.store_param_remainders:
            yield
            return
        # Splitting the masters back writes the params: a write of distopt's own, after any
        # the user made is taken up ([Note: writes into the params] in optim/main_params.py).
        self.adopt_param_writes()
        with contextlib.ExitStack() as stack:
            for owned in self._owned:
                for bucket in range(owned.num_buckets):
                    stack.enter_context(owned.bucket_masters(bucket))
            yield
        for owned in self._owned:
            owned.note_params_written()

    def main_param_values(self) -> list[torch.Tensor]:
        """The fp32 master values of every main param, in ``main_params`` order: the main
        params themselves, or, with ``store_param_remainders``, rebuilt from the bf16 params
        and the remainders (new tensors)."""
        values = []
        for main in self.main_params:
            owned, piece = self._piece_owner[main]
            values.append(owned.main_value(main, piece))
        return values

    def main_param_storage(self) -> list[torch.Tensor]:
        """The tensors that keep the main params between steps (what memory counts): the
        main params, or the int16 remainders."""
        if self.options.store_param_remainders:
            return [t for owned in self._owned for t in owned.master_storage()]
        return self.main_params

    def param_group_of(self, main: nn.Parameter) -> dict[str, Any]:
        """The param group (of ``param_groups``) that holds the main param ``main``."""
        return self._group_by_main[main]

    @functools.cached_property
    def _main_grads(self) -> dict[nn.Parameter, torch.Tensor | None]:
        return {main: grad for owned in self._owned
                for main, grad in zip(owned.main_params, owned.main_grads, strict=True)}

    @functools.cached_property
    def _group_by_main(self) -> dict[nn.Parameter, dict[str, Any]]:
        # The groups are fixed at construction (add_param_group raises), so this never changes.
        return {main: group for group in self.param_groups for main in group["params"]}


def as_model_list(model: Any, who: str) -> list[DistributedDataParallel]:
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if not models:
        raise ValueError(f"{who} needs at least one model")
    for m in models:
        if not isinstance(m, DistributedDataParallel):
            raise TypeError(
                f"{who} takes distopt.DistributedDataParallel models, got {type(m).__name__}: "
                "wrap the module first, ddp = distopt.DistributedDataParallel(module)"
            )
    return models
