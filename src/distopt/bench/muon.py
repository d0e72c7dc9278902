"""The benchmark's Muon configurations: three ways to run the same Muon recipe on d ranks.

All three train the hidden matrices with ``torch.optim.Muon`` and everything else with AdamW
(``distopt.optim.recipes.hidden_matrices``; for the MLP, every weight matrix), with the same
options, so they compute the same step; they differ in who runs Newton-Schulz on which matrix
and what crosses the wire:

* ``distopt-muon``: distopt, each matrix owned whole by one rank, which alone runs its
  Newton-Schulz; one reduce-scatter and one all-gather per bucket, as for AdamW.
* ``ddp-muon``: torch DDP and plain torch optimizers on every rank: grads all-reduced, the
  full momentum kept and Newton-Schulz run for every matrix on every rank (fully redundant).
* ``gather-muon``: Moonshot's Distributed Muon, on distopt's element-wise (ZeRO-1/2) shards:
  each rank keeps the momentum of its shard, the momentum updates of every bucket that holds
  matrices are all-gathered (one more all-gather per such bucket), and every rank whose shard
  holds a part of a matrix runs Newton-Schulz on the whole of it and keeps its part. A matrix
  split across k ranks' shards is orthogonalised k times.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.optim._muon as torch_muon
from torch import nn

import distopt

from ..optim.recipes import hidden_matrices
from ..plan.ownership import mean_state_bytes
from .systems import ADAMW, System, _Distopt, _TorchDDP

MUON_SYSTEMS = ("distopt-muon", "ddp-muon", "gather-muon")
"""The Muon configurations, run only when asked for (``--systems``)."""
MUON_BASELINES = ("ddp-muon", "gather-muon")
"""The peers distopt's Muon is compared with."""

MUON: dict[str, Any] = {
    "lr": ADAMW["lr"],  # with match_rms_adamw Muon takes AdamW's lr (see [Note: the Muon recipe])
    "momentum": 0.95,
    "nesterov": True,
    "weight_decay": ADAMW["weight_decay"],
    "adjust_lr_fn": "match_rms_adamw",
    "ns_coefficients": (3.4445, -4.775, 2.0315),
    "ns_steps": 5,
    "eps": 1e-7,
}
_ADAMW_GROUP = {k: v for k, v in ADAMW.items() if k != "foreach"}


