"""DistoptTrainer against the Hugging Face Trainer's own DDP and a single process.

A tiny Llama built from a config (random init) trains 30 steps on 2 gloo ranks with gradient
accumulation 2, max_grad_norm 1.0, warm-up + cosine and an evaluation every 10 steps, once under
DistoptTrainer (saving every 10 steps, keeping 2) and once under transformers.Trainer (torch
DDP). One plain process trains the same global batches with the Trainer alone. Then the
checkpoint saved at step 10 on 2 ranks is resumed on 1 and on 4 ranks, each run to step 30.

Three process launches in all (d = 2, 1, 4), each running its cases in one group; the
assertions share their results.
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import shutil
import tempfile
import traceback
from multiprocessing import connection
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_harness import context, yield_gloo_io_to_compute
from helpers import WEIGHTS_TO_RELATIVE, autocast_weights_tol, muon_weights_tol

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS, SAVE_AT, GLOBAL_BATCH, ACCUMULATION = 30, 10, 8, 2
# This Llama's AdamW runs (lr 3e-3 after a warm-up from 0, clipped at 1.0) in fp32 stay within
# 4.4e-7 of the same 30 steps in fp64 (weights; 1.5e-7 relative for losses and grad norms),
# 1.5e-7 (7.6e-8) over 4 steps, whatever order the batch's grads are summed in (emulated in plain
# torch, summed over 1, 2 or 4 ranks either way). Two runs lie within twice that of each other,
# twice again for orders not tried (helpers.FP32_TOL's rule): 1.8e-6 over 30 steps, 6e-7 over 4.
# TOL bounds the 30-step runs (and SGD's and Adafactor's, whose steps scale with the grads), its
# losses and grad norms (about 4.2 and 0.8) relative to their size; EXACT the 4-step ones.
TOL = 1e-5
TIMEOUT = datetime.timedelta(seconds=120)


# ---------------------------------------------------------------------- what every run shares


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences, the same on every rank (a fixed generator)."""

    def __init__(self, n: int, seed: int, seq: int = 16, vocab: int = 64) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (n, seq), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def training_arguments(output_dir: Path, world: int, **overrides: Any):
    from transformers import TrainingArguments

    options = dict(
        output_dir=str(output_dir), use_cpu=True, ddp_backend="gloo" if world > 1 else None,
        per_device_train_batch_size=GLOBAL_BATCH // ACCUMULATION // world,
        per_device_eval_batch_size=4, gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS, learning_rate=3e-3, warmup_steps=5, lr_scheduler_type="cosine",
        weight_decay=0.1, max_grad_norm=1.0, logging_steps=1, eval_strategy="steps",
        eval_steps=SAVE_AT, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
    )
    options.update(overrides)
    return TrainingArguments(**options)


def run_record(trainer) -> dict[str, Any]:
    """What a run produced: per-step loss, grad norm and LR, eval losses, the final weights."""
    history = trainer.state.log_history
    return {
        "steps": [h["step"] for h in history if "loss" in h],
        "loss": [h["loss"] for h in history if "loss" in h],
        "grad_norm": [h["grad_norm"] for h in history if "loss" in h],
        "lr": [h["learning_rate"] for h in history if "loss" in h],
        "eval_loss": {h["step"]: h["eval_loss"] for h in history if "eval_loss" in h},
        "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
    }


def state_bytes_of_ddp_run(trainer) -> dict[str, int]:
    """Bytes the torch-DDP run holds per rank: params, .grad and the optimizer's moments."""
    from distopt.memory import storage_bytes

    params = list(trainer.model.parameters())
    opt = trainer.optimizer.optimizer  # accelerate's wrapper around torch.optim.AdamW
    seen: set[int] = set()
    return {
        "num_params": sum(p.numel() for p in params),
        "params": storage_bytes(params, seen),
        "grads": storage_bytes((p.grad for p in params), seen),
        "optimizer_state": storage_bytes(
            (v for s in opt.state.values() for k, v in s.items() if k != "step"), seen),
    }


def measuring_callback(trainer, measure, into: dict[str, Any]):
    """Measures state right after the first optimizer step, before the grads are dropped, and
    counts distopt's collectives in each micro-batch."""
    from transformers import TrainerCallback

    class Measure(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.calls = _collective_calls(trainer)

        def on_substep_end(self, args, state, control, **kwargs):
            into.setdefault("calls_in_accumulation", []).append(
                _collective_calls(trainer) - self.calls)

        def on_optimizer_step(self, args, state, control, **kwargs):
            into.setdefault("calls_per_step", []).append(_collective_calls(trainer) - self.calls)
            if "memory" not in into:
                into["memory"] = measure(trainer)

    return Measure()


def _collective_calls(trainer) -> int:
    model = getattr(trainer, "distopt_model", None)
    return 0 if model is None else sum(model.comm_stats.calls.values())


# ---------------------------------------------------------------------- cases (in the ranks)


def set_launcher_environment() -> None:
    """What torchrun would set, for accelerate to find the group the harness made."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")


def refused_arguments(root: Path) -> dict[str, str]:
    """The error message for each argument DistoptTrainer cannot honour."""
    from transformers import TrainingArguments

    from distopt.integrations.transformers import DistoptTrainer

    set_launcher_environment()
    base = training_arguments(root / "refused", dist.get_world_size())
    model, data = tiny_llama(), TokenDataset(8, seed=1)
    cases = {
        "fsdp": {"args": training_arguments(root / "refused", 2, fsdp="full_shard")},
        "torch_compile": {"args": training_arguments(root / "refused", 2, torch_compile=True)},
        "optim": {"args": training_arguments(root / "refused", 2, optim="adamw_torch_4bit")},
        "optimizers": {"args": base, "optimizers": (torch.optim.AdamW(model.parameters()), None)},
        "optimizer_cls_and_kwargs": {"args": base,
                                     "optimizer_cls_and_kwargs": (torch.optim.LBFGS, {})},
    }
    import distopt

    cases["model"] = {"args": base, "model": distopt.DistributedDataParallel(tiny_llama())}
    deepspeed = TrainingArguments.__new__(TrainingArguments)  # deepspeed itself is not installed
    deepspeed.__dict__.update(vars(base), deepspeed={"zero_optimization": {"stage": 2}})
    cases["deepspeed"] = {"args": deepspeed}
    messages = {}
    for name, kwargs in cases.items():
        try:
            DistoptTrainer(**{"model": model, "train_dataset": data, **kwargs})
            messages[name] = "no error"
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


def broadcast_buffers_argument(root: Path) -> dict[Any, bool]:
    """distopt's broadcast_buffers under each ddp_broadcast_buffers (unset, True, False)."""
    from distopt.integrations.transformers import DistoptTrainer

    set_launcher_environment()
    taken = {}
    for given in (None, True, False):
        args = training_arguments(root / "buffers", dist.get_world_size(),
                                  ddp_broadcast_buffers=given, eval_strategy="no")
        trainer = DistoptTrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(8, 1))
        taken[given] = trainer._distopt_ddp().broadcast_buffers
    return taken


