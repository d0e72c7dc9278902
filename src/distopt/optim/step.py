"""The step of a distopt optimizer, after the grad sync: one pipeline over step chunks.

[Note: step chunks]
A step must know two things of ALL grads before it changes any param: whether some rank saw an
inf or nan (the loss scaler's verdict) and the global norm (the clip coefficient). So it runs
in two passes over the main params, each pass chunk by chunk:

1. statistics: each chunk's fp32 grads are unscaled (with a loss scaler; an inf raises the
   flag) and their norms taken; then one reduction each for the verdict and the norm.
2. update: each chunk's grads are clipped by the global coefficient, their zeros counted, and
   the inner torch optimizers step the chunk's main params.

A chunk source says what a chunk is:

* ``WholeShard``: every main param at once, one chunk. The fp32 main grads are persistent (the
  reduced grads themselves, or one copy per step), so pass 1 unscales them for good, and pass 2
  steps every inner optimizer once; with state held below fp32 (``state_dtype``) pass 2 steps
  one bucket's shard per chunk instead, so that only that chunk's state is expanded to fp32
  (see [Note: state precision] in optim/state_precision.py).
* ``BucketByBucket``: one bucket's shard at a time, for state that exists only during the step:
  with ``store_param_remainders`` the fp32 masters (and, for bf16/fp16 grads, the fp32 main
  grads) are built for one bucket, stepped and dropped (see [Note: param remainders]). Fresh
  grad copies are made in both passes and unscaled in both (the same bits each time).

Both sources give the same bits: unscaling and clipping are element-wise, the norms are summed
in one fixed order (the counted main params', whatever the chunks), zero counts are exact, and
an element-wise or whole-tensor optimizer updates each element, or each param, alone, so
stepping a chunk is stepping its params within the whole. Params no rank computed a grad for
(``find_unused_parameters``) are left out of the inner step, as torch.optim skips ``.grad``
None; that is the one way the step skips a param. The next state format is a new chunk source,
not another copy of the step; the state's precision is one stage around each chunk's inner step
(see [Note: state precision] in optim/state_precision.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import CommStats
from . import grad_stats
from .main_params import ShardMainParams
from .offload import OffloadTier
from .state_precision import StatePrecision


@dataclass(frozen=True, slots=True)
class StepResult:
    """What ``step()`` did: whether params changed, the global grad norm (before clipping;
    computed when ``clip_grad`` is set) and the zero elements of the clipped grads (counted
    when ``log_num_zeros`` is set).

    A step skipped by the loss scaler (inf or nan in the grads on some rank) has
    ``updated=False`` and neither figure: params, optimizer state and step counts are untouched.
    """

    updated: bool
    """Whether the params changed: False for a step skipped by the loss scaler."""
    grad_norm: float | None = None
    """The global norm of the reduced grads (after unscaling and value clipping, before norm
    clipping), one norm over every shard, bucket and model-parallel rank; None without
    ``clip_grad``."""
    num_zeros: int | None = None
    """The zero elements of the clipped grads, summed over the ranks; None without
    ``log_num_zeros``."""
    grad_norms: dict[str, float] | None = None
    """Each param's reduced grad norm (after unscaling and value clipping, before norm
    clipping), by the DDP's name; with ``log_grad_norms``: what torch users read off
    ``p.grad.norm()`` for logging, which distopt's ``p.grad`` markers refuse."""


class Unscaler(Protocol):
    """The loss scale a step unscales by, and where its agreed inf/nan verdict goes: a distopt
    loss scaler, or a ``torch.amp.GradScaler`` seen through optim/amp.py."""

    @property
    def scale(self) -> float: ...

    def update(self, found_inf: bool) -> None: ...


class ChunkSource(Protocol):
    """Where a step's main params and their fp32 grads come from; see [Note: step chunks]."""

    def begin(self) -> None:
        """Before pass 1."""

    def grad_chunks(self) -> Iterator[contextlib.AbstractContextManager[list[nn.Parameter]]]:
        """Pass 1: each chunk's main params, their fp32 grads as ``.grad`` inside the block."""

    def step_chunks(
        self,
    ) -> Iterator[contextlib.AbstractContextManager[tuple[list[nn.Parameter], bool]]]:
        """Pass 2: each chunk's main params, holding the fp32 masters and grads inside the
        block, and whether those grads are fresh copies (unscaled again)."""

    def end(self) -> None:
        """After pass 2: the updated masters into this rank's part of the model params."""

    def release(self) -> None:
        """After the step, updated or skipped: no main param keeps a ``.grad``."""


