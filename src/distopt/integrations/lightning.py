"""DistoptStrategy: Lightning's data parallelism with distopt's DDP and distributed optimizer.

``Trainer(strategy=DistoptStrategy())`` trains an unchanged LightningModule the way
``strategy="ddp"`` does (same launcher, process group, samplers, ``reduce``/``barrier``/
``broadcast``), but wraps the module in ``distopt.DistributedDataParallel`` (never torch's) and
rebuilds the optimizer from ``configure_optimizers`` as ``distopt.DistributedOptimizer`` over the
same class, groups and options, so each rank keeps 1/d of the fp32 master params and optimizer
state. Lightning's switches keep their meaning:

- ``accumulate_grad_batches``: the accumulation steps run under ``ddp.no_sync()``, with no
  communication; the last micro-batch's backward reduce-scatters.
- ``gradient_clip_val`` (``gradient_clip_algorithm="norm"``): distopt's one global norm over
  every shard, inside the step. Clipping by value is refused.
- ``broadcast_buffers`` and ``Trainer(sync_batchnorm=True)``: BatchNorm statistics are kept as
  ``DDPStrategy`` keeps them, rank 0's broadcast before each forward, or reduced over the
  data-parallel group by ``nn.SyncBatchNorm``.
- ``precision``: "32-true", "bf16-mixed", "bf16-true" (bf16 weights, fp32 masters in the
  optimizer), "16-mixed" (distopt's DynamicLossScaler; see _lightning_precision.py).
- ``trainer.save_checkpoint(path)`` writes distopt's sharded checkpoint (each rank its shard,
  Lightning's loop, scheduler and callback state with it) and, at ``path``, an ordinary
  Lightning checkpoint file that Lightning's own strategies resume; ``fit(ckpt_path=path)``
  resumes from the sharded part at any number of devices. See [Note: Lightning checkpoints
  under distopt] in _lightning_checkpoints.py.
- The module leaves ``fit`` a plain module: the wrapper is released at teardown, so a second
  ``fit`` (under any strategy) wraps it anew ([Note: one wrapper per param] in
  distopt/param_owners.py).

``DistoptStrategy(basic=True)`` uses ``distopt.BasicOptimizer`` (all-reduced grads, replicated
state) instead, to compare. docs/lightning.md has the details and the limits.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .._version import pip_install

try:
    import lightning.pytorch as pl
except ImportError as exc:  # one line that says what to install, not a deep traceback
    raise ImportError(
        f"distopt.integrations.lightning needs Lightning: {pip_install('lightning')}"
    ) from exc
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from ..checkpoint import load_checkpoint, save_checkpoint
from ..ddp.wrapper import DistributedDataParallel
from ..optim.loss_scalers import LossScaler
from ..optim.optimizers import BasicOptimizer, DistributedOptimizer
from . import _lightning_checkpoints as checkpoint_files
from ._lightning_optimizers import check_convertible, repoint_scheduler, to_distopt
from ._lightning_precision import DistoptPrecision

__all__ = ["DistoptStrategy"]

# Module wrappers that already own the grads' reduction: wrapping one again would reduce twice.
_WRAPPERS: tuple[type, ...] = (torch.nn.parallel.DistributedDataParallel, DistributedDataParallel)
try:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    _WRAPPERS += (FSDPModule, FullyShardedDataParallel)
except ImportError:  # a torch built without distributed FSDP
    pass


class DistoptStrategy(DDPStrategy):
    """Lightning strategy: distopt's DDP and ZeRO optimizer in place of torch DDP.

    Args:
        basic: use ``distopt.BasicOptimizer`` (grads all-reduced, every rank keeps all of the
            optimizer state) instead of ``distopt.DistributedOptimizer``, to compare; it takes
            none of the sharded optimizer's options (``overlap_param_gather``,
            ``store_param_remainders``, ``shard_grads``, ``shard_params``).
        bucket_size: elements per bucket, passed to ``distopt.DistributedDataParallel``;
            None: distopt's default.
        overlap_grad_reduce: reduce each bucket during backward as soon as its grads are
            complete (True, the default), passed to the DDP.
        grad_dtype: dtype of the grad buffer and of the reduction (fp32 by default; None:
            each param's own), passed to the DDP.
        find_unused_parameters: leave params that got no grad on any rank out of the step
            (one small all-reduce per step), passed to the DDP; False, as Lightning's
            ``DDPStrategy``: such a param is an error at the step.
        check_for_nan_in_grad: after the reduction, raise on every rank naming the first
            param whose grad holds a nan or inf, passed to the DDP.
        reduce_scatter_with_fp32_accumulation: with bf16 or fp16 grads, add each shard's
            copies in fp32 in the reduce-scatter, passed to the DDP.
        shard_grads: keep only this rank's shard of the reduced grads between steps (ZeRO-2),
            passed to the DDP; every micro-batch of ``accumulate_grad_batches`` then reduces.
        shard_params: keep only this rank's shard of the params too (ZeRO-3), gathered around
            the forward and backward that use them, passed to the DDP.
        broadcast_buffers: as with ``DDPStrategy(broadcast_buffers=...)``: rank 0's BatchNorm
            statistics broadcast before each forward, True by default; passed to the DDP.
        overlap_param_gather: gather the updated params in the background, each bucket waited
            for by the next forward just before its first use; passed to
            ``distopt.DistributedOptimizer``.
        store_param_remainders: keep int16 remainders instead of fp32 main params (bf16
            params only, ``precision="bf16-true"``); passed to ``distopt.DistributedOptimizer``.
        loss_scaler: the distopt loss scaler for fp16; by default a ``DynamicLossScaler`` with
            precision "16-mixed" and none otherwise.
        torch_optimizer_state: put the optimizer state, in torch.optim's format, in the
            checkpoint file Lightning's plain strategies read, so that they resume with it
            (rank 0 reads it back from distopt's shards and writes it once more); False writes
            the weights and Lightning's state only.
        accelerator: as for Lightning's ``DDPStrategy``; None: the Trainer's.
        parallel_devices: as for ``DDPStrategy``, the devices of this node; None: the
            Trainer's.
        cluster_environment: as for ``DDPStrategy``, where the ranks learn their place;
            None: the Trainer's.
        checkpoint_io: as for ``DDPStrategy``; the checkpoints of this strategy's
            ``save_checkpoint`` and ``load_checkpoint`` are written and read by distopt, not
            through it.
        precision_plugin: as for ``DDPStrategy``; None: the Trainer's. Wrapped so that the
            optimizer side is distopt's; "32-true", "bf16-mixed", "bf16-true" and "16-mixed"
            are supported, other precisions refused.
        process_group_backend: as for ``DDPStrategy``: "nccl", "gloo", ...; None: the
            device's default.
        timeout: as for ``DDPStrategy``, the process group's timeout for collectives;
            Lightning's default.
        start_method: as for ``DDPStrategy``, how processes are launched: "popen" (the
            default: the script is run again per device), "spawn", "fork" or "forkserver".
        **torch_ddp_options: options of torch's DDP (``static_graph``, ``bucket_cap_mb``,
            communication hooks, ...), which ``DDPStrategy`` passes on: refused, naming them,
            since the module is wrapped by distopt alone.
    """

    strategy_name = "distopt"

    def __init__(
        self,
        *,
        basic: bool = False,
        bucket_size: int | None = None,
        overlap_grad_reduce: bool = True,
        grad_dtype: torch.dtype | None = torch.float32,
        find_unused_parameters: bool = False,
        check_for_nan_in_grad: bool = False,
        reduce_scatter_with_fp32_accumulation: bool = False,
        shard_grads: bool = False,
        shard_params: bool = False,
        broadcast_buffers: bool = True,
        overlap_param_gather: bool = False,
        store_param_remainders: bool = False,
        loss_scaler: LossScaler | None = None,
        torch_optimizer_state: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        **torch_ddp_options: Any,
    ) -> None:
        if torch_ddp_options:
            raise ValueError(
                f"DistoptStrategy wraps the module in distopt.DistributedDataParallel, not "
                f"torch's; {', '.join(sorted(torch_ddp_options))} would configure a torch DDP "
                "wrapper that is never built: drop them (distopt's own options are "
                "bucket_size, overlap_grad_reduce, find_unused_parameters, grad_dtype, ...)"
            )
        if basic and (overlap_param_gather or store_param_remainders or shard_grads
                      or shard_params):
            raise ValueError(
                "overlap_param_gather, store_param_remainders, shard_grads and shard_params "
                "belong to the "
                "sharded optimizer; basic=True (BasicOptimizer) has none of them: drop them or "
                "basic=True"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )
        self.basic = basic
        self._ddp_options = dict(
            grad_dtype=grad_dtype,
            bucket_size=bucket_size,
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=not basic,
            find_unused_parameters=find_unused_parameters,
            check_for_nan_in_grad=check_for_nan_in_grad,
            reduce_scatter_with_fp32_accumulation=reduce_scatter_with_fp32_accumulation,
            shard_grads=shard_grads,
            shard_params=shard_params,
            broadcast_buffers=broadcast_buffers,
        )
        self._optimizer_options = (
            {} if basic else dict(overlap_param_gather=overlap_param_gather,
                                  store_param_remainders=store_param_remainders)
        )
        self._loss_scaler = loss_scaler
        self._torch_optimizer_state = torch_optimizer_state
        # Kept (released) after teardown, so that trainer.save_checkpoint works once fit has
        # returned.
        self.ddp: DistributedDataParallel | None = None
        self.optimizer: DistributedOptimizer | BasicOptimizer | None = None
        # Which params of each group of configure_optimizers' optimizer train, for the
        # optimizer state in torch's numbering.
        self._trainable: list[list[bool]] | None = None

    # ------------------------------------------------------------------ precision

    @property
    def precision_plugin(self) -> DistoptPrecision:
        if not isinstance(self._precision_plugin, DistoptPrecision):
            self._precision_plugin = DistoptPrecision(self._precision_plugin or Precision())
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Checked here, when the Trainer is built, before any process starts.
        if plugin is not None and not isinstance(plugin, DistoptPrecision):
            plugin = DistoptPrecision(plugin)
        self._precision_plugin = plugin

    # ------------------------------------------------------------------ setup

    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's setup: when fitting, check the Trainer, the module and its optimizer on
        every rank, wrap the module in distopt's DDP and rebuild the optimizer as distopt's;
        otherwise only move the module and give every rank rank 0's weights.

        Args:
            trainer: the Trainer being set up; its ``gradient_clip_val`` becomes the
                optimizer's ``clip_grad``, and clipping by value is refused.
        """
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if not fitting:
            _sync_module_states(self.model)  # no wrapper: every rank evaluates rank 0's weights
            self.setup_precision_plugin()
            return
        # Everything is checked on every rank before the first collective (the DDP's broadcast
        # of rank 0's params), so a bad setting raises everywhere and nothing hangs.
        self._check_trainer(trainer)
        self._check_module(self.lightning_module)
        self.setup_optimizers(trainer)
        self._check_optimizers(self.optimizers)
        self.ddp = DistributedDataParallel(self.lightning_module, **self._ddp_options)
        self.model = self.ddp
        original = self.optimizers[0]
        self._trainable = [[p.requires_grad for p in g["params"]] for g in original.param_groups]
        scaler = self._loss_scaler or self.precision_plugin.loss_scaler()
        self.optimizer = to_distopt(
            original, self.ddp, basic=self.basic, clip_grad=trainer.gradient_clip_val or None,
            loss_scaler=scaler, **self._optimizer_options,
        )
        for config in self.lr_scheduler_configs:
            repoint_scheduler(config.scheduler, self.optimizer)
        self.optimizers = [self.optimizer]
        self.precision_plugin.optimizer = self.optimizer
        self.setup_precision_plugin()

    def configure_ddp(self) -> None:
        raise NotImplementedError("DistoptStrategy.setup wraps the module in distopt's DDP")

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(
                f"DistoptStrategy clips by the global grad norm only, got "
                f"gradient_clip_algorithm={str(trainer.gradient_clip_algorithm.value)!r}: use "
                "gradient_clip_algorithm='norm' (distopt has no clipping by value)"
            )

    def _check_module(self, module: pl.LightningModule) -> None:
        for name, sub in module.named_modules():
            if isinstance(sub, _WRAPPERS):
                where = f"its submodule '{name}'" if name else "the module itself"
                raise ValueError(
                    f"DistoptStrategy wraps the LightningModule in distopt's DDP, but {where} "
                    f"is already a {type(sub).__module__}.{type(sub).__name__}: reducing its "
                    "grads twice is wrong; build the module unwrapped"
                )

    def _check_optimizers(self, optimizers: list[Any]) -> None:
        module = self.lightning_module
        if not optimizers or isinstance(optimizers[0], _MockOptimizer):
            mode = "automatic" if module.automatic_optimization else "manual"
            raise ValueError(
                f"configure_optimizers returned no optimizer ({mode} optimization): distopt's "
                "step is what applies the reduced grads, so nothing would train. Return the "
                "optimizer from configure_optimizers; with manual optimization, step it as "
                "self.optimizers() returns it (that is distopt's optimizer)"
            )
        if len(optimizers) > 1:
            raise ValueError(
                f"configure_optimizers returned {len(optimizers)} optimizers; DistoptStrategy "
                "turns exactly one into distopt's, which owns all of the module's params: return "
                "one optimizer (param groups give params their own options)"
            )
        check_convertible(optimizers[0])

    # ------------------------------------------------------------------ training

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self.ddp is None:
            yield
            return
        with self.ddp.no_sync():
            yield

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Nothing to do: there is no torch DDP reducer to prepare.

        Args:
            closure_loss: the loss about to be backpropagated; unused.
        """

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Nothing to do: distopt's hooks reduce the grads during backward.

        Args:
            closure_loss: the loss just backpropagated; unused.
        """

    def teardown(self) -> None:
        if self.model is self.ddp and self.ddp is not None:
            self.model = self.lightning_module
        if self.ddp is not None:
            # The module leaves fit a plain module; see [Note: one wrapper per param].
            self.ddp.release()
        # Lightning moves optimizer state to the CPU here; distopt's stays beside its main
        # params, so that trainer.save_checkpoint still works once fit has returned.
        optimizers, self._optimizers = self._optimizers, []
        try:
            super().teardown()
        finally:
            self._optimizers = optimizers

    # ------------------------------------------------------------------ checkpoints

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the distopt optimizer must exist to take its shard of the checkpoint

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores it, resharded

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the distopt checkpoint holds the module's state_dict, written once

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Empty: each rank writes its own shard of the optimizer state in
        ``save_checkpoint``.

        Args:
            optimizer: the optimizer Lightning asks the state of; unused.
        """
        return {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Write distopt's sharded checkpoint beside ``filepath`` and a Lightning checkpoint
        file at ``filepath``; collective. See [Note: Lightning checkpoints under distopt].

        Args:
            checkpoint: Lightning's checkpoint dict; its loop, scheduler and callback state
                go into the sharded checkpoint's ``extra`` (the weights and optimizer state
                are distopt's own).
            filepath: where the Lightning checkpoint file goes; a checkpoint saved there
                before is replaced.
            storage_options: must be None: distopt writes its files itself.
        """
        if storage_options is not None:
            raise TypeError("DistoptStrategy.save_checkpoint takes no storage_options")
        if self.ddp is None or self.optimizer is None:
            raise RuntimeError(
                "DistoptStrategy saves checkpoints of a fit (the distopt optimizer is part of "
                "them); none has run with this strategy"
            )
        path = Path(filepath)
        if self.is_global_zero:
            # Lightning overwrites a checkpoint saved under the same name.
            checkpoint_files.remove(path)
        self.barrier("DistoptStrategy.save_checkpoint")
        extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        sharded = checkpoint_files.sharded_dir(path)
        save_checkpoint(sharded.parent, self.ddp, self.optimizer, extra=extra,
                        name=sharded.name, latest=False)
        failure = None
        if self.is_global_zero:
            try:
                checkpoint_files.write_file(
                    sharded, path, trainable=self._trainable,
                    optimizer=self._torch_optimizer_state and "optimizer_states" in checkpoint)
            except Exception as exc:  # every rank raises it, none waits in Lightning's barrier
                failure = f"cannot write {path} from {sharded}: {type(exc).__name__}: {exc}"
        failure = self.broadcast(failure, src=0)
        if failure:
            raise RuntimeError(failure)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Delete a checkpoint ``save_checkpoint`` wrote, its sharded part with it (rank 0).

        Args:
            filepath: the Lightning checkpoint file, as given to ``save_checkpoint``.
        """
        if self.is_global_zero:
            checkpoint_files.remove(filepath)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict:
        """Load a distopt checkpoint into the module and the optimizer (at any number of
        devices); return the Lightning state saved with it. Collective.

        Args:
            checkpoint_path: a checkpoint file this strategy's ``save_checkpoint`` wrote (its
                sharded part beside it is what is read); only while fitting.
            weights_only: Lightning's choice for ``torch.load``; unused, since the sharded
                checkpoint is read with distopt's checks.
        """
        if self.ddp is None or self.optimizer is None or (
            self.lightning_module.trainer.state.fn != TrainerFn.FITTING
        ):
            raise ValueError(
                "DistoptStrategy restores checkpoints when fitting, Trainer.fit(ckpt_path=...); "
                "for validate/test/predict, load the weights in the module first (a plain file "
                "from distopt.export_checkpoint loads with torch.load)"
            )
        sharded = checkpoint_files.resolve(checkpoint_path)
        if sharded is None:
            raise ValueError(
                f"{checkpoint_path} is not a distopt checkpoint (no "
                f"{checkpoint_files.sharded_dir(checkpoint_path).name} beside it): "
                "DistoptStrategy resumes from the checkpoints its trainer.save_checkpoint "
                "writes, the file with its sharded part"
            )
        extra = load_checkpoint(sharded, self.ddp, self.optimizer)
        return dict(extra or {})

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing to do: ``load_checkpoint`` put the weights in place already.

        Args:
            checkpoint: the Lightning state ``load_checkpoint`` returned; unused.
            strict: Lightning's strictness; unused, since distopt's load checks every entry.
        """

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing to do: ``load_checkpoint`` loaded the optimizer's state already.

        Args:
            checkpoint: the Lightning state ``load_checkpoint`` returned; unused.
        """


if DistoptStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(
        DistoptStrategy.strategy_name, DistoptStrategy,
        description="distopt's DDP and distributed (ZeRO) optimizer",
    )