def train_distopt(root: Path) -> dict[str, Any]:
    """DistoptTrainer on this group, saving every SAVE_AT steps (the step-10 one kept aside)."""
    from transformers import TrainerCallback

    import distopt
    from distopt.integrations.transformers import DistoptTrainer

    set_launcher_environment()
    world = dist.get_world_size()
    out = root / "distopt"
    args = training_arguments(out, world, save_strategy="steps", save_steps=SAVE_AT,
                              save_total_limit=2)
    trainer = DistoptTrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(64, 0),
                             eval_dataset=TokenDataset(16, 1))
    measured: dict[str, Any] = {}
    trainer.add_callback(measuring_callback(
        trainer, lambda t: distopt.measure_state_bytes(t.optimizer.distributed).as_dict(),
        measured))

    class KeepFirstCheckpoint(TrainerCallback):  # save_total_limit deletes it at step 30
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == SAVE_AT and args.process_index == 0:
                shutil.copytree(out / f"checkpoint-{SAVE_AT}", root / "saved")

    trainer.add_callback(KeepFirstCheckpoint())
    trainer.train()
    wrapped = trainer.model_wrapped
    return {
        **run_record(trainer), **measured,
        "wrapper": type(wrapped).__module__ + "." + type(wrapped).__name__,
        "torch_ddp_inside": any(isinstance(m, torch.nn.parallel.DistributedDataParallel)
                                for m in wrapped.modules()),
        "checkpoints": sorted(p.name for p in out.iterdir()),
        "bucket_padding": sum(buf.layout.numel - sum(p.numel() for p in buf.params)
                              for buf in trainer.distopt_model.flat_buffers),
    }


def train_plain(root: Path) -> dict[str, Any]:
    """transformers.Trainer itself: torch DDP on a group, nothing around it on one process."""
    from transformers import Trainer

    set_launcher_environment()
    world = dist.get_world_size() if dist.is_initialized() else 1
    trainer = Trainer(model=tiny_llama(), args=training_arguments(root / f"plain{world}", world),
                      train_dataset=TokenDataset(64, 0), eval_dataset=TokenDataset(16, 1))
    measured: dict[str, Any] = {}
    trainer.add_callback(measuring_callback(trainer, state_bytes_of_ddp_run, measured))
    trainer.train()
    return {**run_record(trainer), **measured, "wrapper": type(trainer.model_wrapped).__name__}


def resume(root: Path) -> dict[str, Any]:
    """DistoptTrainer resumed from the step-10 checkpoint of the 2-rank run, to step 30."""
    from distopt.integrations.transformers import DistoptTrainer

    set_launcher_environment()
    world = dist.get_world_size() if dist.is_initialized() else 1
    args = training_arguments(root / f"resumed{world}", world)
    trainer = DistoptTrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(64, 0),
                             eval_dataset=TokenDataset(16, 1))
    trainer.train(resume_from_checkpoint=str(root / "saved"))
    return run_record(trainer)


def looking(cls: type, seen: list[dict[str, Any]]) -> type:
    """``cls`` with a compute_loss override that records what it sees through the wrapper, as
    a user's override would look: the accelerator's unwrap, ``model.module``, PEFT, the loss
    kwargs and item counts, and (once) a greedy generate of the unwrapped model."""
    from transformers.trainer_utils import _is_peft_model

    class Looking(cls):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            unwrapped = self.accelerator.unwrap_model(model)
            record = {
                "unwrapped": type(unwrapped).__name__,
                "module": type(getattr(model, "module", model)).__name__,
                "peft": _is_peft_model(unwrapped),
                "accepts_loss_kwargs": self.model_accepts_loss_kwargs,
                "num_items": None if num_items_in_batch is None else int(num_items_in_batch),
                "label_smoother": self.label_smoother is not None,
            }
            if not seen:
                with torch.no_grad():
                    record["generated"] = unwrapped.generate(
                        inputs["input_ids"][:1, :4], attention_mask=torch.ones(1, 4),
                        max_new_tokens=3, do_sample=False, pad_token_id=0).tolist()
            seen.append(record)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    return Looking


EXACT = 1e-6  # label smoothing and trainers in turn: 4 steps each, see TOL
SHORT_STEPS = 4


