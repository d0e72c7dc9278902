"""DistributedOptimizer (ZeRO-1/2) and BasicOptimizer (replicated), over distopt DDP buffers.

Data flow of one step, for one buffer of d ranks (docs/design.md has the memory table and the
map of who calls whom)::

    grad_data  [N]      grads accumulated by the DDP hooks (dtype grad_dtype)
      | reduce-scatter (average), bucket by bucket, overlapped with backward
    grad_shard [N/d]    this rank's chunk of every bucket, now reduced
      | fp32 grads: used in place;  else copied once per bucket into grad_fp32 [N/d]
      | (with store_param_remainders: into a transient of one bucket, during its step)
    pieces              one fp32 main param per (param, shard) overlap, a view into
                        param_data's shard (fp32 params) or into shard_fp32 [N/d] (otherwise);
                        its .grad a view into the shard of the reduced grads
      | unscale + inf check (fp16), global norm + clip, inner torch.optim step on the pieces
    param_shard [N/d]   updated in place (fp32), or cast from shard_fp32 once per bucket
      | all-gather, bucket by bucket, optionally overlapped with the next forward
    param_data [N]      every rank's model params are up to date

The inner optimizer is an ordinary ``torch.optim`` optimizer whose params are the pieces, so
its state (Adam's moments) exists only for the 1/d of the elements this rank owns. Every memory
cost beyond model params and grads is therefore 1/d of the model, padding aside; nothing is
allocated per step but the inner optimizer's own temporaries, except with
``store_param_remainders``, whose fp32 masters and (for bf16/fp16 grads) fp32 main grads
exist only during the step, one bucket's shard at a time (see [Note: param remainders]).
BasicOptimizer
is the same pipeline with every rank owning whole buckets, all-reduced grads and no gather.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from .buckets import ParamAndGradBuffer
from .ddp import DistributedDataParallel
from .layout.elementwise import ShardPiece
from .optim import grad_stats as clip
from .optim.kinds import (
    check_optimizer_cls,
    needs_matrices,
    whole_tensor_cost,
)
from .options import StepOptions
from .parallel.dtensor import is_dtensor, local_tensor
from .parallel.groups import ParallelGroups, common_groups
from .parallel.tensor_parallel import grad_statistics
from .scaler import ConstantLossScaler, DynamicLossScaler, LossScaler


@dataclass(frozen=True, slots=True)
class StepResult:
    """What ``step()`` did: whether params changed, the global grad norm (before clipping;
    computed when ``clip_grad`` is set) and the zero elements of the clipped grads (counted
    when ``log_num_zeros`` is set).

    A step skipped by the loss scaler (inf or nan in the grads on some rank) has
    ``updated=False`` and neither figure: params, optimizer state and step counts are untouched.
    """

    updated: bool
    grad_norm: float | None = None
    num_zeros: int | None = None


class StateDictFormat(Protocol):
    """What an optimizer's ``state_dict()`` and ``load_state_dict()`` do. distopt.checkpoint
    registers its own; see [Note: one-way imports] in distopt/checkpoint/__init__.py."""

    def state_dict(self, opt: Any) -> dict[str, Any]: ...

    def load_state_dict(self, opt: Any, state_dict: dict[str, Any]) -> None: ...


_state_dict_format: StateDictFormat | None = None


def register_state_dict_format(state_format: StateDictFormat) -> None:
    """Make ``state_format`` what every distopt optimizer's state-dict methods call."""
    global _state_dict_format
    _state_dict_format = state_format


def _registered_state_dict_format() -> StateDictFormat:
    if _state_dict_format is None:
        raise RuntimeError(
            "no optimizer state-dict format is registered; `import distopt` registers "
            "distopt.checkpoint's"
        )
    return _state_dict_format