class WholeShard:
    """Every main param at once, with persistent fp32 grads; ``by_bucket``: pass 2 steps one
    bucket's shard at a time."""

    def __init__(self, owned: Sequence[ShardMainParams], mains: list[nn.Parameter],
                 by_bucket: bool = False, out_by_bucket: bool = False) -> None:
        """``out_by_bucket`` (with ``by_bucket``): each chunk writes its params as it closes,
        so that no later read of its masters is needed (the offload tier's)."""
        self.owned = owned
        self.mains = mains
        self.by_bucket = by_bucket or out_by_bucket
        self.out_by_bucket = out_by_bucket

    def begin(self) -> None:
        for owned in self.owned:
            owned.copy_grads_in()
            owned.expose_grads()

    def grad_chunks(self) -> Iterator[contextlib.AbstractContextManager[list[nn.Parameter]]]:
        yield contextlib.nullcontext(self.mains)

    def step_chunks(
        self,
    ) -> Iterator[contextlib.AbstractContextManager[tuple[list[nn.Parameter], bool]]]:
        if not self.by_bucket:
            yield contextlib.nullcontext((self.mains, False))
            return
        for owned in self.owned:
            for bucket in range(owned.num_buckets):
                yield self._bucket(owned, bucket)

    @contextlib.contextmanager
    def _bucket(self, owned: ShardMainParams, bucket: int
                ) -> Iterator[tuple[list[nn.Parameter], bool]]:
        yield owned.bucket_main_params(bucket), False
        if self.out_by_bucket:  # not after an error: the step stops there
            owned.copy_bucket_params_out(bucket)

    def end(self) -> None:
        if self.out_by_bucket:
            return  # the chunks wrote their params as they closed
        for owned in self.owned:
            owned.copy_params_out()

    def release(self) -> None:
        for owned in self.owned:
            owned.hide_grads()


class BucketByBucket:
    """One bucket's shard at a time, its masters (and grads) built for the chunk alone."""

    def __init__(self, owned: Sequence[ShardMainParams]) -> None:
        self.buckets = [(o, b) for o in owned for b in range(o.num_buckets)]

    def begin(self) -> None:
        pass

    def grad_chunks(self) -> Iterator[contextlib.AbstractContextManager[list[nn.Parameter]]]:
        for owned, bucket in self.buckets:
            yield _first(owned.bucket_grads(bucket))

    def step_chunks(
        self,
    ) -> Iterator[contextlib.AbstractContextManager[tuple[list[nn.Parameter], bool]]]:
        for owned, bucket in self.buckets:
            yield _masters_and_grads(owned, bucket)

    def end(self) -> None:
        pass  # the chunks wrote their params back as they closed

    def release(self) -> None:
        pass  # the chunks dropped their grads as they closed


@contextlib.contextmanager
def _first(grads: Any) -> Iterator[list[nn.Parameter]]:
    with grads as (mains, _fresh):
        yield mains


@contextlib.contextmanager
def _masters_and_grads(
    owned: ShardMainParams, bucket: int
) -> Iterator[tuple[list[nn.Parameter], bool]]:
    with owned.bucket_masters(bucket) as mains, owned.bucket_grads(bucket) as (_, fresh):
        yield mains, fresh


@dataclass(frozen=True, slots=True)
class GradNormLog:
    """What ``log_grad_norms`` needs: each counted piece's param name (``counted``'s order),
    every param name of this rank's models (the same on every rank summed over), and the
    groups the squares are summed over (the data-parallel and tensor-parallel ones: a
    pipeline stage logs its own params)."""

    names: list[str]
    all_names: list[str]
    groups: list[Any]