def train_label_smoothing(root: Path, plain: bool) -> dict[str, Any]:
    """A causal LM with label_smoothing_factor=0.1 (the Trainer shifts the labels for it only
    when it sees through the wrapper that the model is a causal LM)."""
    from transformers import Trainer

    from distopt.integrations.transformers import DistoptTrainer

    set_launcher_environment()
    seen: list[dict[str, Any]] = []
    args = training_arguments(root / f"smoothing-{plain}", dist.get_world_size(),
                              max_steps=SHORT_STEPS, eval_strategy="no",
                              label_smoothing_factor=0.1)
    trainer = looking(Trainer if plain else DistoptTrainer, seen)(
        model=tiny_llama(), args=args, train_dataset=TokenDataset(64, 0))
    trainer.train()
    return {**run_record(trainer), "seen": seen}


def train_in_turn(root: Path, plain: bool) -> dict[str, Any]:
    """One model trained by a trainer, by the same trainer again (it keeps its optimizer), then
    by a second trainer (a fresh optimizer): each run's record. distopt's wrapper is released
    between them, and the model ends as a plain module."""
    from transformers import Trainer

    from distopt.integrations.transformers import DistoptTrainer

    set_launcher_environment()
    cls = Trainer if plain else DistoptTrainer
    world = dist.get_world_size()
    model = tiny_llama()
    runs = []
    first = cls(model=model, args=training_arguments(
        root / f"turn-a-{plain}", world, max_steps=SHORT_STEPS, eval_strategy="no"),
        train_dataset=TokenDataset(64, 0))
    for trainer, data_seed in ((first, 0), (first, 0), (None, 1)):
        if trainer is None:
            trainer = cls(model=model, args=training_arguments(
                root / f"turn-b-{plain}", world, max_steps=SHORT_STEPS, eval_strategy="no",
                learning_rate=1e-3), train_dataset=TokenDataset(64, data_seed))
        trainer.train()
        runs.append(run_record(trainer))
    params = list(model.parameters())
    return {"runs": runs, "hooks_left": sum(len(p._post_accumulate_grad_hooks or {})
                                            for p in params),
            "main_grads_left": sum(hasattr(p, "main_grad") for p in params),
            # Outside train(), on the plain model, as the Trainer evaluates.
            "eval_loss": trainer.evaluate(eval_dataset=TokenDataset(16, 1))["eval_loss"]}


PLAIN_RESUME_AT = 20


def resume_plain(root: Path) -> dict[str, Any]:
    """transformers.Trainer (torch DDP) resumed from the 2-rank DistoptTrainer run's step-20
    checkpoint (the last but one, which save_total_limit kept)."""
    from transformers import Trainer

    set_launcher_environment()
    world = dist.get_world_size()
    trainer = Trainer(model=tiny_llama(), args=training_arguments(root / "plain-resumed", world),
                      train_dataset=TokenDataset(64, 0), eval_dataset=TokenDataset(16, 1))
    checkpoint = root / "distopt" / f"checkpoint-{PLAIN_RESUME_AT}"
    record = {"files": sorted(p.name for p in checkpoint.iterdir())}
    trainer.train(resume_from_checkpoint=str(checkpoint))
    return {**record, **run_record(trainer)}


VARIANTS = {
    # optim name -> the Trainer's class and options, sharded by distopt
    "sgd": {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.1},
    "adafactor": {"optim": "adafactor"},  # transformers' Adafactor: each matrix owned whole
    "bf16": {"bf16": True},
    "fp16": {"fp16": True},  # distopt's DynamicLossScaler against accelerate's GradScaler
    # Muon for the hidden matrices, AdamW for the rest (no Trainer counterpart)
    "muon": {"optimizer_cls_and_kwargs": (torch.optim.Muon, {"momentum": 0.95})},
    # a model loaded in bf16: fp32 main params in distopt's shards
    "bf16-params": {"model_dtype": torch.bfloat16},
    # AdamW with only each rank's reduced shard of the grads kept (the plain run: the Trainer's)
    "shard-grads": {"shard_grads": True},
}
DISTOPT_ONLY = ("muon", "bf16-params")
VARIANT_STEPS = 6


def train_variant(root: Path, variant: str, plain: bool) -> dict[str, Any]:
    """A short run of one optimizer or precision under DistoptTrainer (or the Trainer)."""
    from transformers import Trainer

    from distopt.integrations.transformers import DistoptTrainer

    set_launcher_environment()
    world = dist.get_world_size() if dist.is_initialized() else 1
    options = dict(VARIANTS[variant])
    extra = {k: options.pop(k) for k in ("optimizer_cls_and_kwargs",) if k in options}
    if options.pop("shard_grads", False) and not plain:
        from distopt.integrations.transformers import DistoptArguments

        extra["distopt_args"] = DistoptArguments(shard_grads=True)
    model = tiny_llama().to(options.pop("model_dtype", torch.float32))
    args = training_arguments(root / f"{variant}-{world}-{plain}", world, max_steps=VARIANT_STEPS,
                              eval_strategy="no", **options)
    cls = Trainer if plain else DistoptTrainer
    trainer = cls(model=model, args=args, train_dataset=TokenDataset(64, 0), **extra)
    trainer.train()
    record = run_record(trainer)
    if not plain:
        import distopt

        opt = trainer.optimizer.distributed
        record["memory"] = distopt.measure_state_bytes(opt).as_dict()
        record["classes"] = sorted(type(inner).__name__ for inner in opt.optimizers)
        record["loss_scaler"] = type(opt.loss_scaler).__name__ if opt.loss_scaler else None
        record["grad_shard_elements"] = sum(
            b.shard_size for model in opt.models for buf in model.flat_buffers
            for b in buf.layout.buckets)
    return record


