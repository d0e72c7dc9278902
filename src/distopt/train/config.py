"""Options of ``distopt train``: one dataclass, its command-line parser, and its validation.

Validation runs in the launcher, before any rank starts, so a bad option gives one line of
error instead of a traceback from every rank.
"""

from __future__ import annotations

import argparse
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..dtypes import DTYPES, parse_state_dtype
from ..optim.recipes import ADAMW_OPTIONS, muon_param_groups
from ..optim.state_precision import resolve_block_size, resolve_state_dtypes
from ..options import check_state_block_size, fp32_accumulation_problem, remainders_problem
from .model import MODEL_PRESETS


def param_groups(optimizer: str, module: torch.nn.Module, lr: float
                 ) -> list[dict[str, Any]] | None:
    """The param groups ``distopt train --optimizer NAME`` builds its optimizer with: the Muon
    recipe for ``muon`` (optim/recipes.py), else None (one group of every param, so Adafactor,
    a whole-tensor optimizer too, steps embeddings, norms and biases as well, as it was made
    to)."""
    return muon_param_groups(module, lr) if optimizer == "muon" else None


OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, dict(ADAMW_OPTIONS)),
    "adam": (torch.optim.Adam, {"betas": (0.9, 0.95)}),
    "sgd": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    "adagrad": (torch.optim.Adagrad, {}),
    "rmsprop": (torch.optim.RMSprop, {}),
    "nadam": (torch.optim.NAdam, {"betas": (0.9, 0.95)}),
    "radam": (torch.optim.RAdam, {"betas": (0.9, 0.95)}),
    "adamax": (torch.optim.Adamax, {}),
    # Whole-tensor optimizers, each in its standard recipe (optim/recipes.py): Muon for the
    # hidden matrices beside AdamW (the options above) for the rest, at AdamW's lr thanks to
    # adjust_lr_fn (see [Note: the Muon recipe]); Adafactor for every param, torch's defaults.
    "muon": (torch.optim.Muon, {"momentum": 0.95, "nesterov": True, "weight_decay": 0.1,
                                "adjust_lr_fn": "match_rms_adamw"}),
    "adafactor": (torch.optim.Adafactor, {}),
}

DEFAULT_LR = {"adafactor": 0.1}
"""Peak learning rates other than 3e-3. Adafactor's lr is relative: each step moves a param by
lr times its RMS, and torch caps lr at 1/sqrt(step); 0.1 trains the tiny GPT as far as AdamW
at 3e-3 does (150 steps: held-out loss 2.38 against 2.40; 1e-2 reaches 2.88)."""