@dataclass(kw_only=True, slots=True)
class StepPipeline:
    """The two passes of [Note: step chunks] over one optimizer's main params."""

    source: ChunkSource
    optimizers: list[torch.optim.Optimizer]
    param_groups: list[dict[str, Any]]
    counted: dict[nn.Parameter, None]
    """The main params whose grads global statistics count on this rank, in the sum's order."""
    reduce_groups: list[dist.ProcessGroup | None]
    device: torch.device
    stats: CommStats | None
    clip_grad: float | None
    log_num_zeros: bool
    clip_grad_value: float | None = None
    """Clamp every reduced grad element to [-v, v] (torch's ``clip_grad_value_``)."""
    grad_norm_log: GradNormLog | None = None
    """With ``log_grad_norms``: which param each counted piece is of, and over which ranks
    the pieces' squares are summed."""
    state_precision: StatePrecision | None = None
    """With state held below fp32: expands each chunk's state around its inner step."""
    offload: OffloadTier | None = None
    """With ``offload_dir``: where each chunk's masters and state rest between steps, one
    region per chunk ([Note: the offload tier] in optim/offload.py)."""
    local: Any = None
    """The params of torch DDP's ignore list (``LocalParams``), stepped after the main params
    with their own local grads ([Note: ignored params stepped locally] in
    optim/local_params.py); None without."""

    def run(self, loss_scaler: Unscaler | None, unused: set[nn.Parameter]) -> StepResult:
        """One step over grads already synced; ``unused``: main params no rank computed a
        grad for, left out of the update."""
        try:
            return self._run(loss_scaler, unused)
        finally:
            self.source.release()

    def _run(self, loss_scaler: Unscaler | None, unused: set[nn.Parameter]) -> StepResult:
        groups, device, stats = self.reduce_groups, self.device, self.stats
        counted = self.counted
        inv_scale = None
        if loss_scaler is not None:
            inv_scale = grad_stats.inverse_scale(1.0 / loss_scaler.scale, device)

        self.source.begin()
        norms: dict[nn.Parameter, torch.Tensor] = {}
        wants_norms = self.clip_grad is not None or self.grad_norm_log is not None
        if inv_scale is not None or wants_norms or self.clip_grad_value is not None:
            found_inf = grad_stats.inf_flag(device)
            for chunk in self.source.grad_chunks():
                with chunk as mains:
                    if inv_scale is not None:
                        grad_stats.unscale_(_grads(mains), found_inf, inv_scale)
                    self._clamp(_grads(mains))
                    if wants_norms:
                        mine = [m for m in mains if m in counted]
                        norms.update(zip(mine, grad_stats.grad_norms(_grads(mine)), strict=True))
            local_grads = self.local.grads() if self.local is not None else []
            if inv_scale is not None and local_grads:  # an inf there skips every rank's step
                grad_stats.unscale_(local_grads, found_inf, inv_scale)
            self._clamp(local_grads)
            if loss_scaler is not None:
                found = grad_stats.any_rank_found_inf(found_inf, groups, stats)
                loss_scaler.update(found)
                if found:
                    return StepResult(updated=False)

        per_param = None
        log = self.grad_norm_log
        if log is not None:
            per_param = grad_stats.norms_by_name(
                [norms.get(m) for m in counted], log.names, log.all_names, log.groups, device,
                stats)
        grad_norm, coef = None, None
        if self.clip_grad is not None:
            total_norm = grad_stats.global_norm([norms[m] for m in counted], groups, device, stats)
            grad_norm = float(total_norm.item())
            coef = grad_stats.clip_coefficient(self.clip_grad, total_norm)

        zeros = grad_stats.zero_counter(device) if self.log_num_zeros else None
        tier = self.offload
        for index, chunk in enumerate(self.source.step_chunks()):
            if tier is not None:
                tier.before_step(index)
            with chunk as (mains, fresh):
                grads = _grads(mains)
                if fresh and inv_scale is not None:
                    grad_stats.unscale_(grads, grad_stats.inf_flag(device), inv_scale)
                if fresh:
                    self._clamp(grads)
                if coef is not None and grads:
                    torch._foreach_mul_(grads, coef)
                if zeros is not None:
                    grad_stats.add_zeros(zeros, _grads([m for m in mains if m in counted]))
                stepped = [m for m in mains if m not in unused]
                with (self.state_precision.fp32(stepped) if self.state_precision
                      else contextlib.nullcontext()):
                    self._inner_step(stepped)
            if tier is not None:
                tier.after_step(index, mains, self.optimizers[0].state)
        if tier is not None:
            tier.finish_step()
        if self.local is not None:  # each rank's own copies, with one coefficient everywhere
            local_grads = self.local.grads()
            if coef is not None and local_grads:
                torch._foreach_mul_(local_grads, coef)
            self.local.step(self.param_groups)
        self.source.end()
        num_zeros = None if zeros is None else grad_stats.total_zeros(zeros, groups, stats)
        return StepResult(updated=True, grad_norm=grad_norm, num_zeros=num_zeros,
                          grad_norms=per_param)

    def _clamp(self, grads: list[torch.Tensor]) -> None:
        # torch's clip_grad_value_, on the reduced grads this rank holds: element-wise, so
        # the same as on the whole averaged grad.
        if self.clip_grad_value is not None and grads:
            torch._foreach_clamp_min_(grads, -self.clip_grad_value)
            torch._foreach_clamp_max_(grads, self.clip_grad_value)

    def _inner_step(self, mains: list[nn.Parameter]) -> None:
        """Step ``mains`` with the inner optimizers: every group at once when they are all of
        them, else each group narrowed to them for the call."""
        if len(mains) == sum(len(group["params"]) for group in self.param_groups):
            for inner in self.optimizers:
                inner.step()
            return
        chosen = set(mains)
        saved = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [p for p in group["params"] if p in chosen]
            for inner in self.optimizers:
                if any(group["params"] for group in inner.param_groups):
                    inner.step()
        finally:
            for group, params in zip(self.param_groups, saved, strict=True):
                group["params"] = params


def _grads(mains: list[nn.Parameter]) -> list[torch.Tensor]:
    return [m.grad for m in mains]