def train_fp16_overflowing(root: Path) -> dict[str, Any]:
    """fp16 from a loss scale of 2**24, which overflows fp16 grads until it backs off."""
    import distopt
    from distopt.integrations.transformers import DistoptArguments, DistoptTrainer

    set_launcher_environment()
    args = training_arguments(root / "fp16-skip", dist.get_world_size(),
                              max_steps=VARIANT_STEPS + 4, eval_strategy="no", fp16=True)
    scaler = lambda: distopt.DynamicLossScaler(initial_scale=2.0**24, hysteresis=1)  # noqa: E731
    trainer = DistoptTrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(64, 0),
                             distopt_args=DistoptArguments(fp16_loss_scaler=scaler))
    trainer.train()
    return {**run_record(trainer), "scheduler_steps": trainer.lr_scheduler.last_epoch,
            "scale": trainer.optimizer.loss_scaler.scale}


# ---------------------------------------------------------------------- sharded params


SHARDED_STEPS = 4
SHARDED_BATCH = (4, 4)  # global sequences of 4 tokens: few enough that experts idle
# (model, activation checkpointing: reentrant, non-reentrant or None)
SHARDED_CASES = [("llama", True), ("llama", False), ("mixtral", None)]


def tiny_mixtral():
    """Mixtral with 8 experts, 2 per token: a step's 16 tokens leave some idle."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                           max_position_embeddings=32, num_local_experts=8,
                           num_experts_per_tok=2)
    return MixtralForCausalLM(config)


def checkpoint_layers(model, reentrant: bool) -> None:
    """Activation checkpointing of every decoder layer, by whichever name this version has."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def experts_hit(model) -> list[list[set[int]]]:
    """Hooks every MoE router of ``model``; the returned list gets, per forward, the experts
    each layer routed at least one token to."""
    hit: list[list[set[int]]] = []
    routers = [layer.mlp.gate for layer in model.model.layers]

    def record(router, _args, output) -> None:
        if router is routers[0]:
            hit.append([])
        hit[-1].append(set(output[-1].flatten().tolist()))  # (logits, scores, indices)

    for router in routers:
        router.register_forward_hook(record)
    return hit


def calls_of(module: torch.nn.Module) -> list[int]:
    """A one-element list that counts ``module``'s forward calls (recomputations included)."""
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    module.register_forward_pre_hook(count)
    return calls


def sharded_params_parity(name: str, reentrant: bool | None) -> dict[str, Any]:
    """An HF model (``name``: "llama" or "mixtral") under
    ``distopt.DistributedDataParallel(shard_params=True)`` and distopt's AdamW, against one
    plain process's torch.optim.AdamW on the same global batches (each rank trains that
    reference itself), and against ``shard_grads=True`` alone. ``reentrant``: every decoder
    layer under activation checkpointing, reentrant or not (None: none)."""
    import distopt

    rank, world = dist.get_rank(), dist.get_world_size()
    build = tiny_llama if name == "llama" else tiny_mixtral
    runs: dict[str, Any] = {}
    for kind in ("plain", "params", "grads"):
        model = build().train()
        if reentrant is not None:
            checkpoint_layers(model, reentrant)
        # The first layer's MLP: a checkpointed layer's forward runs again inside backward.
        layer_calls = calls_of(model.model.layers[0].mlp)
        hit = experts_hit(model) if name == "mixtral" else []
        # AdamW divides each element's update by its own grad's size, so grads that differ in
        # their last bits (the d ranks' mean against one process's) move an element whose grad
        # cancels across steps by a fraction of the lr: torch DDP's Mixtral at d = 2 ends
        # 2.3e-5 from one process at lr 3e-3, distopt's the same 2.3e-5, and 1.7e-6 at 1e-3.
        options = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
        if kind == "plain":
            forward, opt = model, torch.optim.AdamW(model.parameters(), **options)
        else:
            forward = distopt.DistributedDataParallel(
                model, shard_params=kind == "params", shard_grads=True)
            opt = distopt.DistributedOptimizer(forward, torch.optim.AdamW, clip_grad=1.0,
                                               **options)
        losses, calls = [], []
        for step in range(SHARDED_STEPS):
            generator = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, 64, SHARDED_BATCH, generator=generator)
            mine = tokens if kind == "plain" else tokens.chunk(world)[rank]
            opt.zero_grad()
            layer_calls[0] = 0
            loss = forward(input_ids=mine, labels=mine).loss
            loss.backward()
            if kind == "plain":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                loss = loss.detach().clone()
                dist.all_reduce(loss)
                loss /= world  # every rank's tokens count alike: the global batch's mean
            opt.step()
            losses.append(loss.item())
            calls.append(layer_calls[0])
        weights = (model.state_dict() if kind == "plain" else forward.full_state_dict())
        runs[kind] = {"loss": losses, "layer_calls": calls, "experts_hit": hit,
                      "weights": {k: v.detach().clone() for k, v in weights.items()}}
    return runs


class ExpertPerModule(torch.nn.Module):
    """A mixture of experts with an nn.Module per expert, each token sent to one expert by its
    id (token % experts). Every expert runs on every rank, an idle one on an empty batch, as
    sharded params require ([Note: every rank runs the same modules]); transformers' Mixtral
    before v5 skipped them."""

    def __init__(self, experts: int = 4, width: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, width)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(width, width)
                                           for _ in range(experts))
        self.head = torch.nn.Linear(width, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).flatten(0, 1)
        chosen = tokens.flatten() % len(self.experts)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (chosen == e).nonzero()[:, 0]  # empty where no token went to expert e
            out = out.index_add(0, rows, expert(h[rows]))
        return torch.nn.functional.cross_entropy(self.head(h + out), tokens.flatten())


