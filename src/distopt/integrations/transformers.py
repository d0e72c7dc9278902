"""distopt under the Hugging Face Trainer: ``DistoptTrainer`` in place of ``transformers.Trainer``.

[Note: distopt inside the Trainer]
The Trainer keeps its loop (data sharding, gradient accumulation, logging, evaluation, saving,
callbacks) and distopt takes over the four things a data-parallel ZeRO-1/2 run changes. Each is
one of the Trainer's documented extension points, overridden here:

* the model: ``_wrap_model`` returns a ``distopt.DistributedDataParallel`` (params and grads in
  contiguous buckets; grads reduce-scattered during backward), never torch's DDP, for training
  and evaluation alike. Accelerate sees an already wrapped model and leaves it alone.
* the optimizer: ``create_optimizer`` builds a ``distopt.DistributedOptimizer`` over the class,
  options and weight-decay groups the Trainer would have built (``optim``, ``learning_rate``,
  ``adam_*``, ``weight_decay``, ``optim_args``, ``optimizer_cls_and_kwargs``), and the
  Trainer's LR scheduler is built on it, so it drives distopt's param groups. ``max_grad_norm``
  is distopt's global clip norm and the ``grad_norm`` the Trainer logs is distopt's.
* precision: the Trainer's ``bf16``/``fp16`` keep their meaning (autocast over fp32 params);
  fp16 scales the loss with ``distopt.DynamicLossScaler``, so an overflowing step is skipped on
  every rank and, as with the Trainer's own scaler, the LR schedule does not advance. A model
  loaded in bf16 gets fp32 main params in distopt's shards.
* checkpoints: ``checkpoint-N/distopt/`` holds ``distopt.save_checkpoint``'s sharded,
  reshardable state (main params, optimizer state, loss scale); a run saved on d ranks resumes
  on any number. The Trainer writes the rest of ``checkpoint-N`` (weights, trainer state,
  scheduler, RNG) as usual.

The Trainer and accelerate look through a DDP wrapper in a few places (label smoothing's
causal-LM check, ``_is_peft_model``, saving, a ``compute_loss`` override's
``self.accelerator.unwrap_model(model)``), all through the accelerator's ``unwrap_model``, whose
list of wrapper classes is accelerate's own. This trainer's accelerator gets an ``unwrap_model``
that also takes distopt's wrapper off, so each of them sees the user's model exactly as under
torch's DDP. The wrapper is released when ``train()`` returns or raises (see [Note: one wrapper
per param] in distopt/param_owners.py): the model leaves the trainer a plain module, which
another trainer (a second ``DistoptTrainer``, the plain Trainer) can wrap; a later ``train()``
of this trainer wraps it anew and carries the optimizer's state over, as the Trainer keeps its
optimizer across ``train()`` calls. A checkpoint also holds ``optimizer.pt``, the optimizer
state in torch.optim's format (distopt's export of its own checkpoint), so that the plain
Trainer resumes it with the optimizer state and not a fresh one.

A subclass is the Trainer's own way to change how it builds its optimizer and wraps its model,
so the change to a script is one name. Gradient accumulation needs nothing: the Trainer runs
all but the last micro-batch of a step inside ``model.no_sync()``, which is distopt's (no
communication at all). Arguments distopt cannot honour raise one ``ValueError`` naming the
argument and the fix when the trainer is built, on every rank alike, before anything runs.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._version import pip_install

try:
    import accelerate  # noqa: F401  (the Trainer's own dependency, checked here with the rest)
    import transformers
except ImportError as exc:  # one line that says what to install, not a deep traceback
    raise ImportError(
        f"distopt.integrations.transformers needs transformers and accelerate: {pip_install('hf')}"
    ) from exc

import distopt

from ._transformers_checks import (
    bound_trainer_arguments,
    check_unsupported,
    is_hf_adafactor,
)
from ._transformers_optimizer import (
    ScaledBackward,
    TrainerOptimizer,
    carry_state,
    trainer_optimizer_state,
)

__all__ = ["DISTOPT_CHECKPOINT_DIR", "DistoptArguments", "DistoptTrainer", "TrainerOptimizer"]

DISTOPT_CHECKPOINT_DIR = "distopt"
"""The folder inside the Trainer's ``checkpoint-N`` that holds distopt's sharded state."""
SCHEDULER_FILE = "scheduler.pt"  # the Trainer's name for it, so its tools find it
OPTIMIZER_FILE = "optimizer.pt"  # the Trainer's name for the torch.optim state it resumes

# ``optim`` names whose class and options distopt can shard (the rest are refused, see below).


@dataclass(frozen=True, kw_only=True, slots=True)
class DistoptArguments:
    """Options of distopt's own that ``TrainingArguments`` has no field for."""

    bucket_size: int | None = None
    """Elements per bucket; None: ``ddp_bucket_cap_mb`` if set, else distopt's default."""
    overlap_grad_reduce: bool = True
    """Reduce-scatter each bucket during backward as soon as its grads are complete."""
    grad_dtype: torch.dtype | None = torch.float32
    """dtype of the grad buffer and the reduction; None: each param's own dtype."""
    shard_grads: bool = False
    """Keep only this rank's reduced shard of the grads between steps (ZeRO-2): every
    micro-batch of ``gradient_accumulation_steps`` reduce-scatters."""
    shard_params: bool = False
    """Keep only this rank's shard of the params too, gathered around the forward and
    backward that use them (ZeRO-3; implies ``shard_grads``); saved models are gathered
    whole."""
    fp16_loss_scaler: Callable[[], distopt.DynamicLossScaler | distopt.ConstantLossScaler] = (
        distopt.DynamicLossScaler
    )
    """Makes the loss scaler of ``fp16=True`` runs (e.g. ``lambda:
    distopt.DynamicLossScaler(initial_scale=2.0**12)``)."""
    muon_adjust_lr_fn: str = "match_rms_adamw"
    """Muon's step-size rule when ``optimizer_cls_and_kwargs`` names ``torch.optim.Muon`` and
    does not set it: "match_rms_adamw" lets Muon share the Trainer's one ``learning_rate``."""
    torch_optimizer_file: bool = True
    """Also write ``checkpoint-N/optimizer.pt``, the optimizer state in torch.optim's format, so
    that the plain ``transformers.Trainer`` resumes the checkpoint with it. The main process
    reads the whole optimizer state back from distopt's checkpoint and writes it once more (one
    tensor at a time): turn it off where that costs too much. Runs whose param groups use
    several optimizer classes (Muon + AdamW) have no torch.optim counterpart and never write
    it."""

    def __post_init__(self) -> None:
        if self.bucket_size is not None and (
            isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int)
            or self.bucket_size < 1
        ):
            raise ValueError(
                f"bucket_size must be a positive int or None, got {self.bucket_size!r}"
            )


