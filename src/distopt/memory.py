"""What training state costs per parameter: the theory (docs/design.md) and a measurement.

The measurement walks the tensors a rank really holds and adds up the bytes of their storages,
each storage once, so views (main params that alias the param buffer, main grads that alias
the grad buffer) cost nothing extra, exactly as in memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from .dtypes import DTYPES
from .optim.block_scaling import DEFAULT_BLOCK_SIZE, needs_scales
from .optim.offload import master_bytes_per_element
from .options import check_state_block_size, check_state_dtype, remainders_problem
from .parallel.dtensor import local_tensor


def _element_size(dtype: torch.dtype) -> int:
    if dtype not in DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype}; use torch.float32, bfloat16 or float16")
    return dtype.itemsize


def _check_dp_size(dp_size: int) -> None:
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")


@dataclass(frozen=True, slots=True)
class BytesPerParam:
    """The theory of what training state costs, component by component: bytes per parameter
    of each component when one rank holds all of it.

    The fields are the components ``MemoryReport`` measures. Every rank holds the model's params
    and its grad buffer whole; the distributed optimizer shards the other components
    (``SHARDED``) over the data-parallel ranks, so that each rank holds ``1/d`` of them. With
    ``shard_grads`` each rank keeps only its reduced shard of the grads between steps, so the
    grads are sharded too (``sharded``).
    """

    params: int
    """The model's params, in their training dtype."""
    grads: int
    """The grad buffer, in the grad dtype."""
    main_params: int
    """fp32 master copies of bf16/fp16 params (fp32 params are their own master copies), or
    the int16 remainders that complete bf16 params into fp32 masters."""
    main_grads: int
    """fp32 copies of the reduced grads, when the grad buffer is bf16/fp16 (with remainders
    they exist only during the step, one bucket at a time, and cost nothing here)."""
    optimizer_state: float
    """The torch optimizer's state: 8 for Adam's two fp32 moments (4 in bf16), 4 for SGD's
    momentum; with
    several optimizers (Muon's 4 beside AdamW's 8), the model's mean (distopt.plan.ownership)."""
    shard_grads: bool = False
    """Whether the grads are kept sharded between steps
    (``DistributedDataParallel(shard_grads=True)``); not a component."""
    shard_params: bool = False
    """Whether the params are kept sharded between uses (``shard_params=True``, which shards
    the grads too); not a component."""

    @property
    def sharded(self) -> frozenset[str]:
        """The components each of the d ranks holds 1/d of."""
        if self.shard_params:
            return SHARDED | {"grads", "params"}
        return SHARDED | {"grads"} if self.shard_grads else SHARDED

    def per_rank(self, dp_size: int, *, distributed: bool = True) -> dict[str, float]:
        """Each component's bytes per parameter on one of ``dp_size`` data-parallel ranks, by
        field name; ``distributed=False``: replicated, every rank holds everything."""
        _check_dp_size(dp_size)
        shards = dp_size if distributed else 1
        return {
            name: getattr(self, name) / (shards if name in self.sharded else 1)
            for name in COMPONENTS
        }

    def total(self, dp_size: int, *, distributed: bool = True) -> float:
        """Bytes per parameter one of ``dp_size`` data-parallel ranks holds in all."""
        _check_dp_size(dp_size)
        # One division of the sharded components' sum, not one per component: the table's
        # ``whole + sharded / d``, to the last bit.
        whole = sum(getattr(self, name) for name in COMPONENTS if name not in self.sharded)
        sharded = sum(getattr(self, name) for name in COMPONENTS if name in self.sharded)
        return whole + sharded / (dp_size if distributed else 1)


COMPONENTS: tuple[str, ...] = ("params", "grads", "main_params", "main_grads", "optimizer_state")
"""The components of training state, in the order the reports list them."""
SHARDED = frozenset({"main_params", "main_grads", "optimizer_state"})
"""The components the distributed optimizer shards over the data-parallel ranks."""