def experts_per_module() -> float:
    """ExpertPerModule under shard_params=True, each rank's tokens going to one expert of its
    own (the others idle there), against one plain process: the largest weight difference."""
    import distopt

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, ref = ExpertPerModule(), ExpertPerModule()
    ref.load_state_dict(model.state_dict())
    # A bucket per expert (its weight and bias), as a large model's experts get.
    width = model.head.in_features
    ddp = distopt.DistributedDataParallel(model, shard_params=True,
                                          bucket_size=width * width + width)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    experts = len(model.experts)
    for step in range(SHARDED_STEPS):
        tokens = experts * torch.randint(0, 64 // experts, (world, 4),
                                         generator=torch.Generator().manual_seed(step))
        tokens += torch.arange(world)[:, None]  # row r: tokens of expert r
        opt.zero_grad()
        ddp(tokens[rank : rank + 1]).backward()
        opt.step()
        ref_opt.zero_grad()
        ref(tokens).backward()
        ref_opt.step()
    return max_weight_diff(ddp.full_state_dict(), ref.state_dict())


# ---------------------------------------------------------------------- launching


def _worker(rank: int, world: int, tmp: str, cases: list) -> None:
    torch.set_num_threads(1)
    if world > 1:
        store = dist.FileStore(os.path.join(tmp, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=TIMEOUT)
        yield_gloo_io_to_compute()
    results = {}
    for name, fn, args in cases:
        try:
            results[name] = ("ok", fn(*args))
        except Exception:
            results[name] = ("error", traceback.format_exc())
        if world > 1:
            dist.barrier()
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    os._exit(0)  # see dist_harness: no group teardown once every result is written


def launch(world: int, cases: list) -> list[dict[str, Any]]:
    """Run ``cases`` on ``world`` ranks (one plain process, no group, for world 1)."""
    with tempfile.TemporaryDirectory() as tmp:
        # Forked from the test processes' server, which imported torch once for the session.
        ctx = context()
        procs = [ctx.Process(target=_worker, args=(rank, world, tmp, cases))
                 for rank in range(world)]
        for proc in procs:
            proc.start()
        # As mp.spawn: a rank that fails ends the others, which may wait for it in a barrier.
        while all(p.exitcode in (None, 0) for p in procs) and any(p.is_alive() for p in procs):
            connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=1.0)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        assert [proc.exitcode for proc in procs] == [0] * world, "a rank failed; see its output"
        out = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                out.append(pickle.load(f))
    return out


def result(results: list[dict[str, Any]], name: str) -> list[Any]:
    values = []
    for rank, per_rank in enumerate(results):
        status, value = per_rank[name]
        assert status == "ok", f"case {name!r} failed on rank {rank}:\n{value}"
        values.append(value)
    return values


def _sharded_cases() -> list:
    return [(f"sharded-{name}-{reentrant}", sharded_params_parity, (name, reentrant))
            for name, reentrant in SHARDED_CASES]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def runs(root) -> dict[str, Any]:
    """The three-way comparison, the refusals, resumes and the Trainer patterns distopt must
    honour, on 2 ranks and on one process."""
    turns = [(f"{name}-{plain}", fn, (root, plain)) for plain in (False, True)
             for name, fn in (("smoothing", train_label_smoothing), ("turns", train_in_turn))]
    two = launch(2, [("refused", refused_arguments, (root,)),
                     ("broadcast_buffers", broadcast_buffers_argument, (root,)),
                     ("distopt", train_distopt, (root,)),
                     ("plain-resumed", resume_plain, (root,)),
                     ("ddp", train_plain, (root,)), *turns])
    one = launch(1, [("single", train_plain, (root,)), ("resumed", resume, (root,))])
    return {
        "turns": {name: result(two, name) for name, _, _ in turns},
        "plain-resumed": result(two, "plain-resumed"),
        "refused": result(two, "refused"),
        "broadcast_buffers": result(two, "broadcast_buffers"),
        "distopt": result(two, "distopt"),
        "ddp": result(two, "ddp"),
        "single": result(one, "single")[0],
        "resumed1": result(one, "resumed")[0],
    }


@pytest.fixture(scope="module")
def more(root, runs) -> dict[str, Any]:
    """The slow rest on 2 ranks and one process: the Trainer's other optimizers and
    precisions, fp16's skipped steps, sharded params on HF models and experts; with ``runs``."""
    variants = [(f"{v}-{plain}", train_variant, (root, v, plain))
                for v in VARIANTS for plain in (False, True) if not (v in DISTOPT_ONLY and plain)]
    two = launch(2, [("fp16-skip", train_fp16_overflowing, (root,)), *variants,
                     *_sharded_cases(), ("experts", experts_per_module, ())])
    one = launch(1, [("muon", train_variant, (root, "muon", False))])
    return {
        **runs,
        "variants": {name: result(two, name)[0] for name, _, _ in variants},
        "fp16-skip": result(two, "fp16-skip"),
        "muon1": result(one, "muon")[0],
        "experts": result(two, "experts"),
        "sharded": {(name, reentrant, 2): result(two, f"sharded-{name}-{reentrant}")
                    for name, reentrant in SHARDED_CASES},
    }


@pytest.fixture(scope="module")
def four(root, runs) -> dict[str, Any]:
    """The four-rank runs (slow): the resume of the two-rank run's checkpoint (``runs``
    saved it) and the sharded-params cases."""
    launched = launch(4, [("resumed", resume, (root,)), *_sharded_cases()])
    return {
        "resumed4": result(launched, "resumed"),
        "sharded": {(name, reentrant, 4): result(launched, f"sharded-{name}-{reentrant}")
                    for name, reentrant in SHARDED_CASES},
    }


