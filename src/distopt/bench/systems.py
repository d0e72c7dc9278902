"""The data-parallel systems the benchmark compares, behind one small training interface.

Every system trains the same module with AdamW (``foreach``) and exposes the steps of one
training iteration separately (``zero_grad``, ``forward``, ``backward``, ``sync``, ``step``), so
the runner times each phase the same way for all of them. Peers get the options their docs
recommend for speed: DDP with ``gradient_as_bucket_view``, ZeroRedundancyOptimizer with
``parameters_as_bucket_view``, FSDP2 with ``reshard_after_forward=False`` (ZeRO-2-like).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import distopt
from distopt.memory import bytes_per_param_breakdown, storage_bytes

SYSTEMS = ("ddp", "zero", "fsdp2", "distopt-no-overlap", "distopt", "distopt-shard-grads",
           "basic")
SHARDED_PARAMS = ("fsdp2-reshard", "distopt-shard-params", "distopt-shard-params-keep")
"""ZeRO-3 side by side, run only when asked for: FSDP2 freeing each block's params after its
forward and distopt's sharded params, with and without freeing them after forward (``fsdp2``
is FSDP2 keeping them)."""
"""Configurations run by default, in the order the report lists them."""
SPLIT_OVERLAP = ("distopt-overlap-reduce", "distopt-overlap-gather")
"""Configurations run only when asked for: one of distopt's two overlaps at a time."""
PEER_SYSTEMS = ("megatron", "megatron-overlap", "deepspeed-z1", "deepspeed-z2",
                "deepspeed-z2-overlap", "deepspeed-z3")
"""Other projects' distributed optimizers, run only when asked for (the ``peers`` extra;
``peers.py``)."""
PEERS = ("ddp", "zero", "fsdp2", "fsdp2-reshard") + PEER_SYSTEMS

LABELS = {
    "ddp": "torch DDP + AdamW",
    "zero": "DDP + ZeroRedundancyOptimizer",
    "fsdp2": "FSDP2 fully_shard (no reshard)",
    "fsdp2-reshard": "FSDP2 fully_shard (reshard)",
    "distopt-shard-params": "distopt, sharded params",
    "distopt-shard-params-keep": "distopt, sharded params, no reshard",
    "distopt-no-overlap": "distopt, overlap off",
    "distopt": "distopt, overlap on",
    "distopt-shard-grads": "distopt, sharded grads",
    "distopt-overlap-reduce": "distopt, reduce overlap only",
    "distopt-overlap-gather": "distopt, gather overlap only",
    "basic": "distopt BasicOptimizer",
    "distopt-muon": "distopt Muon, owner computes",
    "ddp-muon": "torch DDP + Muon, every rank",
    "gather-muon": "ZeRO-1 Muon, gathered (Moonshot)",
    "megatron": "Megatron-Core DistOpt",
    "megatron-overlap": "Megatron-Core DistOpt, overlap",
    "deepspeed-z1": "DeepSpeed ZeRO-1",
    "deepspeed-z2": "DeepSpeed ZeRO-2",
    "deepspeed-z2-overlap": "DeepSpeed ZeRO-2, overlap",
    "deepspeed-z3": "DeepSpeed ZeRO-3",
}

CONTROL_DTYPES = (torch.float64, torch.int64)
"""The dtypes of distopt's control values; the benchmark's grads and params are never fp64."""

ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "foreach": True}

# Bytes each rank sends per byte of the full tensor, for bandwidth-optimal algorithms (the
# "bus bandwidth" factors of nccl-tests): a ring all-reduce is a reduce-scatter plus an
# all-gather. Used to turn counted payloads into per-rank wire bytes.
_WIRE_FACTOR = {
    "all_reduce": lambda d: 2 * (d - 1) / d,
    "reduce_scatter": lambda d: (d - 1) / d,
    "all_gather": lambda d: (d - 1) / d,
    "broadcast": lambda d: (d - 1) / d,
    "reduce": lambda d: (d - 1) / d,
    "send": lambda d: 1.0,  # point-to-point: the payload is what is sent
}


def wire_bytes(op: str, payload: float, d: int) -> float:
    """Bytes one rank sends for a collective over ``payload`` bytes among ``d`` ranks, by a
    bandwidth-optimal algorithm (small control all-reduces are counted like large ones; the
    pipeline's ``stage_`` ops like the others)."""
    base = op.removeprefix("stage_").removesuffix("_small")
    return _WIRE_FACTOR[base](d) * payload if base in _WIRE_FACTOR else 0.0