def bytes_per_param_breakdown(
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype | None = None,
    *,
    optimizer_state_bytes: float = 8,
    store_param_remainders: bool = False,
    state_dtype: torch.dtype | None = None,
    shard_grads: bool = False,
    state_block_size: int | None = None,
    shard_params: bool = False,
) -> BytesPerParam:
    """The bytes-per-parameter table of docs/design.md for one choice of dtypes, by component.

    Args:
        param_dtype: the model params' dtype; the optimizer steps fp32 main params beside
            params of any other dtype.
        grad_dtype: the grad buffer's dtype (the DDP's ``grad_dtype``); None: grads in the
            param dtype.
        optimizer_state_bytes: bytes of fp32 state per parameter: 8 for Adam's two moments
            (the default), 4 for SGD with momentum.
        store_param_remainders: keep 2-byte remainders instead of 4-byte fp32 main params
            (bf16 params only), stepping one bucket at a time, so bf16/fp16 grads get their
            fp32 copies only for that bucket's step (none kept).
        state_dtype: hold every per-element state tensor in that dtype (e.g.
            torch.bfloat16), so ``optimizer_state_bytes`` (counted in fp32) shrinks by its
            itemsize over 4; for a mix of dtypes per key pass
            ``optimizer_state_bytes=distopt.optim.kinds.state_bytes(cls, (1,), None, {key:
            dtype})`` instead. None: fp32. See [Note: state precision] in
            optim/state_precision.py.
        shard_grads: keep only each rank's reduced shard of the grads between steps
            (``DistributedDataParallel(shard_grads=True)``): the grads are sharded too. See
            [Note: sharded grads] in ddp/buffers/grad_pool.py.
        state_block_size: elements per scale of fp16 and fp8 state, which adds one byte of
            scale per block; None: 32. Refused for other state dtypes.
        shard_params: keep only each rank's shard of the params too, between uses
            (``shard_params=True``, which implies sharded grads): every component is sharded;
            the gathered buckets a forward or backward holds are transient and not counted
            here. See [Note: sharded params] in ddp/buffers/param_storage.py.
    """
    grad_dtype = grad_dtype or param_dtype
    if state_dtype is not None:
        check_state_dtype(state_dtype)
        if not isinstance(state_dtype, torch.dtype):
            raise TypeError(
                "the memory table takes one state_dtype for every state tensor; for a dtype "
                "per key pass optimizer_state_bytes=distopt.optim.kinds.state_bytes(...)"
            )
        check_state_block_size(state_block_size)
        if state_block_size is not None and not needs_scales(state_dtype):
            raise ValueError(f"state_block_size sets the scales of fp16 or fp8 state; "
                             f"{state_dtype} needs none: drop state_block_size")
        held = state_dtype.itemsize
        if needs_scales(state_dtype):  # one int8 exponent per block
            held += 1 / (state_block_size or DEFAULT_BLOCK_SIZE)
        optimizer_state_bytes = optimizer_state_bytes * held / 4
    problem = remainders_problem({param_dtype}) if store_param_remainders else None
    if problem:
        raise ValueError(
            f"store_param_remainders=True {problem}; pass param_dtype=torch.bfloat16 or drop "
            "the option"
        )
    # The optimizer steps in fp32: low-precision params and grads get fp32 copies (or, for
    # bf16 params with remainders, the low half of one, and grads copied per bucket).
    main_params = 4 if param_dtype != torch.float32 else 0
    main_grads = 4 if grad_dtype != torch.float32 and not store_param_remainders else 0
    return BytesPerParam(
        params=_element_size(param_dtype),
        grads=_element_size(grad_dtype),
        main_params=2 if store_param_remainders else main_params,
        main_grads=main_grads,
        optimizer_state=optimizer_state_bytes,
        shard_grads=shard_grads or shard_params,
        shard_params=shard_params,
    )


def theoretical_bytes_per_param(
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype | None,
    dp_size: int,
    *,
    distributed: bool = True,
    optimizer_state_bytes: float = 8,
    store_param_remainders: bool = False,
    state_dtype: torch.dtype | None = None,
    shard_grads: bool = False,
    state_block_size: int | None = None,
    shard_params: bool = False,
) -> float:
    """Bytes per parameter of params, grads, fp32 main params/grads and optimizer state.

    The table of docs/design.md, for one rank; ``bytes_per_param_breakdown`` gives the same
    figure component by component.

    Args:
        param_dtype: the model params' dtype.
        grad_dtype: the grad buffer's dtype (the DDP's ``grad_dtype``); None: the params'.
        dp_size: d, the number of data-parallel ranks the sharded components are split over;
            at least 1.
        distributed: the distributed optimizer, whose main params, main grads and state are
            split over the d ranks (True, the default); False gives the replicated (DDP +
            torch optimizer, or BasicOptimizer) figure, every rank holding everything.
        optimizer_state_bytes: bytes of fp32 state per parameter: 8 for Adam's two moments
            (the default), 4 for SGD with momentum.
        store_param_remainders: int16 remainders instead of fp32 main params, and no
            persistent fp32 main grads (bf16 params only).
        state_dtype: the state held in that dtype, ``optimizer_state_bytes`` scaled by its
            itemsize over 4 (bf16 params and grads, remainders, bf16 state: 4 + 6/d; fp32
            params and grads with bf16 state: 8 + 4/d). None: fp32.
        shard_grads: only each rank's reduced shard of the grads is kept between steps (bf16
            params and grads with remainders: 2 + 12/d; fp32: 4 + 12/d).
        state_block_size: elements per scale of fp16 and fp8 state, which adds one byte per
            block (Adam's fp8 moments take 2 + 2/32 B/param); None: 32. Refused for other
            dtypes.
        shard_params: the params too, between uses: everything is sharded (fp32: 16/d; bf16
            params and grads with remainders: 14/d, with bf16 state 10/d); the buckets a
            forward or backward gathers are transient and not counted.
    """
    _check_dp_size(dp_size)
    breakdown = bytes_per_param_breakdown(
        param_dtype, grad_dtype, optimizer_state_bytes=optimizer_state_bytes,
        store_param_remainders=store_param_remainders, state_dtype=state_dtype,
        shard_grads=shard_grads,
        state_block_size=state_block_size, shard_params=shard_params,
    )
    return breakdown.total(dp_size, distributed=distributed)