# ---------------------------------------------------------------------- assertions


def max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_same_run(run: dict[str, Any], ref: dict[str, Any], first_step: int = 1,
                    steps: int = STEPS, tol: float = TOL, rtol: float | None = None) -> None:
    """Per-step LR and final weights within ``tol`` of ``ref``; per-step loss and grad norm, and
    eval losses, within ``rtol`` (``tol`` if None) of theirs, relative to their size."""
    rtol = tol if rtol is None else rtol
    ref_steps = ref["steps"]
    start = ref_steps.index(first_step)
    at = run["steps"].index(first_step)
    assert run["steps"][at:] == ref_steps[start:] == list(range(first_step, steps + 1))
    for key in ("loss", "grad_norm", "lr"):
        mine, theirs = run[key][at:], ref[key][start:]
        if key == "lr":
            worst = max(abs(x - y) for x, y in zip(mine, theirs, strict=True))
            assert worst <= tol, f"lr differs by {worst:.3g}"
        else:
            worst = max(abs(x - y) / abs(y) for x, y in zip(mine, theirs, strict=True))
            assert worst <= rtol, f"{key} differs by {worst:.3g} relative"
    for step, loss in ref["eval_loss"].items():
        if step >= first_step:
            assert abs(run["eval_loss"][step] - loss) <= rtol * abs(loss), \
                f"eval_loss at step {step}"
    assert max_weight_diff(run["weights"], ref["weights"]) <= tol


def test_distopt_trainer_matches_the_trainers_ddp_and_one_process(runs):
    ddp, single = runs["ddp"][0], runs["single"]
    assert runs["ddp"][0]["wrapper"] == "DistributedDataParallel"  # torch's, in the reference
    assert single["wrapper"] == "LlamaForCausalLM"
    for rank_run in runs["distopt"]:
        assert rank_run["wrapper"] == "distopt.ddp.wrapper.DistributedDataParallel"
        assert not rank_run["torch_ddp_inside"]
        assert_same_run(rank_run, ddp)
        assert_same_run(rank_run, single)
    # The run learns: the schedule warmed up, then decayed, and the loss went down.
    run = runs["distopt"][0]
    assert run["lr"][5] == pytest.approx(3e-3) and run["lr"][-1] < 1e-4
    assert run["loss"][-1] < run["loss"][0] - 0.1
    assert sorted(run["eval_loss"]) == [10, 20, 30]


def test_no_reduction_on_accumulation_micro_batches(runs):
    """The accumulation micro-batch sends one collective: the broadcast of the Llama's rotary
    buffers (fp32) that torch DDP makes in its forward too, except after an evaluation, whose
    no_grad forward broadcast them last (torch's rule)."""
    after_evaluation = (SAVE_AT, 2 * SAVE_AT)  # eval_steps = SAVE_AT
    expected = [0 if i in after_evaluation else 1 for i in range(STEPS)]
    for run in runs["distopt"]:
        assert run["calls_in_accumulation"] == expected
        # The last micro-batch and the step: reduce-scatters, the norm, the gathers, the unused
        # param check; the same number every step.
        synced = [step - micro for step, micro in zip(run["calls_per_step"],
                                                       run["calls_in_accumulation"], strict=True)]
        assert len(set(synced)) == 1 and synced[0] > 0


def test_ddp_broadcast_buffers_is_distopts_broadcast_buffers(runs):
    for taken in runs["broadcast_buffers"]:
        assert taken == {None: True, True: True, False: False}


def test_training_state_per_rank_is_distopts_table_against_ddps_16_bytes(runs):
    import distopt

    d = 2
    table = distopt.theoretical_bytes_per_param(torch.float32, torch.float32, d)
    assert table == 12.0  # 8 + 8/d: params and grad buffer whole, Adam's moments sharded
    n = runs["ddp"][0]["memory"]["num_params"]
    padding = runs["distopt"][0]["bucket_padding"]  # buckets padded to a multiple of d, aligned
    assert 0 <= padding <= 0.01 * n
    totals = []
    for run, ddp in zip(runs["distopt"], runs["ddp"], strict=True):
        mine, theirs = run["memory"], ddp["memory"]
        assert mine["num_params"] == theirs["num_params"] == n
        # The Trainer's DDP: fp32 params, grads and Adam's two moments, all replicated.
        assert theirs["params"] + theirs["grads"] + theirs["optimizer_state"] == 16 * n
        assert mine["params"] == mine["grads"] == 4 * (n + padding)
        assert mine["main_params"] == mine["main_grads"] == 0  # fp32: views, no copies
        assert mine["optimizer_state"] <= 8 * (n + padding) / d  # this rank's slice
        totals.append(mine["total"])
    # Each element's moments live on exactly one rank: the mean rank holds the table.
    assert sum(run["memory"]["optimizer_state"] for run in runs["distopt"]) == 8 * n
    assert sum(totals) / d == table * n + 8 * padding
    print(f"\nbytes/param per rank: DistoptTrainer {[round(t / n, 3) for t in totals]} "
          f"(table {table}; {padding} padded elements), the Trainer's DDP 16.0; {n} params")


def test_checkpoint_saved_on_2_ranks_resumes_on_1(runs):
    uninterrupted = runs["distopt"][0]
    assert uninterrupted["checkpoints"] == ["checkpoint-20", "checkpoint-30"]  # save_total_limit
    assert_same_run(runs["resumed1"], uninterrupted, first_step=SAVE_AT + 1)