def collectives_text(r: dict[str, Any], digits: int) -> str:
    """A result's collectives per step: each op's count and payload."""
    return ", ".join(
        f"{op} {r['calls_per_step'][op]:g}x {b / 2**20:.{digits}f}MiB"
        for op, b in sorted(r["payload_bytes_per_step"].items())
    )


class CollectiveCounter:
    """Counts every collective issued through ``torch.distributed`` while installed.

    Wraps the module-level functions, so it sees what peers (DDP comm hooks, ZeRO's
    broadcasts, FSDP2's gathers and reductions) and distopt issue from Python. Records the
    payload: the bytes of the full (unsharded) tensor each collective covers.

    Ops on one of ``stage_groups`` (the pipeline's groups) are counted apart, under a
    ``stage_`` prefix: the activations sent between stages and the tie's all-reduce are not
    data-parallel traffic.
    """

    _FUNCS = {
        # name: (op, position and keyword of the full tensor, multiplied by the group size?)
        "all_reduce": ("all_reduce", 0, "tensor", False),
        "broadcast": ("broadcast", 0, "tensor", False),
        "reduce": ("reduce", 0, "tensor", False),
        "all_gather_single": ("all_gather", 0, "output_tensor", False),
        "all_gather_into_tensor": ("all_gather", 0, "output_tensor", False),
        "reduce_scatter_single": ("reduce_scatter", 1, "input", False),
        "reduce_scatter_tensor": ("reduce_scatter", 1, "input", False),
        "all_gather": ("all_gather", 1, "tensor", True),
        # Receives are the other end of counted sends: counting them too would count twice.
        "isend": ("send", 0, "tensor", False),
    }

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()
        self.stage_groups: list[dist.ProcessGroup] = []
        self._saved: dict[str, Any] = {}

    def install(self) -> None:
        from torch.distributed import distributed_c10d

        for name, (op, position, keyword, times_group) in self._FUNCS.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original
            counted = self._wrap(original, op, position, keyword, times_group)
            setattr(dist, name, counted)
            if name == "isend":
                # P2POp accepts only the function c10d itself calls isend, and
                # batch_isend_irecv tells sends from receives by identity with it: the
                # pipeline's sends are counted only if c10d's name is the counted one too.
                distributed_c10d.isend = counted

    def uninstall(self) -> None:
        from torch.distributed import distributed_c10d

        for name, original in self._saved.items():
            setattr(dist, name, original)
            if name == "isend":
                distributed_c10d.isend = original
        self._saved.clear()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def _wrap(self, fn, op: str, position: int, keyword: str, times_group: bool):
        def counted(*args, **kwargs):
            tensor = args[position] if len(args) > position else kwargs.get(keyword)
            if isinstance(tensor, torch.Tensor):
                nbytes = tensor.numel() * tensor.element_size()
                if times_group:
                    nbytes *= dist.get_world_size(kwargs.get("group"))
                # Control values (a verdict, a norm, what p.grad reads), not grads or params:
                # a few numbers, or distopt's fp64 statistics and int64 checks.
                small = "_small" if tensor.numel() <= 16 or tensor.dtype in CONTROL_DTYPES else ""
                group = kwargs.get("group")
                stage = "stage_" if any(group is g for g in self.stage_groups) else ""
                self.calls[stage + op + small] += 1
                self.bytes[stage + op + small] += nbytes
            return fn(*args, **kwargs)

        return counted