# [Note: param remainders]
# With ``store_param_remainders`` (bf16 params only) a rank keeps no fp32 main params: the bf16
# model param holds the high 16 bits of each fp32 master and an int16 remainder the low 16, so
# the two together are the fp32 master, bit for bit, at 2 bytes per owned element instead of 4.
# The step rebuilds the fp32 masters of one bucket's shard at a time (a transient of one
# bucket), steps that bucket's pieces, and splits the result back before the next bucket.
# bf16/fp16 grads get their fp32 copies the same way, so no fp32 main grads are kept either
# (main params have no ``.grad`` between steps). What the step needs of all grads before
# changing any param (the loss scaler's inf verdict, the global norm for clipping) comes from
# a first pass over the buckets, each bucket's grads copied to fp32, unscaled and their norms
# taken, then dropped; the second pass copies and unscales again (the same bits), clips with
# the global coefficient, counts zeros and steps. The inner optimizer is element-wise and
# counts ``step`` per param, so stepping one bucket's pieces at a time is the fp32-master
# path's step, bit for bit; the norms are summed in the fp32-master path's order. The peak
# of a step is then one bucket shard's fp32 masters and fp32 grads and the inner optimizer's
# temporaries of that bucket (AdamW's foreach step: one more fp32 tensor), against the
# fp32-master path's temporaries of the whole shard; docs/mixed-precision.md has the numbers.
# Splitting cannot use the fp32-master path's cast (round to nearest, ties to even): at an
# exact tie (low half 0x8000) rounding down would leave a remainder of +0x8000, one past what
# an int16 holds. The split rounds to nearest with ties away from zero instead: a low half of
# 0x8000 or more adds one to the high half (bf16 is sign and magnitude, so one more is one ulp
# further from zero) and leaves the remainder low - 0x10000 in [-0x8000, -1]; a lower
# one is kept as is, in [0, 0x7fff]. So the model param equals the fp32-master path's cast
# except at exact ties whose high half is even, where it is one ulp further from zero; the
# fp32 master is the same, and so is every later step given the same grads (in training the
# next forward sees the tie's param, so the grads differ a little from then on;
# docs/mixed-precision.md measures how much). Between steps the main params are
# placeholders (a zero-stride view of one scalar): read the masters with
# ``opt.main_param_values()``; checkpoints read and write them inside
# ``opt.main_params_materialized()``, so a checkpoint holds fp32 masters either way and loads
# into an optimizer with or without the option. A plain checkpoint's fp32 weights load as the
# masters, and every rank rounds all of its params with ``bf16_of_fp32``, as the split does.