@pytest.mark.slow
def test_checkpoint_saved_on_2_ranks_resumes_on_4(runs, four):
    for run in four["resumed4"]:
        assert_same_run(run, runs["distopt"][0], first_step=SAVE_AT + 1)


def test_arguments_distopt_cannot_honour_raise_on_every_rank(runs):
    first, second = runs["refused"]
    assert first == second
    for name, message in first.items():
        assert message.startswith(f"DistoptTrainer cannot honour {name}"), (name, message)
    assert "drop the DeepSpeed config" in first["deepspeed"]
    assert "compile its blocks" in first["torch_compile"]
    assert "optimizer_cls_and_kwargs" in first["optimizers"]
    assert "LBFGS" in first["optimizer_cls_and_kwargs"]
    assert "pass the model it wraps (ddp.module)" in first["model"]


@pytest.mark.slow
def test_optim_names_and_precisions_match_the_trainers_ddp(more):
    variants = more["variants"]
    expected = {"sgd": ["SGD"], "adafactor": ["Adafactor"], "bf16": ["AdamW"], "fp16": ["AdamW"]}
    for name, classes in expected.items():
        mine, theirs = variants[f"{name}-False"], variants[f"{name}-True"]
        assert mine["classes"] == classes
        assert mine["loss_scaler"] == ("DynamicLossScaler" if name == "fp16" else None)
        # fp16: both scale by 2**16 and skip no step here, but the Trainer's autocast wraps
        # the model's forward and distopt's the whole loss computation, so their fp16
        # roundings differ: helpers.autocast_weights_tol over the steps' learning rates.
        if name == "fp16":
            tol = autocast_weights_tol(theirs["lr"])  # 2.8e-4
            assert_same_run(mine, theirs, steps=VARIANT_STEPS, tol=tol,
                            rtol=WEIGHTS_TO_RELATIVE * tol)
        else:
            assert_same_run(mine, theirs, steps=VARIANT_STEPS)


@pytest.mark.slow
def test_shard_grads_trains_as_the_trainers_ddp_and_keeps_a_shard_of_the_grads(more):
    mine, theirs = more["variants"]["shard-grads-False"], more["variants"]["shard-grads-True"]
    # Each of the ACCUMULATION micro-batches is reduced and added to the kept shard, where
    # torch DDP adds the micro-batches' grads and reduces once: the same sum, other roundings.
    assert_same_run(mine, theirs, steps=VARIANT_STEPS)
    memory = mine["memory"]
    # fp32 grads: this rank's shard of every bucket (padding included), not the whole model.
    assert memory["grads"] == 4 * mine["grad_shard_elements"]
    assert memory["grads"] < 4 * memory["num_params"] / 2 * 1.01
    full = more["variants"]["sgd-False"]["memory"]  # the same model with the full grad buffer
    assert full["grads"] >= 4 * full["num_params"]


@pytest.mark.slow
def test_muon_for_hidden_matrices_is_the_same_on_2_ranks_as_on_one(more):
    two, one = more["variants"]["muon-False"], more["muon1"]
    assert two["classes"] == ["AdamW", "Muon"]
    # torch's Muon runs Newton-Schulz in bf16: grads that differ in their last fp32 bits (the
    # 2-rank average against one process's sum) round apart there, and each step's update
    # differs by a few bf16 roundings (helpers.muon_weights_tol). Over these 6 steps' learning
    # rates (the logged ones, which the steps used: 0 to 3e-3, 9e-3 in all), scaled by torch's
    # sqrt(rows / cols) = sqrt(2) for the MLP's (64, 32) matrices, the weights agree to 2e-4.
    # The next step's loss and grad norm are computed from those weights: relative to their
    # size, helpers.WEIGHTS_TO_RELATIVE times that.
    tol = muon_weights_tol(one["lr"], lr_ratio=2**0.5)
    assert_same_run(two, one, steps=VARIANT_STEPS, tol=tol, rtol=WEIGHTS_TO_RELATIVE * tol)
    # The same warm-up as the AdamW run for these steps, and other losses: Muon stepped.
    adamw = more["distopt"][0]
    assert two["lr"] == adamw["lr"][:VARIANT_STEPS]
    assert abs(two["loss"][-1] - adamw["loss"][VARIANT_STEPS - 1]) > 1e-3


@pytest.mark.slow
def test_fp16_overflow_skips_the_step_and_the_schedule_on_every_rank(more):
    first, second = more["fp16-skip"]
    skipped = [math.isnan(norm) for norm in first["grad_norm"]]
    assert skipped[:2] == [True, True] and not skipped[-1]  # backed off to a usable scale
    assert first["scale"] < 2.0**24
    # The Trainer steps its scheduler only after steps that updated the weights.
    assert first["scheduler_steps"] == skipped.count(False)
    for i, skip in enumerate(skipped[:-1]):
        assert (first["lr"][i + 1] == first["lr"][i]) == skip
    assert second["loss"] == first["loss"]
    assert max_weight_diff(first["weights"], second["weights"]) == 0


@pytest.mark.slow
def test_a_model_loaded_in_bf16_trains_on_fp32_main_params(more):
    import distopt

    run, fp32 = more["variants"]["bf16-params-False"], more["distopt"][0]
    memory = run["memory"]
    assert 2 * memory["params"] == memory["grads"]  # bf16 params, fp32 grads, the same layout
    assert memory["main_params"] > 0 and memory["main_grads"] == 0
    # 6 + 12/d: bf16 params, fp32 grads whole; fp32 main params and Adam's moments sharded.
    table = distopt.theoretical_bytes_per_param(torch.bfloat16, torch.float32, 2)
    assert table == 12.0 and abs(memory["bytes_per_param"] - table) < 0.05
    # The same warm-up as the fp32 run; bf16 weights round each step's result (2**-8).
    losses = zip(run["loss"], fp32["loss"][:VARIANT_STEPS], strict=True)
    assert max(abs(a - b) for a, b in losses) < 2e-3
    assert all(w.dtype == torch.bfloat16 for w in run["weights"].values())