def _split(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    return hidden_matrices(module)


def muon_state_bytes(module: nn.Module) -> float:
    """Mean optimizer state per param of the Muon recipe on ``module``: 4 B of momentum per
    matrix element, 8 B of AdamW moments per other element."""
    matrices, rest = _split(module)
    return mean_state_bytes([(tuple(p.shape), (torch.optim.Muon, {})) for p in matrices]
                            + [(tuple(p.shape), (torch.optim.AdamW, {})) for p in rest])


class _DistoptMuon(_Distopt):
    def __init__(self, module: nn.Module, *, bucket_size: int | None) -> None:
        self.name = "distopt-muon"
        matrices, rest = _split(module)
        self.model = distopt.DistributedDataParallel(module, bucket_size=bucket_size)
        self.optimizer = distopt.DistributedOptimizer(
            self.model, torch.optim.Muon, overlap_param_gather=True,
            params=[{"params": matrices},
                    {"params": rest, "optimizer": torch.optim.AdamW, **_ADAMW_GROUP}],
            **MUON,
        )


class _Both:
    """Two torch optimizers stepped as one."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    @property
    def state(self) -> dict[Any, Any]:
        return {k: v for o in self.optimizers for k, v in o.state.items()}


class _TorchDDPMuon(_TorchDDP):
    def __init__(self, module: nn.Module, device: torch.device) -> None:
        super().__init__(module, device)
        self.name = "ddp-muon"
        matrices, rest = _split(module)
        muon = {k: v for k, v in MUON.items() if k not in ("ns_coefficients", "ns_steps", "eps")}
        self.optimizer = _Both(torch.optim.Muon(matrices, **muon),
                               torch.optim.AdamW(rest, **ADAMW))

    def _inner_optimizer(self) -> Any:
        return self.optimizer


class _GatheredMuon(System):
    """Moonshot's Distributed Muon on distopt's element-wise shards; see the module's doc."""

    def __init__(self, module: nn.Module, *, bucket_size: int | None) -> None:
        self.name = "gather-muon"
        matrices, rest = _split(module)
        self.model = distopt.DistributedDataParallel(module, bucket_size=bucket_size)
        # AdamW steps its shards of the rest and all-gathers every bucket; the matrices' shards
        # are updated before it, so that gather carries them too.
        self.optimizer = distopt.DistributedOptimizer(
            self.model, torch.optim.AdamW, params=[{"params": rest}],
            overlap_param_gather=True, **ADAMW,
        )
        wanted = set(matrices)
        # Per bucket holding matrices: (bucket, [(param, its range in the bucket, [(piece of it
        # on this rank, momentum of the piece)])]).
        self._buckets: list[tuple[Any, list[tuple[nn.Parameter, Any, list[Any]]]]] = []
        for buffer in self.model.flat_buffers:
            pieces: dict[nn.Parameter, list[Any]] = {}
            for piece in buffer.layout.shard_pieces(buffer.dp_rank):
                param = buffer.params[piece.param_index]
                if param in wanted:
                    momentum = torch.zeros(piece.local_range.size, device=param.device)
                    pieces.setdefault(param, []).append((piece, momentum))
            for index, bucket in enumerate(buffer.buckets):
                entries = [(p, rng, pieces.get(p, []))
                           for p, rng in zip(bucket.params, bucket.param_ranges, strict=True)
                           if p in wanted]
                if entries:
                    self._buckets.append((bucket, entries))
                    assert all(piece.bucket == index for _, _, own in entries
                               for piece, _ in own)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def sync(self) -> None:
        self.model.finish_grad_sync()

    def finish_param_sync(self) -> None:
        # The step's gathers overlap the next forward: whoever reads the params after the
        # last step (the checksum) must wait for them.
        self.model.finish_param_sync()

    @torch.no_grad()
    def step(self) -> None:
        self.model.finish_grad_sync()
        self.model.finish_param_sync()  # this step writes the shards the last gather filled
        lr, mu, wd = MUON["lr"], MUON["momentum"], MUON["weight_decay"]
        for bucket, entries in self._buckets:
            # The momentum update of this rank's pieces, in place in a shard of the bucket.
            update_shard = torch.zeros_like(bucket.grad_shard, dtype=torch.float32)
            for _, _, own in entries:
                for piece, momentum in own:
                    lo, hi = piece.local_range.start, piece.local_range.end
                    grad = bucket.grad_shard[lo:hi]
                    momentum.lerp_(grad, 1 - mu)  # torch Muon's arithmetic, element by element
                    update_shard[lo:hi] = grad.lerp(momentum, mu) if MUON["nesterov"] else momentum
            update = torch.empty(bucket.numel, dtype=torch.float32,
                                 device=update_shard.device)
            dist.all_gather_into_tensor(update, update_shard, group=self.model.process_group)
            for param, rng, own in entries:
                if not own:
                    continue  # no part of it on this rank
                full = update[rng.start : rng.end].view(param.shape)
                ortho = torch_muon._zeropower_via_newtonschulz(
                    full, MUON["ns_coefficients"], MUON["ns_steps"], MUON["eps"]).reshape(-1)
                adjusted = torch_muon._adjust_lr(lr, MUON["adjust_lr_fn"], param.shape)
                for piece, _ in own:
                    lo, hi = piece.local_range.start, piece.local_range.end
                    start, end = piece.param_range.start, piece.param_range.end
                    shard = bucket.param_shard[lo:hi]
                    shard.mul_(1 - lr * wd)
                    shard.add_(ortho[start:end], alpha=-adjusted)
        self.optimizer.step()

    def state_bytes(self) -> dict[str, int]:
        report = distopt.measure_state_bytes(self.optimizer)
        momentum = sum(m.numel() * m.element_size() for _, entries in self._buckets
                       for _, _, own in entries for _, m in own)
        return {
            "params": report.params,
            "grads": report.grads,
            "main_params": report.main_params,
            "main_grads": report.main_grads,
            "optimizer_state": report.optimizer_state + momentum,
        }


def build_muon_system(
    name: str, module: nn.Module, device: torch.device, *, bucket_size: int | None = None
) -> System:
    """Wrap ``module`` as Muon configuration ``name`` of ``MUON_SYSTEMS``."""
    if name == "distopt-muon":
        return _DistoptMuon(module, bucket_size=bucket_size)
    if name == "ddp-muon":
        return _TorchDDPMuon(module, device)
    if name == "gather-muon":
        return _GatheredMuon(module, bucket_size=bucket_size)
    raise ValueError(f"unknown Muon system {name!r}; choose from {', '.join(MUON_SYSTEMS)}")