class System:
    """One configuration under test: a wrapped model and its optimizer."""

    name: str
    model: nn.Module
    optimizer: Any

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.model(*inputs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def sync(self) -> None:
        """Wait for the gradient reduction (peers finish it inside backward)."""

    def step(self) -> None:
        self.optimizer.step()

    def finish_param_sync(self) -> None:
        """Wait for a param gather still in flight (an overlapped one), so params are whole."""

    def full_params(self) -> list[torch.Tensor]:
        """Every param whole, in registration order: copies (collective where params are
        sharded between steps)."""
        self.finish_param_sync()
        params = list(self.model.parameters())
        if params and hasattr(params[0], "full_tensor"):  # FSDP2's DTensor shards
            return [p.full_tensor() for p in params]
        return [p.detach().clone() for p in params]

    def state_bytes(self) -> dict[str, int]:
        """Bytes of persistent training state this rank holds: params, grads, optimizer
        state, each storage counted once (views are free)."""
        seen: set[int] = set()

        def total(tensors) -> int:
            return storage_bytes(tensors, seen)

        params = list(self.model.parameters())
        return {
            "params": total(params),
            "grads": total(p.grad for p in params),
            "optimizer_state": total(_state_tensors(self._inner_optimizer())),
        }

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer


def _state_tensors(optimizer: torch.optim.Optimizer):
    # Step counters are one scalar per tensor: bookkeeping, not per-element state.
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                yield value


class _TorchDDP(System):
    def __init__(self, module: nn.Module, device: torch.device) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.name = "ddp"
        ids = [device.index] if device.type == "cuda" else None
        self.model = nn.parallel.DistributedDataParallel(
            module, device_ids=ids, gradient_as_bucket_view=True
        )
        # torch's own Python all-reduce hook (the same arithmetic as the built-in one), so that
        # the benchmark sees and counts the all-reduces DDP's reducer issues.
        self.model.register_comm_hook(None, default_hooks.allreduce_hook)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **ADAMW)


class _Zero(_TorchDDP):
    def __init__(self, module: nn.Module, device: torch.device) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        super().__init__(module, device)
        self.name = "zero"
        self.optimizer = ZeroRedundancyOptimizer(
            self.model.parameters(), optimizer_class=torch.optim.AdamW,
            parameters_as_bucket_view=True, **ADAMW,
        )

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer.optim


class _FSDP2(System):
    def __init__(self, module: nn.Module, device: torch.device, *,
                 reshard_after_forward: bool = False, mesh: Any = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.name = "fsdp2-reshard" if reshard_after_forward else "fsdp2"
        # A pipeline stage is sharded over its own data-parallel ranks, the mesh's "dp" row.
        mesh = (init_device_mesh(device.type, (dist.get_world_size(),)) if mesh is None
                else mesh["dp"])
        # One FSDP unit per block and one at the root: the layout FSDP2's docs recommend,
        # so each block's gather and reduction overlap with its neighbours' compute.
        for child in _block_modules(module):
            fully_shard(child, mesh=mesh, reshard_after_forward=reshard_after_forward)
        self.model = fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **ADAMW)