def test_label_smoothing_sees_the_causal_lm_under_the_wrapper(runs):
    turns = runs["turns"]
    for mine, theirs in zip(turns["smoothing-False"], turns["smoothing-True"], strict=True):
        # What a compute_loss override sees through distopt's wrapper is what it sees through
        # torch's: the Llama, its loss kwargs and item counts, the same greedy generation.
        assert mine["seen"] == theirs["seen"]
        assert {r["unwrapped"] for r in mine["seen"]} == {"LlamaForCausalLM"}
        assert {r["module"] for r in mine["seen"]} == {"LlamaForCausalLM"}
        assert all(r["label_smoother"] for r in mine["seen"])
        assert_same_run(mine, theirs, steps=SHORT_STEPS, tol=EXACT)


def test_trainers_in_turn_over_one_model_train_as_the_plain_trainers(runs):
    turns = runs["turns"]
    for mine, theirs in zip(turns["turns-False"], turns["turns-True"], strict=True):
        for run, ref in zip(mine["runs"], theirs["runs"], strict=True):
            assert_same_run(run, ref, steps=SHORT_STEPS, tol=EXACT)
        # Each run started where the last one ended, and trained on.
        assert mine["runs"][1]["loss"][0] < mine["runs"][0]["loss"][0]
        assert mine["hooks_left"] == mine["main_grads_left"] == 0  # a plain module again
        assert abs(mine["eval_loss"] - theirs["eval_loss"]) <= EXACT


def test_a_distopt_checkpoint_resumes_under_the_plain_trainer(runs):
    uninterrupted = runs["distopt"][0]
    for run in runs["plain-resumed"]:
        # Beside distopt's own state, the checkpoint holds what the plain Trainer resumes.
        assert {"distopt", "model.safetensors", "optimizer.pt", "scheduler.pt",
                "trainer_state.json"} <= set(run["files"])
        # The optimizer state came along in optimizer.pt: Adam and the schedule go on where
        # they were, so steps 21 to 30 are the uninterrupted run's.
        assert_same_run(run, uninterrupted, first_step=PLAIN_RESUME_AT + 1)


def test_optimizer_pt_keeps_the_trainers_empty_param_groups():
    from distopt.integrations._transformers_optimizer import trainer_optimizer_state

    exported = {"optimizer": {"state": {0: {"step": 1}},
                              "param_groups": [{"lr": 1e-3, "weight_decay": 0.1, "params": [0]}]}}
    # The Trainer's no-decay group is empty here; distopt has no group for it.
    state = trainer_optimizer_state(exported, [None, 0.0])
    assert state["param_groups"] == [{"lr": 1e-3, "weight_decay": 0.1, "params": [0]},
                                     {"lr": 1e-3, "weight_decay": 0.0, "params": []}]
    assert state["state"] == {0: {"step": 1}}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "reentrant"), SHARDED_CASES)
@pytest.mark.parametrize("d", [2, 4])
def test_sharded_params_train_hf_models_as_one_plain_process(request, name, reentrant, d):
    """HF Llama under activation checkpointing (reentrant and not) and HF Mixtral with idle
    experts, under shard_params=True: within 1e-5 of one process's torch.optim.AdamW (clipped at
    1.0) on the same global batches, and bit for bit sharded grads' numbers (only where the
    params live between uses differs)."""
    runs = request.getfixturevalue("more" if d == 2 else "four")
    for per_rank in runs["sharded"][(name, reentrant, d)]:
        plain, params, grads = per_rank["plain"], per_rank["params"], per_rank["grads"]
        worst = max(abs(a - b) / b for a, b in zip(params["loss"], plain["loss"], strict=True))
        assert worst <= TOL, f"loss differs by {worst:.3g} relative"
        assert max_weight_diff(params["weights"], plain["weights"]) <= TOL
        assert params["loss"] == grads["loss"]
        assert max_weight_diff(params["weights"], grads["weights"]) == 0
        # Checkpointing took: the first decoder layer's MLP ran again in each backward.
        once = [1] * SHARDED_STEPS
        expected = once if reentrant is None else [2] * SHARDED_STEPS
        assert params["layer_calls"] == plain["layer_calls"] == expected
        assert plain["loss"][-1] < plain["loss"][0]  # it trained
    if name == "mixtral":
        # Experts no token of a rank's batch went to, on some step and layer of every rank
        # (their slice of the fused expert weights gets a zero grad there), and experts idle in
        # the whole global batch too.
        experts = 8
        for per_rank in runs["sharded"][(name, reentrant, d)]:
            hit = per_rank["params"]["experts_hit"]
            assert len(hit) == SHARDED_STEPS
            assert any(len(layer) < experts for step in hit for layer in step)
        global_hit = runs["sharded"][(name, reentrant, d)][0]["plain"]["experts_hit"]
        assert any(len(layer) < experts for step in global_hit for layer in step)


@pytest.mark.slow
def test_sharded_params_train_experts_idle_on_some_ranks_run_on_empty_batches(more):
    """An MoE with an nn.Module per expert whose ranks route to different experts: the idle
    experts run on empty batches keep every rank's gathers in step, and the run trains as one
    plain process does."""
    for diff in more["experts"]:
        assert diff <= TOL