DEVICES = ("auto", "cpu", "cuda")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything a training run depends on; saved next to its checkpoints."""

    nproc: int | None = None
    """Ranks on this machine; None: one per GPU, or 2 on CPU."""
    device: str = "auto"
    """Where the ranks train: cuda (one GPU per rank, NCCL), cpu (gloo), or auto: cuda when
    a GPU is visible, else cpu."""
    model: str = "tiny"
    """Demo GPT preset (see distopt.train.model.MODEL_PRESETS)."""
    data: str | None = None
    """Folder of text files; None: the interpreter's standard library sources."""
    max_bytes: int | None = 8_000_000
    """Cap on each data split's size in bytes (None: all of it)."""
    steps: int = 600
    """Optimizer steps to train for."""
    batch_size: int = 32
    """Global batch size in sequences (all ranks and micro-batches together)."""
    grad_accum: int = 1
    """Micro-batches per step on each rank (no_sync for all but the last); with --pp, the
    pipeline schedule's micro-batches."""
    pp: int = 1
    """Pipeline stages: the GPT's blocks split evenly over them, each stage sharded over the
    world / pp ranks of its data-parallel group (docs/pipeline.md)."""
    schedule: str = "1f1b"
    """The pipeline schedule with --pp: gpipe or 1f1b."""
    seq_len: int = 128
    """Tokens (bytes) per sequence."""
    lr: float | None = None
    """Peak learning rate, reached after the warm-up; None: the optimizer's (DEFAULT_LR)."""
    warmup: int = 30
    """Linear warm-up steps, followed by a cosine decay to lr / 10."""
    optimizer: str = "adamw"
    """Inner torch optimizer (see OPTIMIZERS)."""
    dtype: str = "fp32"
    """Param dtype: fp32, bf16 or fp16 (fp16 trains with a dynamic loss scaler)."""
    grad_dtype: str = "fp32"
    """Dtype of the grad buffer and of the reduction."""
    no_shard: bool = False
    """Replicated optimizer state (distopt.BasicOptimizer), for comparison."""
    shard_size: int | None = None
    """Ranks each bucket is sharded over; the groups of that many ranks replicate each other
    (a ("dp_replicate", "dp_shard") mesh, e.g. the GPUs of one node). None: the ranks of one
    node when the run spans several nodes (and shards), else every rank (see
    ``default_shard_size``)."""
    reduce_scatter_fp32_accumulation: bool = False
    """Send bf16/fp16 grads as they are but sum each shard in fp32 and round it once."""
    store_param_remainders: bool = False
    """Keep the fp32 masters of bf16 params as the params plus 16-bit remainders."""
    state_dtype: str = "fp32"
    """Dtype the optimizer state is held in between steps: fp32, bf16, fp16, fp8-e4m3 or
    fp8-e5m2 (fp16 and fp8 with block scales), or ``key=name`` pairs joined by commas; see
    [Note: state precision] in distopt/optim/state_precision.py."""
    state_block_size: int | None = None
    """Elements per scale of fp16 and fp8 state; None: distopt's default (32)."""
    state_rounding: str = "nearest"
    """How the state is narrowed to ``state_dtype``: nearest, or stochastic (unbiased)."""
    shard_grads: bool = False
    """Keep only each rank's reduced shard of the grads between steps (ZeRO-2); every
    micro-batch reduce-scatters. See [Note: sharded grads] in distopt/ddp/buffers/grad_pool.py."""
    shard_params: bool = False
    """Keep only each rank's shard of the params too, gathered around the forward and backward
    that use them (ZeRO-3; implies --shard-grads). See [Note: sharded params] in
    distopt/ddp/buffers/param_storage.py."""
    moe: int = 0
    """Experts in each block's mixture of experts (top-2 routed, each the size of the dense
    MLP); 0: the dense GPT."""
    ep: int = 1
    """Ranks the experts are split over (expert parallelism, tokens exchanged all-to-all);
    their params shard over the ranks / ep that hold the same experts."""
    overlap_grad_reduce: bool = True
    """Reduce-scatter each bucket while backward goes on."""
    overlap_param_gather: bool = True
    """All-gather updated params while the next forward goes on."""
    bucket_size: int | None = None
    """Elements per bucket; None: distopt's default for the model and DP size."""
    clip: float | None = 1.0
    """Max global grad norm; None disables clipping."""
    seed: int = 1234
    """Seeds the model's init and the data order."""
    eval_every: int = 50
    """Steps between held-out evaluations (0: only at the start and the end)."""
    eval_batches: int = 8
    """Held-out batches (of batch_size sequences) per evaluation."""
    out: str = "runs/default"
    """Output folder: metrics.jsonl, checkpoints, summary.json, loss.png."""
    save_every: int = 200
    """Steps between checkpoints (0: only at the end)."""
    keep: int = 2
    """Checkpoints kept on disk."""
    save: bool = True
    """Write checkpoints (False: none at all, and the run cannot be resumed)."""
    resume: bool = False
    """Resume from the latest checkpoint in ``out`` (restarts always resume)."""
    max_restarts: int = 0
    """Times the launcher restarts the ranks after a failure; they resume from the latest
    checkpoint."""
    timeout: float | None = None
    """Seconds a collective waits for the other ranks before it fails (the process group's
    timeout), so that a stuck rank fails the run, or with ``max_restarts`` restarts it; None:
    torch's default (30 minutes on gloo, 10 on NCCL)."""
    async_save: bool = False
    """Write checkpoints in the background: the step that saves copies this rank's part of the
    state into a host buffer kept between saves, and training goes on while it is written and
    published (``save_checkpoint(async_save=True)``)."""
    stop_on_save_failure: bool = False
    """Stop the run when a checkpoint cannot be saved; by default it is reported and training
    goes on (the previous checkpoint stays the latest)."""
    progress: bool = True
    """Progress bar on rank 0."""
    ft_groups: int | None = None
    """Replica groups of ``nproc`` ranks each, under torchft: the state is sharded within a
    group and the groups average their grads through a torchft Manager, so a group that fails
    leaves the others training and heals from them when its launcher starts it again (see
    docs/fault-tolerance.md). None: one group, no torchft."""
    ft_lighthouse: str | None = None
    """With ``ft_groups``: the address of a running torchft Lighthouse (``http://HOST:PORT``);
    None: ``distopt train`` starts one."""
    ft_min_groups: int = 1
    """With ``ft_groups`` and the Lighthouse ``distopt train`` starts: the groups a step needs;
    with ``ft_groups`` the others wait for a failed group to come back and heal rather than
    step without it (no race between its restart and the end of the run)."""

    def __post_init__(self) -> None:
        if self.lr is None:
            self.lr = DEFAULT_LR.get(self.optimizer, 3e-3)
        problems = []
        if self.nproc is not None and self.nproc < 1:
            problems.append(f"--nproc must be >= 1, got {self.nproc}")
        if self.device not in DEVICES:
            problems.append(f"--device must be one of {', '.join(DEVICES)}, got {self.device}")
        if self.model not in MODEL_PRESETS:
            problems.append(f"--model must be one of {', '.join(MODEL_PRESETS)}, got {self.model}")
        for names, least in (
            (("steps", "batch_size", "grad_accum", "seq_len", "eval_batches", "keep"), 1),
            (("warmup", "eval_every", "save_every", "max_restarts"), 0),
        ):
            for name in names:
                if getattr(self, name) < least:
                    flag = "--" + name.replace("_", "-")
                    problems.append(f"{flag} must be >= {least}, got {getattr(self, name)}")
        if self.timeout is not None and not self.timeout > 0:
            problems.append(f"--timeout must be a positive number of seconds, got {self.timeout}")
        if not self.lr > 0:
            problems.append(f"--lr must be positive, got {self.lr}")
        if self.clip is not None and not self.clip > 0:
            problems.append(f"--clip must be positive, got {self.clip}")
        if self.optimizer not in OPTIMIZERS:
            problems.append(
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer}"
            )
        for name in ("dtype", "grad_dtype"):
            if getattr(self, name) not in DTYPES:
                problems.append(f"--{name.replace('_', '-')} must be one of fp32, bf16, fp16, "
                                f"got {getattr(self, name)}")
        if self.shard_size is not None and self.shard_size < 1:
            problems.append(f"--shard-size must be >= 1, got {self.shard_size}")
        if self.reduce_scatter_fp32_accumulation:
            problems += self._fp32_accumulation_problems()
        if self.store_param_remainders:
            if remainders_problem({DTYPES.get(self.dtype, torch.float32)}):
                problems.append(f"--store-param-remainders needs --dtype bf16, got --dtype "
                                f"{self.dtype}")
            if self.no_shard:
                problems.append("--store-param-remainders needs the sharded optimizer; drop "
                                "--no-shard")
        if self.async_save and not self.save:
            problems.append("--async-save writes checkpoints in the background; drop --no-save")
        if self.shard_grads and self.no_shard:
            problems.append("--shard-grads needs the sharded optimizer (the replicated one "
                            "steps whole grads); drop --no-shard")
        if self.shard_params and self.no_shard:
            problems.append("--shard-params needs the sharded optimizer (the replicated one "
                            "steps whole params); drop --no-shard")
        if self.moe < 0 or self.ep < 1:
            problems.append(f"--moe must be >= 0 and --ep >= 1, got {self.moe} and {self.ep}")
        elif self.ep > 1 and (not self.moe or self.moe % self.ep):
            problems.append(f"--ep {self.ep} splits the experts of --moe N over ranks: pick N "
                            f"a multiple of {self.ep} (e.g. --moe {2 * self.ep})")
        if self.moe and (self.no_shard or self.shard_size is not None):
            problems.append("--moe shards experts over their own data-parallel group with the "
                            "sharded optimizer over every rank: drop --no-shard and --shard-size")
        if self.optimizer in OPTIMIZERS:
            problems += self._state_dtype_problems()
        if self.pp != 1:
            problems += self._pipeline_problems()
        if self.ft_groups is not None or self.ft_lighthouse is not None:
            problems += self._fault_tolerance_problems()
        if self.max_bytes is not None and self.max_bytes < 1:
            problems.append(f"--max-bytes must be >= 1, got {self.max_bytes}")
        if problems:
            raise ValueError("; ".join(problems))

    def _state_dtype_problems(self) -> list[str]:
        # The library raises the same on every rank; here it is one line before any starts.
        classes = [OPTIMIZERS[self.optimizer][0]]
        if self.optimizer == "muon":
            classes.append(torch.optim.AdamW)  # the recipe's other params; see optim/recipes.py
        try:
            dtypes = resolve_state_dtypes(parse_state_dtype(self.state_dtype), classes)
        except ValueError as error:
            return [f"--state-dtype {self.state_dtype}: {error}"]
        if self.state_rounding == "stochastic" and not dtypes:
            return ["--state-rounding stochastic rounds state held below fp32; add "
                    "--state-dtype (e.g. fp8-e5m2)"]
        try:
            check_state_block_size(self.state_block_size)
            resolve_block_size(self.state_block_size, dtypes)
        except (TypeError, ValueError) as error:
            return [f"--state-block-size {self.state_block_size}: {error}"]
        return []

    def _fault_tolerance_problems(self) -> list[str]:
        # What the library's ft_manager= covers, and what distopt train composes with it.
        if self.ft_groups is None:
            return ["--ft-lighthouse names the Lighthouse of --ft-groups: add --ft-groups G"]
        if self.ft_groups < 1:
            return [f"--ft-groups must be >= 1, got {self.ft_groups}"]
        if not 1 <= self.ft_min_groups <= self.ft_groups:
            return [f"--ft-min-groups must be in [1, --ft-groups {self.ft_groups}], got "
                    f"{self.ft_min_groups}"]
        if self.ft_min_groups != 1 and self.ft_lighthouse is not None:
            return ["--ft-min-groups sets the Lighthouse that distopt train starts: with "
                    "--ft-lighthouse set its --min_replicas instead"]
        return [f"--ft-groups does not compose with {flag} (not covered by the fault-tolerant "
                "replica groups); drop one of them"
                for flag, on in (("--no-shard", self.no_shard), ("--shard-size", self.shard_size),
                                 ("--pp", self.pp != 1), ("--moe", self.moe),
                                 ("--reduce-scatter-fp32-accumulation",
                                  self.reduce_scatter_fp32_accumulation),
                                 ("--resume", self.resume))
                if on]

    def _fp32_accumulation_problems(self) -> list[str]:
        # The library raises the same; here it is one line before any rank starts.
        flag = "--reduce-scatter-fp32-accumulation"
        problems = []
        if fp32_accumulation_problem({DTYPES.get(self.grad_dtype, torch.float32)}):
            problems.append(f"{flag} needs --grad-dtype bf16 or fp16, got {self.grad_dtype}")
        if self.no_shard:
            problems.append(f"{flag} needs the sharded optimizer; drop --no-shard")
        return problems

    def _pipeline_problems(self) -> list[str]:
        from .stages import SCHEDULES

        problems = []
        if self.pp < 1:
            return [f"--pp must be >= 1, got {self.pp}"]
        layers = MODEL_PRESETS[self.model]["n_layer"] if self.model in MODEL_PRESETS else None
        if layers is not None and layers % self.pp:
            problems.append(f"--pp {self.pp} does not divide the {layers} blocks of --model "
                            f"{self.model}; pick a divisor of {layers}")
        if self.schedule not in SCHEDULES:
            problems.append(f"--schedule must be one of {', '.join(SCHEDULES)}, got "
                            f"{self.schedule}")
        for flag, on in (("--no-shard", self.no_shard), ("--shard-size", self.shard_size),
                         ("--dtype fp16", self.dtype == "fp16")):
            if on:
                problems.append(f"--pp does not compose with {flag} in distopt train yet; drop "
                                "one of them")
        return problems

    def check_world_size(self, world_size: int) -> None:
        """The global batch must split evenly over ranks and micro-batches, the ranks into
        shard groups and into pipeline stages."""
        if world_size % self.pp:
            raise ValueError(
                f"--pp {self.pp} does not divide the {world_size} ranks; pick a divisor of the "
                "rank count"
            )
        world_size //= self.pp  # the data-parallel ranks of each stage
        if self.shard_size is not None and world_size % self.shard_size:
            raise ValueError(
                f"--shard-size {self.shard_size} does not divide the {world_size} ranks; pick a "
                "divisor of the rank count, such as the ranks of one node"
            )
        if world_size % self.ep:
            raise ValueError(f"--ep {self.ep} does not divide the {world_size} ranks; pick a "
                             "divisor of --nproc")
        if self.batch_size % (world_size * self.grad_accum):
            raise ValueError(
                f"--batch-size {self.batch_size} must be a multiple of ranks x --grad-accum "
                f"({world_size} x {self.grad_accum}); pick a batch size divisible by "
                f"{world_size * self.grad_accum}"
            )

    def device_type(self) -> str:
        """``cuda`` or ``cpu``: what ``auto`` means on this machine."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_shard_size(node_of_rank: Sequence[Hashable]) -> int | None:
    """The shard size of a run without --shard-size, from the node each rank runs on (indexed
    by global rank): on several nodes, the ranks of one node, so that reduce-scatters and
    all-gathers stay inside a node and only each shard's average crosses nodes (see
    [Note: hierarchical data parallelism]); None, every rank in one shard group, on one node.
    The shard groups are runs of consecutive ranks, so a node's ranks must be consecutive and
    every node must hold as many, as torchrun numbers them with the same --nproc-per-node on
    every node; otherwise None as well, as no shard size matches the nodes."""
    runs: list[tuple[Hashable, int]] = []  # (node, ranks) of each run of consecutive ranks
    for node in node_of_rank:
        if runs and runs[-1][0] == node:
            runs[-1] = (node, runs[-1][1] + 1)
        else:
            runs.append((node, 1))
    nodes = {node for node, _ in runs}
    if len(runs) < 2 or len(nodes) != len(runs) or len({size for _, size in runs}) != 1:
        return None
    return runs[0][1]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="distopt train",
        description="Train the demo byte-level GPT with distopt on several ranks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = TrainConfig()
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs, or 2 on CPU)")
    p.add_argument("--device", default=defaults.device,
                   help="cuda, cpu, or auto (cuda when a GPU is visible)")
    p.add_argument("--model", default=defaults.model, help=", ".join(MODEL_PRESETS))
    p.add_argument("--data", default=None, help="folder of text files (default: stdlib sources)")
    p.add_argument("--max-bytes", type=lambda s: None if s == "all" else int(float(s)),
                   default=defaults.max_bytes, help="bytes per data split, or 'all'")
    p.add_argument("--pp", type=int, default=defaults.pp,
                   help="pipeline stages (the GPT's blocks split evenly); each stage is sharded "
                   "over world / pp ranks; micro-batches from --grad-accum")
    p.add_argument("--schedule", default=defaults.schedule, help="with --pp: gpipe or 1f1b")
    for name in ("steps", "batch_size", "grad_accum", "seq_len", "warmup", "eval_every",
                 "eval_batches", "save_every", "keep", "max_restarts", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 3e-3; for adafactor 0.1)")
    p.add_argument("--optimizer", default=defaults.optimizer, help=", ".join(OPTIMIZERS))
    p.add_argument("--dtype", default=defaults.dtype, help="fp32, bf16 or fp16")
    p.add_argument("--grad-dtype", default=defaults.grad_dtype, help="fp32, bf16 or fp16")
    p.add_argument("--no-shard", action="store_true", help="replicated optimizer (BasicOptimizer)")
    p.add_argument("--shard-size", type=int, default=None,
                   help="ranks each bucket is sharded over, replicated across the groups of that "
                   "many ranks; default: the ranks of one node when the run spans several "
                   "nodes, else every rank")
    p.add_argument("--reduce-scatter-fp32-accumulation", action="store_true",
                   help="sum bf16/fp16 grads in fp32 on the receiving rank (one rounding)")
    p.add_argument("--store-param-remainders", action="store_true",
                   help="bf16 params + 16-bit remainders as the fp32 masters (2 bytes, exact)")
    p.add_argument("--state-dtype", default=defaults.state_dtype,
                   help="dtype of the optimizer state between steps: fp32, bf16, fp16, "
                   "fp8-e4m3 or fp8-e5m2 (fp16 and fp8 with a scale per 32 elements), or "
                   "one per state key: exp_avg=fp8-e4m3,exp_avg_sq=fp8-e5m2")
    p.add_argument("--state-block-size", type=int, default=None,
                   help="elements per scale of fp16 and fp8 state (default 32)")
    p.add_argument("--state-rounding", choices=("nearest", "stochastic"),
                   default=defaults.state_rounding,
                   help="how the state is narrowed to --state-dtype: to nearest, or "
                   "stochastically (unbiased; helps fp8)")
    p.add_argument("--shard-grads", action="store_true",
                   help="keep only this rank's reduced shard of the grads between steps "
                   "(ZeRO-2); every micro-batch reduce-scatters")
    p.add_argument("--shard-params", action="store_true",
                   help="keep only this rank's shard of the params too, gathered around the "
                   "forward and backward that use them (ZeRO-3); implies --shard-grads")
    p.add_argument("--moe", type=int, default=defaults.moe, metavar="N",
                   help="a mixture of N experts (top-2) in each block instead of its MLP")
    p.add_argument("--ep", type=int, default=defaults.ep,
                   help="expert-parallel size: ranks the --moe experts are split over")
    p.add_argument("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false")
    p.add_argument("--no-overlap-param-gather", dest="overlap_param_gather",
                   action="store_false")
    p.add_argument("--bucket-size", type=int, default=None, help="elements per bucket")
    p.add_argument("--clip", type=lambda s: None if s == "none" else float(s),
                   default=defaults.clip, help="max grad norm, or 'none'")
    p.add_argument("--out", default=defaults.out, help="output folder")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint")
    p.add_argument("--no-save", dest="save", action="store_false",
                   help="write no checkpoints (the run cannot be resumed)")
    p.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background: the saving step copies this "
                   "rank's part of the state and training goes on")
    p.add_argument("--stop-on-save-failure", action="store_true",
                   help="stop when a checkpoint cannot be saved (default: report it and train "
                   "on; the previous checkpoint stays the latest)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds a collective waits for the other ranks before it fails "
                   "(default: torch's, 30 minutes on gloo); with --max-restarts a stuck rank "
                   "then restarts the group")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--ft-groups", type=int, default=None, metavar="G",
                   help="G replica groups of --nproc ranks under torchft: a failed group "
                   "leaves the others training and heals from them when restarted "
                   "(pip install 'torch-distopt[ft]')")
    p.add_argument("--ft-lighthouse", default=None, metavar="ADDR",
                   help="with --ft-groups: a running torchft Lighthouse (default: start one)")
    p.add_argument("--ft-min-groups", type=int, default=1, metavar="K",
                   help="with --ft-groups: the groups each step needs (default 1); K = G: the "
                   "others wait for a failed group to heal instead of stepping without it")
    return p


def parse_args(argv: list[str] | None) -> TrainConfig:
    """Parse and validate; raises ValueError with every problem found, in one line."""
    return TrainConfig(**vars(parser().parse_args(argv)))
