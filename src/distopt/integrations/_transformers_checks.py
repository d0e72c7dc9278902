"""What ``DistoptTrainer`` checks of the Trainer's arguments before anything is built: the
features distopt cannot honour, refused by name with the fix ([Note: distopt inside the
Trainer] in integrations/transformers.py)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers.trainer_optimizer import is_optimizer_factory

import distopt

from ..optim.kinds import ELEMENTWISE_OPTIMIZERS, check_optimizer_cls

# The Trainer's optim names distopt shards (through a custom optimizer class, any torch one).
SUPPORTED_OPTIM = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop", "adafactor")


@dataclass(frozen=True, slots=True)
class _Given:
    """The Trainer arguments the checks read, however they were passed."""

    args: Any
    model: Any
    optimizers: tuple
    optimizer_cls_and_kwargs: Any


def bound_trainer_arguments(args: tuple, kwargs: dict) -> _Given:
    bound = inspect.signature(transformers.Trainer.__init__).bind(None, *args, **kwargs)
    given = bound.arguments
    return _Given(
        args=given.get("args"),
        model=given.get("model"),
        optimizers=tuple(given.get("optimizers") or (None, None)),
        optimizer_cls_and_kwargs=given.get("optimizer_cls_and_kwargs"),
    )


def is_hf_adafactor(optimizer_cls: type) -> bool:
    return issubclass(optimizer_cls, transformers.optimization.Adafactor)


def check_unsupported(given: _Given) -> None:
    """Raise one ValueError naming the first argument distopt cannot honour, and the fix.

    Pure checks of the arguments (no collective), so every rank raises alike, before training.
    """
    args = given.args
    problems: list[str] = []
    if args is not None:
        problems += _training_argument_problems(args)
    if any(x is not None for x in given.optimizers):
        problems.append(
            "optimizers: DistoptTrainer builds distopt's DistributedOptimizer over the model "
            "it wraps, so it cannot take a ready optimizer or scheduler; pass "
            "optimizer_cls_and_kwargs=(torch.optim.AdamW, {...}) and lr_scheduler_type instead"
        )
    if given.optimizer_cls_and_kwargs is not None:
        cls = given.optimizer_cls_and_kwargs[0]
        if isinstance(cls, type) and issubclass(cls, torch.optim.LBFGS):
            problems.append(
                "optimizer_cls_and_kwargs: LBFGS needs a closure that re-runs the whole model "
                "in its step, which the Trainer's loop cannot give and distopt's shards cannot "
                "take; pick an optimizer without one, such as torch.optim.AdamW"
            )
        elif is_optimizer_factory(cls):
            problems.append(
                f"optimizer_cls_and_kwargs: {cls!r} is not a torch.optim.Optimizer class; "
                "pass a class distopt can shard, such as torch.optim.AdamW or torch.optim.Muon"
            )
        else:
            try:
                check_optimizer_cls(cls, "optimizer_cls_and_kwargs")
            except TypeError as exc:
                problems.append(str(exc))
    if isinstance(given.model, distopt.DistributedDataParallel):
        problems.append(
            "model: it is a distopt.DistributedDataParallel already; pass the model it wraps "
            "(ddp.module): DistoptTrainer wraps it itself, taking it over from the old wrapper"
        )
    tp_size = getattr(given.model, "tp_size", None) or 1
    if tp_size > 1:
        problems.append(
            "model: it is sharded for tensor parallelism at load time (tp_plan); load it "
            "without tp_plan for DistoptTrainer, or use distopt's tensor parallelism by hand "
            "(docs/tensor-parallel.md)"
        )
    if problems:
        raise ValueError("DistoptTrainer cannot honour " + problems[0])


def _training_argument_problems(args: Any) -> list[str]:
    problems = []
    if args.deepspeed:
        problems.append(
            "deepspeed: distopt replaces DeepSpeed's ZeRO-1/2 (sharded optimizer state and "
            "grads); drop the DeepSpeed config"
        )
    if args.fsdp:
        problems.append(
            "fsdp: distopt shards optimizer state and grads, not params (ZeRO-1/2, not "
            "FSDP's ZeRO-3); drop fsdp, or use the plain Trainer for FSDP"
        )
    if getattr(args, "parallelism_config", None) is not None:
        problems.append(
            "parallelism_config: DistoptTrainer is data parallel only; drop parallelism_config"
        )
    if args.torch_compile:
        problems.append(
            "torch_compile: DistoptTrainer does not compile the wrapped model; compile its "
            "blocks before building the trainer (for layer in model.model.layers: "
            "layer.compile()), which distopt supports, and drop torch_compile"
        )
    if args.auto_find_batch_size:
        problems.append(
            "auto_find_batch_size: its retries rebuild the model's wrapper; set "
            "per_device_train_batch_size yourself"
        )
    if args.fp16_full_eval or args.bf16_full_eval:
        problems.append(
            "fp16_full_eval/bf16_full_eval: they cast the model in place, and its params live "
            "in distopt's buffers; evaluate with fp16=True or bf16=True (autocast) instead"
        )
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in SUPPORTED_OPTIM:
        elementwise = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        problems.append(
            f"optim={optim!r}: distopt shards {', '.join(SUPPORTED_OPTIM)} (and, through "
            f"optimizer_cls_and_kwargs, any of {elementwise}, torch.optim.Muon or "
            "torch.optim.Adafactor); optimizers that need a closure, quantized state, "
            "low-rank projections or the whole model are not shardable: pick one of those"
        )
    return problems