class DistoptTrainer(transformers.Trainer):
    """``transformers.Trainer`` with distopt's DDP and DistributedOptimizer underneath.

    Takes the Trainer's arguments, plus ``distopt_args`` (``DistoptArguments``). Launch as any
    Trainer script: ``torchrun --nproc_per_node N train.py`` (or ``accelerate launch``). See
    [Note: distopt inside the Trainer].

    Args:
        *args: the Trainer's positional arguments (``model``, ``args``, ...), passed on.
            Those distopt cannot honour are refused here, on every rank alike, naming the fix.
        distopt_args: distopt's own options, which ``TrainingArguments`` has no field for;
            None: ``DistoptArguments()``'s defaults.
        **kwargs: the Trainer's keyword arguments, passed on and checked alike: a ready
            ``optimizers=(optimizer, scheduler)`` is refused (pass
            ``optimizer_cls_and_kwargs`` instead: the optimizer is built over distopt's
            wrapper), as are the ``TrainingArguments`` distopt cannot honour.
    """

    def __init__(self, *args: Any, distopt_args: DistoptArguments | None = None,
                 **kwargs: Any) -> None:
        check_unsupported(bound_trainer_arguments(args, kwargs))
        self.distopt_args = distopt_args or DistoptArguments()
        self.distopt_model: distopt.DistributedDataParallel | None = None
        # Filled in place after each step with distopt's norm; see _clip_grad_norm.
        self._grad_norm = torch.zeros(())
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ model and optimizer

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # Precision is distopt's (autocast here, its loss scaler for fp16): accelerate must not
        # scale the loss or wrap the model's forward as well.
        return {**super()._build_accelerator_args(**kwargs), "mixed_precision": "no"}

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        _see_through_distopt(self.accelerator)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; the model leaves it a plain module (distopt's wrapper released),
        whether training ends or raises. See [Note: distopt inside the Trainer].

        Args:
            *args: ``Trainer.train``'s arguments (``resume_from_checkpoint``, ...), passed
                on; a checkpoint to resume must be one a DistoptTrainer saved.
            **kwargs: the same, by keyword.
        """
        try:
            output = super().train(*args, **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):  # the error that ended training is the one
                self._release_wrapper()
            raise
        self._release_wrapper()
        return output

    def _release_wrapper(self) -> None:
        if self.distopt_model is not None:
            self.distopt_model.release()

    def _live_ddp(self) -> distopt.DistributedDataParallel | None:
        ddp = self.distopt_model
        live = ddp is not None and not ddp.released and ddp.module is self.model
        return ddp if live else None

    def _distopt_ddp(self) -> distopt.DistributedDataParallel:
        """distopt's DDP over ``self.model``: the live one, or a new one (which takes the
        model over from any wrapper that still holds it)."""
        if self._live_ddp() is None:
            self.distopt_model = distopt.DistributedDataParallel(
                self.model,
                grad_dtype=self.distopt_args.grad_dtype,
                bucket_size=self._bucket_size(),
                overlap_grad_reduce=self.distopt_args.overlap_grad_reduce,
                find_unused_parameters=self._find_unused_parameters(),
                shard_grads=self.distopt_args.shard_grads,
                shard_params=self.distopt_args.shard_params,
                broadcast_buffers=self._broadcast_buffers(),
            )
        return self.distopt_model

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; with sharded params the weights are gathered whole on every
        rank first (a collective) and written by the main process.

        Args:
            output_dir: the folder the model is saved in; None: ``args.output_dir``.
        """
        ddp = self._live_ddp()
        if ddp is None or not ddp.options.shard_params:
            super().save_model(output_dir, _internal_call)
            return
        state_dict = ddp.full_state_dict()
        self._save(output_dir or self.args.output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _bucket_size(self) -> int | None:
        if self.distopt_args.bucket_size is not None:
            return self.distopt_args.bucket_size
        if self.args.ddp_bucket_cap_mb is not None:  # torch DDP's cap, in fp32 grad elements
            return max(1, int(self.args.ddp_bucket_cap_mb * 2**20) // 4)
        return None

    def _broadcast_buffers(self) -> bool:
        # The Trainer passes ddp_broadcast_buffers to torch DDP when set; its default is True.
        given = self.args.ddp_broadcast_buffers
        return True if given is None else bool(given)

    def _find_unused_parameters(self) -> bool:
        # The Trainer's rule for torch DDP: a param no rank used skips the step (grad None).
        if self.args.ddp_find_unused_parameters is not None:
            return self.args.ddp_find_unused_parameters
        if isinstance(self.model, transformers.PreTrainedModel):
            checkpointing = self.model.is_activation_checkpointing
            return not (checkpointing or self.args.activation_checkpointing)
        return True

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """``Trainer.create_optimizer``: distopt's ``DistributedOptimizer`` over the wrapped
        model, with the Trainer's optimizer class, options, weight-decay groups and
        ``max_grad_norm`` (Muon for the hidden matrices and AdamW for the rest when the class
        is ``torch.optim.Muon``), seen by the Trainer through a ``TrainerOptimizer``. A later
        ``train()`` builds a new one over the new wrapper, its state carried over.

        Args:
            model: the Trainer's argument; unused: the optimizer is built over ``self.model``
                as distopt wraps it.
        """
        previous = self.optimizer
        if isinstance(previous, TrainerOptimizer) and (
            previous.distributed.models[0] is not self._live_ddp()
        ):
            # A later train(): the model was wrapped anew, the Trainer keeps its optimizer.
            self.optimizer = None
        if self.optimizer is None:
            ddp = self._distopt_ddp()
            optimizer_cls, groups, kwargs = self._distopt_param_groups()
            fp16 = self.args.mixed_precision == "fp16"
            scaler = self.distopt_args.fp16_loss_scaler() if fp16 else None
            max_norm = self.args.max_grad_norm
            opt = distopt.DistributedOptimizer(
                ddp, optimizer_cls, params=groups,
                # An infinite max norm still computes the norm the Trainer logs, and clips by 1.
                clip_grad=max_norm if max_norm and max_norm > 0 else float("inf"),
                loss_scaler=scaler, **kwargs,
            )
            if isinstance(previous, TrainerOptimizer):
                carry_state(previous.distributed, opt)
            self.optimizer = TrainerOptimizer(opt, self._grad_norm)
        return self.optimizer

    def _distopt_param_groups(self) -> tuple[type[torch.optim.Optimizer], list[dict], dict]:
        """The Trainer's optimizer class, options and weight-decay groups, for distopt."""
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        kwargs = dict(kwargs)
        if is_hf_adafactor(optimizer_cls):
            # It reads whole params (row and column statistics): each is owned by one rank.
            distopt.register_whole_tensor_optimizer(optimizer_cls)
        decay = set(self.get_decay_parameter_names(self.model))
        trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in trainable if n in decay],
             "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
        ]
        # The Trainer keeps an empty group, distopt drops it: optimizer.pt puts it back.
        self._trainer_group_slots = [None if g["params"] else g["weight_decay"] for g in groups]
        if issubclass(optimizer_cls, torch.optim.Muon):
            groups = self._muon_groups(groups, kwargs)
        return optimizer_cls, [g for g in groups if g["params"]], kwargs

    def _muon_groups(self, groups: list[dict], kwargs: dict) -> list[dict]:
        """Muon for the hidden matrices, AdamW (the Trainer's adam_* options) for the rest."""
        from distopt.optim.recipes import hidden_matrices

        kwargs.setdefault("lr", self.args.learning_rate)
        kwargs.setdefault("adjust_lr_fn", self.distopt_args.muon_adjust_lr_fn)
        matrices = set(hidden_matrices(self.model)[0])
        adamw = {"optimizer": torch.optim.AdamW, "lr": self.args.learning_rate,
                 "betas": (self.args.adam_beta1, self.args.adam_beta2),
                 "eps": self.args.adam_epsilon}
        split = []
        for group in groups:
            split.append({**group, "params": [p for p in group["params"] if p in matrices]})
            split.append({**group, **adamw,
                          "params": [p for p in group["params"] if p not in matrices]})
        return split

    def _wrap_model(self, model: nn.Module, training: bool = True,
                    dataloader: Any = None) -> nn.Module:
        if training:
            return self._distopt_ddp()
        # Evaluation inside train() goes through the wrapper: given the bare model, accelerate
        # would move it to "cpu:0" (a copy on CPU), cutting its params loose from distopt's
        # buffers. Outside, the model is plain (released) and evaluates as under the Trainer.
        live = self._live_ddp()
        return self.model if live is None else live

    # ------------------------------------------------------------------ step

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        """The forward's autocast: ``torch.autocast`` to bf16 or fp16 for those mixed
        precisions (distopt's, since accelerate's is turned off), else the Trainer's.

        Args:
            cache_enabled: whether autocast caches the casts of weights within the forward,
                as ``torch.autocast``'s; True by default.
        """
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.args.mixed_precision)
        if dtype is None:
            return super().autocast_smart_context_manager(cache_enabled)
        return torch.autocast(self.args.device.type, dtype=dtype, cache_enabled=cache_enabled)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """``Trainer.compute_loss``; in fp16 training, backward sees the loss times the loss
        scale while the Trainer logs the loss itself.

        Args:
            model: the model to run, distopt's wrapper while training.
            inputs: the batch, as the Trainer passes it.
            return_outputs: return ``(loss, outputs)`` instead of the loss, as the Trainer's.
            num_items_in_batch: the tokens (or items) the loss is averaged over across the
                gradient-accumulation steps, as the Trainer's; None: the model's own
                averaging.
        """
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if scaler is None or not (model.training and torch.is_grad_enabled()):
            return result
        # fp16: backward sees the loss times the scale, the Trainer logs the loss itself.
        if return_outputs:
            loss, outputs = result
            return ScaledBackward.apply(loss, scaler.scale), outputs
        return ScaledBackward.apply(result, scaler.scale)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        # distopt clips inside its step, with one global norm across the shards; the Trainer
        # reads the value it returns only after the step, when this tensor holds that norm.
        return self._grad_norm

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> torch.Tensor:
        return self._grad_norm

    # ------------------------------------------------------------------ checkpoints

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        opt = self._distributed_optimizer()
        saved = distopt.save_checkpoint(Path(output_dir) / DISTOPT_CHECKPOINT_DIR, opt.models[0],
                                        opt)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))
            if self.distopt_args.torch_optimizer_file and len(opt.optimizers) == 1:
                # Written last, from the complete checkpoint: the plain Trainer resumes a
                # checkpoint-N with its optimizer only where optimizer.pt exists.
                distopt.export_checkpoint(
                    saved, Path(output_dir) / OPTIMIZER_FILE, verify=False,
                    transform=functools.partial(trainer_optimizer_state,
                                                slots=self._trainer_group_slots),
                )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = Path(checkpoint) / DISTOPT_CHECKPOINT_DIR
        if not path.is_dir():
            raise ValueError(
                f"resume_from_checkpoint: {checkpoint} holds no distopt state ({path.name}/); "
                "resume a DistoptTrainer from a checkpoint a DistoptTrainer saved, or pass "
                "resume_from_checkpoint=None and load the weights yourself"
            )
        opt = self._distributed_optimizer()
        distopt.load_checkpoint(path, opt.models[0], opt)
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True)
        )

    def _distributed_optimizer(self) -> distopt.DistributedOptimizer:
        if not isinstance(self.optimizer, TrainerOptimizer):
            raise RuntimeError("the distopt optimizer is built when training starts")
        return self.optimizer.distributed


def _see_through_distopt(accelerator: Any) -> None:
    """Make ``accelerator.unwrap_model`` take distopt's wrapper off too, as it takes torch's
    DDP off: the Trainer (label smoothing, ``_is_peft_model``, saving) and ``compute_loss``
    overrides then see the user's model. Only this trainer's accelerator changes."""
    unwrap = accelerator.unwrap_model

    @functools.wraps(unwrap)
    def unwrap_model(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        model = unwrap(model, *args, **kwargs)
        while isinstance(model, distopt.DistributedDataParallel):
            model = unwrap(model.module, *args, **kwargs)
        return model

    accelerator.unwrap_model = unwrap_model