def checkpoint_bytes_per_param(
    param_dtype: torch.dtype,
    *,
    optimizer_state_bytes: float = 8,
    state_dtype: torch.dtype | None = None,
) -> float:
    """Bytes per trainable parameter of a distopt checkpoint (torch's layout): its fp32 main
    param (kept with ``store_param_remainders`` too; the param's own dtype is not written,
    whatever ``param_dtype``) and the optimizer state as written, per element: in
    ``state_dtype`` (``optimizer_state_bytes`` counts fp32 state), fp16 and fp8 scaled state
    as its fp32 values (see docs/checkpoints.md).

    Each rank of N writes about 1/N of it, and an async save stages exactly what the rank
    writes, so ``checkpoint_bytes_per_param(...) / N`` is the staging an async save keeps per
    parameter on each rank ([Note: async staging] in checkpoint/staging.py); frozen params add
    their model bytes only."""
    state = optimizer_state_bytes
    if state_dtype is not None:
        check_state_dtype(state_dtype)
        per_element = 4 if needs_scales(state_dtype) else state_dtype.itemsize
        state = optimizer_state_bytes * per_element / 4
    return 4 + state


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Bytes one rank holds, by role; ``measure_state_bytes`` makes it. Each storage counts
    once, so views cost nothing; ``total`` is their sum, ``bytes_per_param`` that sum per
    element of ``num_params``."""

    num_params: int
    """The model's trainable elements (of a tensor-parallel param, its local shard only)."""
    params: int
    """The model params' buffers: whole, or with sharded params this rank's shard."""
    grads: int
    """The grad buffers: whole, or with sharded grads the shards kept between steps."""
    main_params: int
    """The fp32 main params of this rank's pieces, or with ``store_param_remainders`` their
    int16 remainders; nothing beyond the params themselves for fp32 params."""
    main_grads: int
    """The fp32 copies of the grads kept for the step (low-precision grads); 0 where the
    step reads the reduced grads in place or copies them one bucket at a time."""
    optimizer_state: int
    """The inner optimizer's state tensors (Adam's moments), step counters aside."""
    offloaded: int = 0
    """Bytes of main params and state on the offload tier's file (``offload_dir``), not in
    RAM and not in ``total``; see [Note: the offload tier] in optim/offload.py."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.main_params + self.main_grads + self.optimizer_state

    @property
    def bytes_per_param(self) -> float:
        return self.total / self.num_params

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total, "bytes_per_param": self.bytes_per_param}


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not already in ``seen`` (which it extends):
    each storage counts once, so views cost nothing. DTensors count their local shard."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = local_tensor(t).untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def measure_state_bytes(optimizer) -> MemoryReport:
    """Measure what this rank holds for the models and the distopt optimizer given.

    Args:
        optimizer: a ``DistributedOptimizer`` or ``BasicOptimizer``; its models' param and
            grad buffers are counted with its main params, main grads and state, each storage
            once, from the tensors as they are now (call it after a step: the state exists
            from the first step on).
    """
    seen: set[int] = set()
    tier = getattr(optimizer, "offload_tier", None)
    if tier is not None:  # the tier's views live in its file, not in RAM
        seen.add(tier.storage_key())

    def counted(tensors) -> int:
        return storage_bytes(tensors, seen)

    buffers = [buf for model in optimizer.models for buf in model.flat_buffers]
    params = counted(t for buf in buffers for t in buf.param_storage())
    # The full grad buffer, or with sharded grads the kept shards alone.
    grads = counted(t for buf in buffers for t in buf.grad_storage())
    main_params = counted(optimizer.main_param_storage())
    main_grads = counted(optimizer.main_grad(m) for m in optimizer.main_params)
    # Step counters are one scalar per tensor, not per element: bookkeeping, not state.
    state = counted(
        v for s in optimizer.state.values() for k, v in s.items()
        if isinstance(v, torch.Tensor) and k != "step"
    )
    return MemoryReport(
        # Local elements: a tensor-parallel param's other shards live on other ranks.
        num_params=sum(local_tensor(p).numel() for model in optimizer.models for p in model.params),
        params=params,
        grads=grads,
        main_params=main_params,
        main_grads=main_grads,
        optimizer_state=state,
        offloaded=0 if tier is None else tier.nbytes,
    )


@dataclass(frozen=True, slots=True)
class TransientBound:
    """The most a rank holds beyond its state under sharded params, by part, in bytes; see
    [Note: transient bound]."""

    gathered_params: int
    """Two gather units (the one running and the one prefetched) and every loose bucket."""
    grads_in_flight: int
    """The grad pools' buffers: two of the largest bucket per grad dtype (one filling, one on
    the wire); on gloo also what each reduction in flight receives its peers' chunks into,
    (d - 1)/d of the bucket ([Note: collectives on gloo] in comm/gloo.py)."""
    step: int
    """The step's temporaries, one bucket's shard at a time: the inner optimizer's (AdamW's
    foreach step: one fp32 tensor), plus fp32 masters and grads (remainders, bf16 grads) and
    fp32 state (state below fp32) of that shard."""

    @property
    def total(self) -> int:
        # Backward's gathered params and grads in flight are alive at once; the step runs after
        # both are freed, so it adds only where it is larger.
        return max(self.gathered_params + self.grads_in_flight, self.step)

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def transient_bound(ddp, *, store_param_remainders: bool = False,
                    state_dtype: torch.dtype | None = None,
                    offload: bool = False) -> TransientBound:
    """The transient bound of ``ddp`` (a ``DistributedDataParallel(shard_params=True)``), from
    its real layout: see [Note: transient bound].

    Args:
        ddp: the model, wrapped with sharded params; its buckets, gather units and grad pools
            give the figures.
        store_param_remainders: the optimizer's option of that name: the step's temporaries
            then hold the fp32 masters and fp32 grads of the shard being stepped too.
        state_dtype: the optimizer's ``state_dtype`` as one dtype: state below fp32 is
            expanded to fp32 for the step, two tensors (Adam's moments) of the shard being
            stepped. None: fp32 state, nothing to expand.
        offload: the optimizer keeps its masters and state on the offload tier
            (``offload_dir``): the step then holds the shard being stepped of those too
            ([Note: the offload tier] in optim/offload.py).

    [Note: transient bound]
    Between steps a rank with sharded params holds its state alone. During a step it also
    holds, at most: the params of two gather units, the one running and the one prefetched (in
    backward the prefetch waits until the unit whose backward ran before is freed; see
    [Note: where a param is used] in ddp/params/param_unshard.py), with every loose bucket (params
    outside all units: embeddings, a final norm); the grads of two of the largest buckets, one
    filling and one being reduced ([Note: sharded grads] in ddp/buffers/grad_pool.py), and on gloo
    the (d - 1)/d of a bucket each reduction in flight receives into; and in the
    optimizer step, which runs one bucket's shard at a time, that shard's temporaries. A head
    tied to an embedding keeps the embedding's bucket from its first use to its grad, which the
    loose term covers. Activations are the model's and its batch's, not counted here.
    ``transient_bound_of_model`` states the same from a model's tree alone (``distopt
    memory``).
    """
    bucket_of = {p: bucket for bucket in ddp.buckets for p in bucket.params}
    units = [{bucket_of[p] for p in unit.params} for unit in ddp.gather_units]
    in_units = set().union(*units) if units else set()

    def nbytes(bucket) -> int:
        return bucket.numel * bucket.param_shard.dtype.itemsize

    from .comm.collectives import is_gloo

    return _bound(
        [sum(nbytes(b) for b in buckets) for buckets in units],
        sum(nbytes(b) for b in ddp.buckets if b not in in_units),
        sum(pool.buffer_bytes for pool in ddp.grad_pools.values()),
        max(b.numel // ddp.dp_size for b in ddp.buckets), ddp.dp_size,
        gloo=is_gloo(ddp.process_group),
        store_param_remainders=store_param_remainders, state_dtype=state_dtype,
        offloaded=offloaded_bytes_per_element(ddp.buckets[0].param_shard.dtype,
                                              store_param_remainders, state_dtype)
        if offload else 0.0)


def offloaded_bytes_per_element(param_dtype: torch.dtype, store_param_remainders: bool,
                                state_dtype: torch.dtype | None) -> float:
    """Bytes per element the offload tier keeps of an AdamW shard: the masters (int16
    remainders, fp32 copies of bf16/fp16 params, nothing for fp32 params) and the two
    moments in their held dtype."""
    return (master_bytes_per_element(param_dtype, store_param_remainders)
            + 2 * (state_dtype or torch.float32).itemsize)


def transient_bound_of_model(module: torch.nn.Module, dp_size: int, *,
                             grad_dtype: torch.dtype | None = torch.float32,
                             bucket_size: int | None = None, gloo: bool = False,
                             gather_units=None, store_param_remainders: bool = False,
                             state_dtype: torch.dtype | None = None,
                             offload: bool = False) -> TransientBound:
    """``transient_bound`` of ``module`` wrapped with ``shard_params=True`` at ``dp_size``
    ranks (on gloo: ``gloo``), from the planner the DDP lays its buffers out with; ``module``
    may be on the meta device. See [Note: transient bound]."""
    from .ddp.params.gather_units import plan_gather_units, unit_bucket_size, unit_index_of
    from .layout.elementwise import TARGET_BUCKETS, TARGET_BUCKETS_GLOO
    from .layout.model_layout import ParamSpec, plan_model_layout, resolve_bucket_size

    params = [p for p in module.parameters() if p.requires_grad]
    units = plan_gather_units(module, params, gather_units)
    unit_of = unit_index_of(units)
    specs = [ParamSpec(tuple(p.shape), p.dtype, unit=unit_of.get(p, -1)) for p in params]
    size = resolve_bucket_size(bucket_size, specs, dp_size,
                               TARGET_BUCKETS_GLOO if gloo else TARGET_BUCKETS)
    if bucket_size is None:
        size = unit_bucket_size(size, units, dp_size)
    planned = plan_model_layout(specs, grad_dtype=grad_dtype, bucket_size=size,
                                dp_size=dp_size)
    unit_bytes = [0] * len(units)
    loose, widest = 0, 0
    largest_grads: dict[torch.dtype, int] = {}
    for buf in planned.buffers:
        for bucket in buf.layout.buckets:
            numel = bucket.buffer_range.size
            unit = specs[buf.param_indices[bucket.param_indices[0]]].unit
            if unit is not None and unit >= 0:
                unit_bytes[unit] += numel * buf.param_dtype.itemsize
            else:
                loose += numel * buf.param_dtype.itemsize
            widest = max(widest, numel // dp_size)
            largest_grads[buf.grad_dtype] = max(largest_grads.get(buf.grad_dtype, 0),
                                                numel * buf.grad_dtype.itemsize)
    param_dtype = params[0].dtype if params else torch.float32
    return _bound(unit_bytes, loose, sum(largest_grads.values()), widest, dp_size,
                  gloo=gloo and dp_size > 1, store_param_remainders=store_param_remainders,
                  state_dtype=state_dtype,
                  offloaded=offloaded_bytes_per_element(param_dtype, store_param_remainders,
                                                        state_dtype) if offload else 0.0)


def _bound(unit_bytes: list[int], loose: int, grad_buffer_bytes: int, widest_shard: int,
           dp_size: int, *, gloo: bool, store_param_remainders: bool,
           state_dtype: torch.dtype | None, offloaded: float = 0.0) -> TransientBound:
    """[Note: transient bound]'s sum: the two largest units and the loose buckets; two
    buffers of the largest bucket's grads (and on gloo what two reductions receive into); one
    shard's step temporaries, and with the offload tier that shard's masters and state
    (``offloaded`` bytes per element)."""
    gathered = sum(sorted(unit_bytes, reverse=True)[:2]) + loose
    step = widest_shard * 4  # AdamW's foreach temporary of the shard it steps
    if store_param_remainders:
        step += widest_shard * 4 * 2  # fp32 masters and fp32 grads of the shard
    if state_dtype is not None and state_dtype != torch.float32:
        step += widest_shard * 4 * 2  # Adam's two moments expanded to fp32 for the shard
    step += int(widest_shard * offloaded)  # the shard's masters and state, read from the tier
    received = grad_buffer_bytes * (dp_size - 1) // dp_size if gloo else 0
    return TransientBound(gathered_params=gathered,
                          grads_in_flight=2 * (grad_buffer_bytes + received), step=step)