def split_fp32(master: torch.Tensor, high: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write fp32 ``master`` as bf16 ``high`` and int16 ``remainder``; see
    [Note: param remainders]."""
    bits = master.view(torch.int32)
    # The remainder is the low half read as an int16: low when it is below 0x8000, and
    # low - 0x10000 (what rounding the high half up leaves) when it is not. Narrowing an int32
    # keeps its low 16 bits, so this is one conversion, with no temporary.
    remainder.copy_(bits)
    # Adding 0x8000 carries into the high half exactly when low >= 0x8000. (Only NaNs with a
    # high half of 0x7fff or 0xffff wrap around, into 0x8000 and 0x0000 with a negative
    # remainder; join_fp32 wraps back to the same bits.) One int32 temporary of the shard.
    high.view(torch.int16).copy_((bits + 0x8000).bitwise_right_shift_(16))


def bf16_of_fp32(master: torch.Tensor) -> torch.Tensor:
    """The bf16 param ``split_fp32`` leaves for fp32 ``master`` (nearest, ties away from
    zero); a new tensor."""
    bits = (master.view(torch.int32) + 0x8000).bitwise_right_shift_(16)
    return bits.to(torch.int16).view(torch.bfloat16)


def join_fp32(high: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master that bf16 ``high`` and int16 ``remainder`` split; a new tensor."""
    bits = high.view(torch.int16).to(torch.int32).bitwise_left_shift_(16)
    return bits.add_(remainder).view(torch.float32)


class _OwnedMainParams:
    """The fp32 main params of the part of one buffer that this rank owns, as pieces."""

    def __init__(
        self,
        buffer: ParamAndGradBuffer,
        *,
        sharded: bool,
        store_remainders: bool = False,
        whole_params: frozenset[nn.Parameter] = frozenset(),
    ) -> None:
        """``whole_params``: the params a whole-tensor optimizer steps; their pieces are whole
        (the layout makes sure of it) and their main params take the param's own shape. See
        [Note: optimizer kinds]."""
        self.buffer = buffer
        layout = buffer.layout
        pieces = layout.shard_pieces(buffer.dp_rank) if sharded else layout.whole_pieces()
        # Per bucket, the owned regions of the model buffers and their offset in the fp32 copies.
        self.param_regions = [b.param_shard if sharded else b.param_data for b in buffer.buckets]
        self.grad_regions = [b.grad_shard if sharded else b.grad_data for b in buffer.buckets]
        offsets, total = [], 0
        for region in self.param_regions:
            offsets.append(total)
            total += region.numel()

        fp32 = torch.float32
        device = buffer.param_data.device
        # Separate fp32 copies only where the model's dtype is not fp32 (docs/design.md, Memory).
        self.shard_fp32 = None
        self.remainders = None  # with store_remainders; see [Note: param remainders]
        if store_remainders:
            self.remainders = torch.zeros(total, dtype=torch.int16, device=device)
        elif buffer.param_dtype != fp32:
            self.shard_fp32 = torch.empty(total, dtype=fp32, device=device)
        # With remainders, bf16/fp16 grads get fp32 copies one bucket at a time during the
        # step, like the masters; see [Note: param remainders].
        self.transient_grads = store_remainders and buffer.grad_dtype != fp32
        self.grad_fp32 = None
        if buffer.grad_dtype != fp32 and not self.transient_grads:
            self.grad_fp32 = torch.empty(total, dtype=fp32, device=device)
        self._main_segments = self._segments(self.shard_fp32, offsets, self.param_regions)
        self._grad_segments = self._segments(self.grad_fp32, offsets, self.grad_regions)
        self._remainder_segments = (
            self._segments(self.remainders, offsets, self.param_regions)
            if self.remainders is not None else []
        )
        self.copy_params_in()

        self.pieces: list[ShardPiece] = pieces
        self.main_params: list[nn.Parameter] = []
        # What a main param holds between steps with remainders: one scalar, seen as its shape.
        self._placeholder = (
            torch.zeros(1, dtype=fp32, device=device) if self.remainders is not None else None
        )
        for piece in pieces:
            grad = self._grad_segments[piece.bucket]
            lo, hi = piece.local_range.start, piece.local_range.end
            shape = self._main_shape(piece, whole_params)
            if self.remainders is None:
                main = self._main_segments[piece.bucket][lo:hi].view(shape)  # aliases fp32 copy
            else:
                main = self._placeholder.expand(shape)
            param = nn.Parameter(main, requires_grad=True)
            if not self.transient_grads:
                param.grad = grad[lo:hi].view(shape)
            self.main_params.append(param)
        # The (main param, piece) pairs of each bucket, for steps one bucket at a time.
        self._bucket_mains: list[list[tuple[nn.Parameter, ShardPiece]]] = [
            [] for _ in self.param_regions
        ]
        for main, piece in zip(self.main_params, pieces, strict=True):
            self._bucket_mains[piece.bucket].append((main, piece))

    @staticmethod
    def _segments(
        flat: torch.Tensor | None, offsets: list[int], regions: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        if flat is None:
            return regions
        return [flat[o : o + r.numel()] for o, r in zip(offsets, regions, strict=True)]

    def _main_shape(
        self, piece: ShardPiece, whole_params: frozenset[nn.Parameter]
    ) -> tuple[int, ...]:
        local = local_tensor(self.model_param(piece))
        if self.model_param(piece) not in whole_params:
            return (piece.param_range.size,)
        if piece.param_range.size != local.numel():
            raise AssertionError(
                "a whole-tensor param is split across ranks; the buffers were not laid out "
                "for its optimizer (DistributedDataParallel.own_whole)"
            )
        return tuple(local.shape)

    def model_param(self, piece: ShardPiece) -> nn.Parameter:
        return self.buffer.params[piece.param_index]

    def copy_params_in(self) -> None:
        """Model params -> fp32 main params (at construction)."""
        if self.shard_fp32 is not None:
            torch._foreach_copy_(self._main_segments, self.param_regions)

    def copy_grads_in(self) -> None:
        """Reduced grads -> fp32 main grads, one copy per bucket."""
        if self.grad_fp32 is not None:
            torch._foreach_copy_(self._grad_segments, self.grad_regions)

    def copy_params_out(self) -> None:
        """Updated fp32 main params -> this rank's region of the model's param buffer (with
        remainders the step has written it already)."""
        if self.shard_fp32 is not None:
            torch._foreach_copy_(self.param_regions, self._main_segments)

    # ------------------------------------------------------------------ remainders

    @property
    def num_buckets(self) -> int:
        return len(self.param_regions)

    @contextlib.contextmanager
    def bucket_masters(self, bucket: int) -> Iterator[list[nn.Parameter]]:
        """With remainders: the bucket's main params hold its fp32 masters (one transient
        bucket shard) inside the block, and are split back after it."""
        mains = self._bucket_mains[bucket]
        master = join_fp32(self.param_regions[bucket], self._remainder_segments[bucket])
        for main, piece in mains:
            lo, hi = piece.local_range.start, piece.local_range.end
            main.data = master[lo:hi].view(main.shape)
        try:
            yield [main for main, _ in mains]
        finally:
            split_fp32(master, self.param_regions[bucket], self._remainder_segments[bucket])
            for main, _ in mains:
                main.data = self._placeholder.expand(main.shape)

    @contextlib.contextmanager
    def bucket_grads(self, bucket: int) -> Iterator[tuple[list[nn.Parameter], bool]]:
        """The bucket's main params with their fp32 main grads as ``.grad`` inside the block,
        and whether those grads are new copies of the reduced grads. With transient grads they
        are (one transient bucket shard, dropped after the block); otherwise they are the
        persistent main grads."""
        mains = self._bucket_mains[bucket]
        if not self.transient_grads:
            yield [main for main, _ in mains], False
            return
        grad = self.grad_regions[bucket].float()
        for main, piece in mains:
            main.grad = grad[piece.local_range.start : piece.local_range.end].view(main.shape)
        try:
            yield [main for main, _ in mains], True
        finally:
            for main, _ in mains:
                main.grad = None

    def main_value(self, main: nn.Parameter, piece: ShardPiece) -> torch.Tensor:
        """The fp32 master values of a piece: the main param, or rebuilt from remainders."""
        if self.remainders is None:
            return main.detach()
        lo, hi = piece.local_range.start, piece.local_range.end
        return join_fp32(self.param_regions[piece.bucket][lo:hi],
                         self._remainder_segments[piece.bucket][lo:hi]).view(main.shape)


# [Note: one optimizer, several classes]
# The usual recipe for Muon trains the hidden matrices with Muon and the embeddings, norms and
# biases with AdamW. A param group may therefore name its own class under "optimizer"; groups
# without one use optimizer_cls. distopt builds one inner torch optimizer per class over that
# class's groups (in the user's order within it), and shares among them: the list
# ``param_groups`` (the very dicts they step with, in the user's order, so torch's LR
# schedulers set every group's lr), one ``state`` (their params are disjoint), and everything
# of the step around them: one grad sync, one loss-scaler verdict and one global clip norm over
# all grads, one param gather, one StepResult. optimizer_kwargs go to optimizer_cls only; a
# group of another class gives its options in the group, its class's defaults filling the
# rest. The groups of whole-tensor classes ([Note: optimizer kinds] in optim/kinds.py)
# have their params owned whole (DistributedDataParallel.own_whole) and their main params
# take each param's shape.


class _BufferOptimizer(torch.optim.Optimizer):
    """The shared step pipeline. Not constructed directly; see the two subclasses."""

    _sharded: bool

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
        check_optimizer_cls(optimizer_cls)
        if loss_scaler is not None and not isinstance(
            loss_scaler, (ConstantLossScaler, DynamicLossScaler)
        ):
            raise TypeError(
                "loss_scaler must be distopt.DynamicLossScaler() or distopt.ConstantLossScaler(s)"
            )
        # The DP group and TP mesh every model chunk shares, checked once.
        self.parallel: ParallelGroups = common_groups([m.parallel for m in models])
        _check_model_parallel_group(model_parallel_group, self.parallel.dp_group)
        if isinstance(loss_scaler, DynamicLossScaler):
            checked = [m for m in models if m.check_for_nan_in_grad]
            if checked:
                raise ValueError(
                    "a DynamicLossScaler skips the steps whose grads overflow, but the model was "
                    "built with check_for_nan_in_grad=True, which raises on them instead: drop "
                    "one of the two (check_for_nan_in_grad is meant for bf16/fp32 training)"
                )
        self.models = list(models)
        self.options = options
        self.loss_scaler = loss_scaler
        self.model_parallel_group = model_parallel_group
        # Groups over which the inf flag, the grad norm and the zero count are reduced: the DP
        # group when each rank owns a shard, then the model-parallel group, whose ranks hold
        # other parts of the model. Each grad element must be owned by exactly one rank of all.
        self._reduce_groups = [self.parallel.dp_group] if self._sharded else []
        if model_parallel_group is not None:
            self._reduce_groups.append(model_parallel_group)
        self._device = self.models[0].params[0].device

        param_groups = _normalize_param_groups(params, self.models)
        # The model params of each group as given: checkpoints name the groups by them, since
        # the inner groups hold only this rank's pieces.
        self.model_param_groups: list[list[nn.Parameter]] = [g["params"] for g in param_groups]
        self.default_param_groups = params is None
        options.check_param_dtypes({buf.param_dtype for m in models for buf in m.flat_buffers})
        group_classes = [g.get("optimizer", optimizer_cls) for g in param_groups]
        whole_costs = _whole_tensor_costs(param_groups, group_classes, self.models)
        if self._sharded:
            # Before anything reads the buffers: whole-tensor params get owners.
            for model in self.models:
                model.own_whole({p: c for p, c in whole_costs.items() if p in model.buffer_of})
        whole_params = frozenset(whole_costs)
        self._owned = [
            _OwnedMainParams(buf, sharded=self._sharded,
                             store_remainders=options.store_param_remainders,
                             whole_params=whole_params)
            for model in self.models
            for buf in model.flat_buffers
        ]
        pieces_of: dict[nn.Parameter, list[nn.Parameter]] = {}
        self._piece_owner: dict[nn.Parameter, tuple[_OwnedMainParams, ShardPiece]] = {}
        for owned in self._owned:
            for piece, main in zip(owned.pieces, owned.main_params, strict=True):
                pieces_of.setdefault(owned.model_param(piece), []).append(main)
                self._piece_owner[main] = (owned, piece)
        self._pieces_of = pieces_of

        # One inner torch optimizer per class, each over its groups; see
        # [Note: one optimizer, several classes].
        groups_of: dict[type[torch.optim.Optimizer], list[dict[str, Any]]] = {}
        user_order = []
        for group, cls in zip(param_groups, group_classes, strict=True):
            inner = {k: v for k, v in group.items() if k != "params"}
            inner["params"] = [m for p in group["params"] for m in pieces_of.get(p, [])]
            groups_of.setdefault(cls, []).append(inner)
            user_order.append(inner)
        self.optimizers: list[torch.optim.Optimizer] = []
        for cls, inner_groups in groups_of.items():
            # optimizer_kwargs belong to optimizer_cls; groups of other classes give their
            # options in the group and take their class's defaults for the rest.
            given = optimizer_kwargs if cls is optimizer_cls else {}
            kwargs = {**given, **default_kernel_kwargs(cls, self._device, given)}
            self.optimizers.append(cls(inner_groups, **kwargs))
        # The inner optimizer of optimizer_cls (of the first group's class when no group uses
        # it): its class and defaults are the optimizer's.
        self.optimizer = next(
            (o for o in self.optimizers if type(o) is optimizer_cls), self.optimizers[0]
        )
        # torch.optim keeps the groups' dicts as given, so this list holds the very dicts the
        # inner optimizers step with, in the user's order.
        assert all(any(g is h for o in self.optimizers for h in o.param_groups)
                   for g in user_order)
        mains = [m for g in user_order for m in g["params"]]
        self._grads = [m.grad for m in mains]
        # Tensor parallelism adds the TP groups to every reduction and leaves TP-replicated
        # grads out of the sums on all but one TP rank; see [Note: TP grad statistics].
        tp_groups, counted = grad_statistics(
            self.parallel.tp, [self.piece_info(m)[0] for m in mains], mains
        )
        # The main params whose grads global statistics count on this rank, and those grads
        # (None with transient grads, which the bucket-by-bucket step reads from the mains).
        self._counted_mains = dict.fromkeys(counted)
        self._counted_grads = [m.grad for m in counted]
        if tp_groups and model_parallel_group is not None:
            raise ValueError(
                "the model has DTensor (tensor-parallel) params, whose mesh already gives the "
                "groups that grad statistics reduce over; drop model_parallel_group (passing the "
                "TP group too would count every element twice)"
            )
        self._reduce_groups += tp_groups

        # Not Optimizer.__init__: the inner optimizer owns the groups and the state, and these
        # aliases make torch's LR schedulers and step hooks act on it directly.
        self.defaults = self.optimizer.defaults
        self.param_groups = user_order
        # One state for all inner optimizers: their params are disjoint, and checkpoints and
        # users read it in one place, as torch.optim's.
        self.state = self.optimizer.state
        for inner in self.optimizers:
            inner.state = self.state
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    # The options as read-only attributes; ``self.options`` holds them.
    clip_grad = property(lambda self: self.options.clip_grad)
    log_num_zeros = property(lambda self: self.options.log_num_zeros)
    overlap_param_gather = property(lambda self: self.options.overlap_param_gather)

    # ------------------------------------------------------------------ training API

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the loss scale, if any."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grad buffers (the buffers stay allocated whatever ``set_to_none`` says)."""
        for model in self.models:
            model.zero_grad_buffer()

    @torch.no_grad()
    def step(self, closure: Any = None) -> StepResult:  # type: ignore[override]
        if closure is not None:
            raise ValueError(
                "distopt optimizers take no closure: run forward and backward, then call step()"
            )
        for model in self.models:
            model.finish_grad_sync()
            model.finish_param_sync()
        if self.options.store_param_remainders:
            return self._step_bucket_by_bucket()
        for owned in self._owned:
            owned.copy_grads_in()
        grads = self._grads
        groups, device = self._reduce_groups, self._device
        stats = self.models[0].comm_stats

        if self.loss_scaler is not None:
            found_inf = clip.unscale_and_check_(
                grads, 1.0 / self.loss_scaler.scale, groups, device, stats
            )
            self.loss_scaler.update(found_inf)
            if found_inf:
                return StepResult(updated=False)

        grad_norm = None
        if self.options.clip_grad is not None:
            total_norm = clip.global_grad_norm(self._counted_grads, groups, device, stats)
            grad_norm = float(total_norm.item())
            clip.clip_grads_(grads, self.options.clip_grad, total_norm)
        num_zeros = None
        if self.options.log_num_zeros:
            num_zeros = clip.count_zeros(self._counted_grads, groups, device, stats)

        skipped = self._detach_grads_of_unused_params()
        self._inner_step()
        for main, grad in skipped:
            main.grad = grad

        for owned in self._owned:
            owned.copy_params_out()
        self._gather_params()
        return StepResult(updated=True, grad_norm=grad_norm, num_zeros=num_zeros)

    def _inner_step(self) -> None:
        for inner in self.optimizers:
            inner.step()

    def _step_bucket_by_bucket(self) -> StepResult:
        """``step()`` with ``store_param_remainders``, after the grad sync: the fp32 masters,
        and with bf16/fp16 grads the fp32 main grads, exist one bucket's shard at a time. The
        same numbers as the fp32-master path, bit for bit; see [Note: param remainders]."""
        groups, device = self._reduce_groups, self._device
        stats = self.models[0].comm_stats
        buckets = [(owned, b) for owned in self._owned for b in range(owned.num_buckets)]
        counted = self._counted_mains
        inv_scale = None
        if self.loss_scaler is not None:
            inv_scale = clip.inverse_scale(1.0 / self.loss_scaler.scale, device)

        # First pass, over every bucket's grads: what the step needs of all of them before it
        # changes any param, the inf verdict and the global norm. Persistent (fp32) main grads
        # are unscaled here once; transient copies are made again, and unscaled again, below.
        clip_grad, norms = self.options.clip_grad, {}
        if inv_scale is not None or clip_grad is not None:
            found_inf = clip.inf_flag(device)
            for owned, bucket in buckets:
                with owned.bucket_grads(bucket) as (mains, _):
                    if inv_scale is not None:
                        clip.unscale_(self._grads_of(mains), found_inf, inv_scale)
                    if clip_grad is not None:
                        mine = [m for m in mains if m in counted]
                        norms.update(zip(mine, clip.grad_norms(self._grads_of(mine)),
                                         strict=True))
            if self.loss_scaler is not None:
                found = clip.any_rank_found_inf(found_inf, groups, stats)
                self.loss_scaler.update(found)
                if found:
                    return StepResult(updated=False)
        grad_norm, coef = None, None
        if clip_grad is not None:
            # The norms in the order of the fp32-master path's sum, so the same bits.
            total_norm = clip.global_norm([norms[m] for m in counted], groups, device, stats)
            grad_norm = float(total_norm.item())
            coef = clip.clip_coefficient(clip_grad, total_norm)

        # Second pass: one bucket's masters and grads at a time, stepped and split back.
        zeros = clip.zero_counter(device) if self.options.log_num_zeros else None
        unused = {m for model in self.models for p in model.unused_params
                  for m in self._pieces_of.get(p, ())}
        for owned, bucket in buckets:
            with owned.bucket_masters(bucket) as mains, owned.bucket_grads(bucket) as (_, new):
                grads = self._grads_of(mains)
                if new and inv_scale is not None:
                    clip.unscale_(grads, clip.inf_flag(device), inv_scale)
                if coef is not None and grads:
                    torch._foreach_mul_(grads, coef)
                if zeros is not None:
                    clip.add_zeros(zeros, self._grads_of([m for m in mains if m in counted]))
                self._step_only({m for m in mains if m not in unused})
        num_zeros = None if zeros is None else clip.total_zeros(zeros, groups, stats)
        self._gather_params()
        return StepResult(updated=True, grad_norm=grad_norm, num_zeros=num_zeros)

    @staticmethod
    def _grads_of(mains: list[nn.Parameter]) -> list[torch.Tensor]:
        return [m.grad for m in mains]

    def _step_only(self, mains: set[nn.Parameter]) -> None:
        """The inner steps over ``mains`` alone: the same as in a full step, since an
        element-wise optimizer updates each element, and a whole-tensor one each param, alone."""
        groups = self.param_groups
        saved = [group["params"] for group in groups]
        try:
            for group in groups:
                group["params"] = [p for p in group["params"] if p in mains]
            for inner in self.optimizers:
                if any(group["params"] for group in inner.param_groups):
                    inner.step()
        finally:
            for group, params in zip(groups, saved, strict=True):
                group["params"] = params

    def _gather_params(self) -> None:
        """Bring every rank's model params up to date (nothing to do when replicated)."""

    def _detach_grads_of_unused_params(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        # A parameter no rank computed a grad for is skipped, as torch.optim skips .grad None.
        skipped = []
        for model in self.models:
            for param in model.unused_params:
                for main in self._pieces_of.get(param, ()):
                    skipped.append((main, main.grad))
                    main.grad = None
        return skipped

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

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state, keyed by parameter name; see
        [Note: DP-size independent state] in distopt/checkpoint/format.py."""
        return _registered_state_dict_format().state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict of ``state_dict()``'s format, written at any DP size; collective."""
        _registered_state_dict_format().load_state_dict(self, state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "distopt optimizers fix their param groups at construction: pass every group in "
            "params=[...] when building the optimizer"
        )

    @property
    def main_params(self) -> list[nn.Parameter]:
        """The fp32 pieces the inner optimizer updates, in param-group order."""
        return [m for g in self.param_groups for m in g["params"]]

    def piece_info(self, main: nn.Parameter) -> tuple[nn.Parameter, ShardPiece]:
        """The model param a piece belongs to, and where the piece lies in it."""
        owned, piece = self._piece_owner[main]
        return owned.model_param(piece), piece

    # ------------------------------------------------------------------ what checkpoints read
    # Besides main_params and piece_info above: models, model_param_groups,
    # default_param_groups, optimizer, loss_scaler, parallel, options, sync_model_params() and
    # main_params_materialized().

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
        with contextlib.ExitStack() as stack:
            for owned in self._owned:
                for bucket in range(owned.num_buckets):
                    stack.enter_context(owned.bucket_masters(bucket))
            yield

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
            return [owned.remainders for owned in self._owned]
        return self.main_params

    def param_group_of(self, main: nn.Parameter) -> dict[str, Any]:
        """The param group (of ``param_groups``) that holds the main param ``main``."""
        return self._group_by_main[main]

    @functools.cached_property
    def _group_by_main(self) -> dict[nn.Parameter, dict[str, Any]]:
        # The groups are fixed at construction (add_param_group raises), so this never changes.
        return {main: group for group in self.param_groups for main in group["params"]}


class DistributedOptimizer(_BufferOptimizer):
    """ZeRO-1/2: fp32 main params and optimizer state sharded over the data-parallel ranks.

    Args:
        model: a distopt DistributedDataParallel built with ``use_distributed_optimizer=True``,
            or a list of them (model chunks sharing one data-parallel group).
        optimizer_cls: a ``torch.optim.Optimizer`` subclass: element-wise (AdamW, SGD, ...),
            whose state is sharded element by element, or whole-tensor (``torch.optim.Muon``,
            ``torch.optim.Adafactor``, or one declared with
            ``distopt.register_whole_tensor_optimizer``), whose params are each owned whole by
            one rank; see [Note: optimizer kinds] in optim/kinds.py.
        params: optional torch-style param groups over the module's params (a list of params,
            or of dicts with ``params`` and per-group options). None: one group with all
            trainable params. A group may name its own class under ``"optimizer"`` (Muon for
            the hidden matrices, ``"optimizer": torch.optim.AdamW`` for the rest); its options
            then come from the group and that class's defaults, not ``optimizer_kwargs``. See
            [Note: one optimizer, several classes].
        clip_grad: max global grad norm (one norm over every shard, bucket and dtype, and over
            the tensor-parallel ranks of DTensor params), or None.
        loss_scaler: ``DynamicLossScaler()`` or ``ConstantLossScaler(s)`` for fp16, or None.
        overlap_param_gather: all-gather the updated params in the background and let the next
            forward wait for each bucket just before its first use.
        log_num_zeros: count the zero elements of the clipped grads in every step's result.
        model_parallel_group: the ranks that hold the other parts of the model (tensor or
            pipeline parallel), or None. The inf/nan verdict is agreed over it and the grad
            norm and zero count are summed over it, besides the data-parallel group; each
            grad element must belong to exactly one of its ranks.
        **optimizer_kwargs: passed to ``optimizer_cls`` (lr=..., betas=..., weight_decay=...).

    With whole-tensor groups the optimizer lays the DDP's buffers out again
    (``DistributedDataParallel.own_whole``): build it before the first backward.
    """

    _sharded = True

    def __init__(
        self,
        model: DistributedDataParallel | Sequence[DistributedDataParallel],
        optimizer_cls: type[torch.optim.Optimizer],
        params: Iterable[Any] | None = None,
        clip_grad: float | None = None,
        loss_scaler: LossScaler | None = None,
        overlap_param_gather: bool = False,
        *,
        log_num_zeros: bool = False,
        model_parallel_group: dist.ProcessGroup | None = None,
        store_param_remainders: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        models = _as_model_list(model, "DistributedOptimizer")
        for m in models:
            if not m.use_distributed_optimizer:
                raise ValueError(
                    "DistributedOptimizer needs a DistributedDataParallel built with "
                    "use_distributed_optimizer=True (it reduce-scatters grads); this one "
                    "all-reduces them: rebuild it, or use distopt.BasicOptimizer"
                )
        options = StepOptions(clip_grad=clip_grad, log_num_zeros=log_num_zeros,
                              overlap_param_gather=overlap_param_gather,
                              store_param_remainders=store_param_remainders)
        super().__init__(
            models, optimizer_cls, params, options, loss_scaler, model_parallel_group,
            optimizer_kwargs,
        )

    def _gather_params(self) -> None:
        for model in self.models:
            model.start_param_sync(overlap=self.options.overlap_param_gather)


class BasicOptimizer(_BufferOptimizer):
    """The replicated counterpart of DistributedOptimizer, with the same interface.

    Takes a distopt DistributedDataParallel built with ``use_distributed_optimizer=False``
    (grads all-reduced, every rank keeps full fp32 main params and optimizer state), or a
    plain ``nn.Module`` trained on one process. ``model_parallel_group`` is as for
    DistributedOptimizer.
    """

    _sharded = False

    def __init__(
        self,
        model: DistributedDataParallel | nn.Module | Sequence[DistributedDataParallel],
        optimizer_cls: type[torch.optim.Optimizer],
        params: Iterable[Any] | None = None,
        clip_grad: float | None = None,
        loss_scaler: LossScaler | None = None,
        *,
        log_num_zeros: bool = False,
        grad_dtype: torch.dtype | None = torch.float32,
        model_parallel_group: dist.ProcessGroup | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if isinstance(model, nn.Module) and not isinstance(model, DistributedDataParallel):
            # A plain module: the same buffers and hooks, on this process alone.
            model = DistributedDataParallel.for_this_process(
                model, grad_dtype=grad_dtype, use_distributed_optimizer=False
            )
        models = _as_model_list(model, "BasicOptimizer")
        for m in models:
            if m.use_distributed_optimizer and m.dp_size > 1:
                raise ValueError(
                    "BasicOptimizer needs all-reduced grads, but this DistributedDataParallel "
                    "reduce-scatters them: build it with use_distributed_optimizer=False, or "
                    "use distopt.DistributedOptimizer"
                )
        options = StepOptions(clip_grad=clip_grad, log_num_zeros=log_num_zeros)
        super().__init__(
            models, optimizer_cls, params, options, loss_scaler, model_parallel_group,
            optimizer_kwargs,
        )


def default_kernel_kwargs(
    optimizer_cls: type[torch.optim.Optimizer], device: torch.device, user_kwargs: dict[str, Any]
) -> dict[str, bool]:
    """The ``foreach``/``fused`` keyword distopt adds to the inner optimizer's arguments.

    The pieces of a buffer are many small fp32 tensors, so the per-tensor loop torch falls back
    to would cost a kernel launch per piece and per operation: on CUDA the fused kernel (one
    launch per step) where the class has one, else the foreach kernels. A choice the user made
    is left alone (``foreach=`` given, or ``fused=True``); ``fused=False`` or ``None`` alone
    still gets ``foreach``. Decides from the device's type only: nothing here touches the
    device.
    """
    accepted = inspect.signature(optimizer_cls.__init__).parameters
    if "foreach" in user_kwargs or user_kwargs.get("fused"):
        return {}
    if device.type == "cuda" and "fused" in accepted and "fused" not in user_kwargs:
        return {"fused": True}
    if "foreach" in accepted:
        return {"foreach": True}
    return {}


def _as_model_list(model: Any, who: str) -> list[DistributedDataParallel]:
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


def _check_model_parallel_group(group: Any, dp_group: dist.ProcessGroup | None) -> None:
    if group is None:
        return
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "model_parallel_group must be None or a torch.distributed.ProcessGroup that this "
            f"rank belongs to (from dist.new_group), got {group!r}"
        )
    # A data-parallel group and a model-parallel group through this rank meet only in it;
    # any other shared rank would hold the same grads twice and be counted twice.
    mp_ranks = set(dist.get_process_group_ranks(group))
    dp_ranks = set(dist.get_process_group_ranks(dp_group)) if dp_group is not None else set()
    shared = sorted((mp_ranks & dp_ranks) - {dist.get_rank()})
    if shared:
        raise ValueError(
            f"model_parallel_group shares ranks {shared} with the data-parallel group; the two "
            "must cross only at this rank (data-parallel replicas hold the same grads, which "
            "would be counted once per replica): pass the group of ranks that hold the other "
            "parts of the model"
        )


def _whole_tensor_costs(
    param_groups: list[dict[str, Any]],
    group_classes: list[Any],
    models: list[DistributedDataParallel],
) -> dict[nn.Parameter, float]:
    """The params of whole-tensor optimizers' groups and the cost their owners balance, after
    checking that each class can be sharded and each param suits its class (on every rank, as
    nothing here communicates)."""
    names = {p: m.param_names[p] for m in models for p in m.params}
    costs: dict[nn.Parameter, float] = {}
    for index, (group, cls) in enumerate(zip(param_groups, group_classes, strict=True)):
        check_optimizer_cls(cls, where=f'param group {index}\'s "optimizer"')
        cost = whole_tensor_cost(cls)
        if cost is None:
            continue
        for p in group["params"]:
            if is_dtensor(p) and any(pl.is_shard() for pl in p.placements):
                raise ValueError(
                    f"parameter '{names[p]}' is sharded over the tensor-parallel mesh "
                    f"({p.placements}), but {cls.__name__} needs each matrix whole: put it in a "
                    'group with "optimizer": torch.optim.AdamW, or replicate it over TP'
                )
            shape = tuple(local_tensor(p).shape)
            if needs_matrices(cls) and len(shape) != 2:
                raise ValueError(
                    f"parameter '{names[p]}' of shape {shape} is in a {cls.__name__} group, but "
                    f"{cls.__name__} steps 2-D matrices only: put it in a group of its own with "
                    '"optimizer": torch.optim.AdamW (the usual home of embeddings, norms and '
                    "biases)"
                )
            costs[p] = cost(shape)
    return costs


def _normalize_param_groups(
    params: Iterable[Any] | None, models: list[DistributedDataParallel]
) -> list[dict[str, Any]]:
    """Torch-style param groups, checked to name each trainable model param at most once."""
    known = {p: m for m in models for p in m.params}
    if params is None:
        return [{"params": [p for m in models for p in m.params]}]
    groups = list(params)
    if not groups:
        raise ValueError("params is an empty list; pass None to optimize every trainable param")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    seen: set[nn.Parameter] = set()
    result = []
    for group in groups:
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError("each param group must be a dict with a 'params' entry")
        plist = group["params"]
        plist = [plist] if isinstance(plist, torch.Tensor) else list(plist)
        for p in plist:
            if p not in known:
                raise ValueError(
                    f"a param group holds a tensor of shape {tuple(p.shape)} that is not a "
                    "trainable parameter of the wrapped model(s); frozen params "
                    "(requires_grad=False) cannot be optimized, and groups must name the "
                    "module's own parameters"
                )
            if p in seen:
                raise ValueError(
                    f"parameter '{known[p].param_names[p]}' appears in more than one param group"
                )
            seen.add(p)
        result.append({**group, "params": plist})
    return result