def _block_modules(module: nn.Module) -> list[nn.Module]:
    blocks = getattr(module, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    if isinstance(blocks, nn.ModuleDict):  # a pipeline stage's blocks, by their whole-model index
        return list(blocks.values())
    return [m for m in module.children() if any(True for _ in m.parameters())]


class _Distopt(System):
    def __init__(
        self, module: nn.Module, *, name: str, reduce: bool, gather: bool,
        bucket_size: int | None, shard_grads: bool = False, shard_params: bool = False,
        reshard_after_forward: bool = True, mesh: Any = None,
        tied_params: Mapping[str, nn.Parameter] | None = None,
    ) -> None:
        self.name = name
        # On a (pp, dp) mesh the module is a pipeline stage: reduced over "dp", its verdicts
        # and the tie's grads over "pp" (see distopt/pipelining.py).
        self.model = distopt.DistributedDataParallel(
            module, bucket_size=bucket_size, overlap_grad_reduce=reduce,
            shard_grads=shard_grads, shard_params=shard_params,
            reshard_after_forward=reshard_after_forward, device_mesh=mesh,
            tied_params=tied_params,
        )
        self.optimizer = distopt.DistributedOptimizer(
            self.model, torch.optim.AdamW, overlap_param_gather=gather, **ADAMW
        )

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def sync(self) -> None:
        self.model.finish_grad_sync()

    def finish_param_sync(self) -> None:
        self.model.finish_param_sync()

    def full_params(self) -> list[torch.Tensor]:
        with self.model.gathered_params():  # placeholders between uses with sharded params
            return [p.detach().clone() for p in self.model.parameters()]

    def state_bytes(self) -> dict[str, int]:
        report = distopt.measure_state_bytes(self.optimizer)
        return {
            "params": report.params,
            "grads": report.grads,
            "main_params": report.main_params,
            "main_grads": report.main_grads,
            "optimizer_state": report.optimizer_state,
        }


class _Basic(_Distopt):
    def __init__(self, module: nn.Module, *, bucket_size: int | None) -> None:
        self.name = "basic"
        self.model = distopt.DistributedDataParallel(
            module, bucket_size=bucket_size, use_distributed_optimizer=False
        )
        self.optimizer = distopt.BasicOptimizer(self.model, torch.optim.AdamW, **ADAMW)


def build_system(
    name: str, module: nn.Module, device: torch.device, *, bucket_size: int | None = None,
    mesh: Any = None, tied_params: Mapping[str, nn.Parameter] | None = None,
) -> System:
    """Wrap ``module`` (already on ``device``) as configuration ``name`` of ``SYSTEMS``.

    With ``mesh``, a (pp, dp) ``DeviceMesh``, ``module`` is one pipeline stage, sharded over
    the mesh's "dp" dimension (FSDP2 and distopt only; see ``stages.py``); distopt sums the
    grads of ``tied_params`` across the stages that hold them.
    """
    if mesh is not None and name not in STAGE_SYSTEMS:
        raise ValueError(f"{name} has no pipeline-stage mode; choose from "
                         f"{', '.join(STAGE_SYSTEMS)}")
    if name == "ddp":
        return _TorchDDP(module, device)
    if name == "zero":
        return _Zero(module, device)
    if name in ("fsdp2", "fsdp2-reshard"):
        return _FSDP2(module, device, reshard_after_forward=name == "fsdp2-reshard", mesh=mesh)
    if name in _DISTOPT_OVERLAPS:
        reduce, gather = _DISTOPT_OVERLAPS[name]
        return _Distopt(module, name=name, reduce=reduce, gather=gather, bucket_size=bucket_size,
                        shard_grads=name == "distopt-shard-grads",
                        shard_params=name.startswith("distopt-shard-params"),
                        reshard_after_forward=name != "distopt-shard-params-keep",
                        mesh=mesh, tied_params=tied_params)
    if name == "basic":
        return _Basic(module, bucket_size=bucket_size)
    raise ValueError(
        f"unknown system {name!r}; choose from "
        f"{', '.join(SYSTEMS + SPLIT_OVERLAP + SHARDED_PARAMS)} (the Muon ones: "
        "bench.muon.build_muon_system; Megatron-Core and DeepSpeed: bench.peers.build_peer_system)"
    )


# (overlap_grad_reduce, overlap_param_gather) of each distopt configuration.
_DISTOPT_OVERLAPS = {
    "distopt": (True, True),
    "distopt-no-overlap": (False, False),
    "distopt-overlap-reduce": (True, False),
    "distopt-overlap-gather": (False, True),
    "distopt-shard-grads": (True, True),
    "distopt-shard-params": (True, True),
    "distopt-shard-params-keep": (True, True),
}

STAGE_SYSTEMS = ("fsdp2", "fsdp2-reshard", *_DISTOPT_OVERLAPS)
"""The configurations with a pipeline-stage mode (``distopt bench --pp``)."""


def system_bytes_per_param(name: str, d: int, optimizer_state_bytes: float = 8) -> float:
    """What system ``name`` keeps per parameter between steps, for fp32 params and grads with
    Adam (or ``optimizer_state_bytes`` of state per param: the Muon recipe's mean): distopt's
    own table, ``bytes_per_param_breakdown``, regrouped by what each peer shards."""
    fp32 = bytes_per_param_breakdown(torch.float32, torch.float32,
                                     optimizer_state_bytes=optimizer_state_bytes,
                                     shard_grads=name == "distopt-shard-grads",
                                     shard_params=name.startswith("distopt-shard-params"))
    if name in ("ddp", "basic", "ddp-muon"):
        return fp32.total(d, distributed=False)
    if name == "zero":
        # params and grads replicated, Adam's moments sharded
        return fp32.params + fp32.grads + fp32.optimizer_state / d
    if name in ("fsdp2", "fsdp2-reshard"):
        return fp32.total(d, distributed=False) / d  # between steps everything is sharded (ZeRO-3)
    if name == "deepspeed-z3":
        # Between steps everything is partitioned, the fp32 model's params and an fp32 master
        # copy of them both, and its flat buffer of reduced grad partitions is kept.
        return (2 * fp32.params + fp32.grads + fp32.optimizer_state) / d
    if name.startswith("deepspeed"):
        # Between steps: params replicated, an fp32 master copy and Adam's moments sharded; the
        # grads (whole with ZeRO-1, a shard with ZeRO-2) live only from backward to step.
        return fp32.params + (fp32.params + fp32.optimizer_state) / d
    return fp32.total(d)
