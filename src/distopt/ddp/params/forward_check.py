"""With sharded params, one small collective at the start of each forward and each backward
that finds ranks that parted (a forward run on one rank alone) and refuses on every rank.

[Note: every rank runs every forward]
With ``shard_params=True`` a forward gathers each unit's params from every rank, and so does a
backward ([Note: sharded params] in ddp/buffers/param_storage.py): every rank must run every forward
and every backward of the model together. torch scripts break that with an evaluation on one rank:
nanoGPT's ``if iter_num % eval_interval == 0 and master_process: losses = estimate_loss()``,
whose forwards (under ``torch.no_grad()``, in eval mode) torch DDP runs on rank 0 alone since
they communicate nothing. Under distopt rank 0's gathers would meet whatever the other ranks
do next: a wait until the group's timeout and a bare collective error on every rank, or, where
the collectives happen to have the same sizes, params gathered from another forward.

So under sharded params each forward of the wrapper starts with one all-gather of five
integers from every rank of the data-parallel group (the group the gathers run over): what it
starts (a forward), which DDP (a serial number, the same on every rank, since every rank
builds the same DDPs in the same order), how many forwards that DDP ran, whether grad is
enabled and whether the module is in training mode; each backward through the units starts
with one too (a backward, its count; ``ParamUnsharder`` runs it in the first pre-backward hook
of each backward). The ranks that did not run rank 0's forward are at their
next forward or backward, whose check pairs with rank 0's, so the check compares what every
rank starts at the same moment: rank 0's evaluation forward (grad disabled, eval mode) against
their training forward (grad enabled), or a forward against a backward (an extra forward with
grad enabled passes its own check, then meets the others' backward check). Where the rows
differ, every rank holds all of them and raises the same error, before any gather: the cause
and the ways that work (run the evaluation on every rank; evaluate a copy made inside ``with
ddp.gathered_params():`` on every rank; or one loaded from ``ddp.full_state_dict()``). Ranks that
run the same forwards agree at every check, whatever their data.

What the check cannot see: ranks that start alike and part within the forward (modules run on
some ranks only, [Note: every rank runs the same modules] in ddp/params/param_unshard.py), and a
forward on one rank met by another collective than a check (one between a backward and the
step: the step's own collectives).

When: the check's all-gather is started at the forward's (or backward's) start and waited for
by distopt's next collective, whichever it is (comm/gate.py): a param gather's launch, a
bucket's reduction, a control value. No collective of distopt's ever starts before the check
is settled, so ranks that parted still raise before their gathers meet, while the check's round
trip overlaps what runs until then: the wait for a unit gathered ahead by the step
(``overlap_param_gather``), or a backward's compute up to its first reduction where the
params were kept after the forward. A check that nothing settled is settled by the next one.
Pipeline stages: inside a training step of torch's pipeline schedules (distopt's
``PipelineStage`` marks it, from ``clear_runtime_states`` to the step's last backward) the
schedule, the same on every rank of a stage, orders every micro-batch's forward and backward,
so only the step's first forward is checked: a forward on one rank alone comes outside a
schedule's step, where every forward is checked again.

Cost: one all-gather of 5 int64 per rank per forward and per backward, torch's own (distopt's
point-to-point all-gather on gloo would share its tags with a param gather in flight), about
0.7 ms of round trip at d = 2 on gloo on the 2-core CPU machine where nothing hides it; on a
GPU the check's values are read on the host when it settles. A single process checks nothing.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ...comm import collectives as comm
from ...comm import gate
from ...comm.stats import timed
from .. import agreements

_FORWARD, _BACKWARD = 1, 2
_serials = itertools.count()  # per process: every rank builds its DDPs in the same order
_names: dict[int, str] = {}  # serial -> the model it checks, for the message


class ForwardCheck:
    """The per-forward and per-backward check of one DDP with sharded params; see
    [Note: every rank runs every forward]."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, name: str,
                 stats: comm.CommStats | None) -> None:
        self.group = group
        self.size = comm.group_size(group)
        self.device = device
        self.stats = stats
        self.serial = next(_serials)
        _names[self.serial] = name
        self.forwards = 0
        self.backwards = 0
        self._scheduled = False  # a pipeline schedule's step drives the forwards now
        self._checked_in_schedule = False

    def scheduled(self, on: bool) -> None:
        """A pipeline schedule's training step starts (``on``) or ended: within it, only its
        first forward is checked. See "Pipeline stages" in the Note."""
        self._scheduled = on
        self._checked_in_schedule = False

    def _skips(self) -> bool:
        if not self._scheduled:
            return False
        skip, self._checked_in_schedule = self._checked_in_schedule, True
        return skip

    def forward(self, training: bool) -> None:
        """Before a forward's first collective: every rank starts this same forward."""
        self.forwards += 1
        if not self._skips():
            self._check(_FORWARD, self.forwards, torch.is_grad_enabled(), training)

    def backward(self) -> None:
        """Before a backward's first gather: every rank starts this same backward."""
        self.backwards += 1
        if not self._skips():
            self._check(_BACKWARD, self.backwards, False, False)

    def _check(self, kind: int, count: int, grad: bool, training: bool) -> None:
        if self.size == 1:
            return
        gate.settle()  # the check before this one, if nothing settled it
        mine = torch.tensor([kind, self.serial, count, int(grad), int(training)],
                            dtype=torch.int64, device=self.device)
        rows = torch.empty(self.size * mine.numel(), dtype=torch.int64, device=self.device)
        if self.stats is not None:
            self.stats.record(agreements.FORWARD_CHECK, mine, self.group)
        # torch's own all-gather, not distopt's point-to-point one on gloo (comm/gloo.py):
        # ordered with the group's other collectives, apart from a param gather in flight.
        with comm.failures_named("all_gather", "the forward check (5 int64 a rank)"):
            handle = timed(self.stats, agreements.FORWARD_CHECK, True,
                           lambda: getattr(dist, comm.ALL_GATHER)(rows, mine, group=self.group,
                                                                  async_op=True))
        # Waited for by distopt's next collective, whatever it is: see "When" in the Note.
        gate.hold(lambda: self._verify(handle, rows))

    def _verify(self, handle: object, rows: torch.Tensor) -> None:
        with comm.failures_named("all_gather", "the forward check (5 int64 a rank)"):
            handle.wait()
        rows_list = rows.view(self.size, -1).tolist()
        if all(row == rows_list[0] for row in rows_list):
            return
        other = next(r for r, row in enumerate(rows_list) if row != rows_list[0])
        raise RuntimeError(
            "with shard_params=True every rank must run every forward and backward of the "
            "model together, since each gathers the params from every rank, but the ranks "
            f"parted: rank 0 began {_describe(rows_list[0])} where rank {other} began "
            f"{_describe(rows_list[other])}. A forward run on some ranks only (an evaluation "
            "under 'if rank == 0:', nanoGPT's estimate_loss() under 'if master_process:') "
            "cannot gather its params. Run the evaluation on every rank (each its share of "
            "the batches, the losses averaged with torch.distributed.all_reduce), or evaluate "
            "a copy of the module made inside 'with ddp.gathered_params():' on every rank "
            "(copy.deepcopy(ddp.module)), or a model loaded from ddp.full_state_dict() "
            "(called on every rank)"
        )


def _describe(row: list[int]) -> str:
    kind, serial, count, grad, training = row
    model = _names.get(serial, f"distopt DDP #{serial}")
    if kind == _BACKWARD:
        return f"backward #{count} of {model}"
    return (f"forward #{count} of {model} (grad {'enabled' if grad else 'disabled'}, "
            f"{'training' if training else 'eval'} mode)")
