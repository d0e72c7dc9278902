"""The replicate dimension run by a torchft ``Manager``: replica groups that fail and heal.

[Note: fault-tolerant replicas]
On a hierarchical layout each replica group (the ranks of one ``dp_shard`` group) holds the
whole training state, sharded inside it, and the groups only average grads with each other
([Note: hierarchical data parallelism] in parallel/process_groups.py). torchft's replica
groups are exactly these: a ``torchft.Manager`` on every rank of a group agrees with the other
groups, through a Lighthouse, on which groups take part in each step (the quorum), and
reconfigures its managed process group to them. distopt runs its second reduction stage, the
average of this rank's reduced shard over the ranks that own the same shard in the other
groups, on that group through ``Manager.allreduce``, so a group that fails drops out of the
next quorum while the others go on. One step, on every rank:

1. ``opt.zero_grad()`` starts the quorum (``start_quorum``, synchronous, before the forward).
   A group that comes back behind the others heals there: every rank fetches its shard's state
   from the same rank of a group that is up to date, over torchft's checkpoint transport, and
   loads it before computing a grad, so it takes part in this very step.
2. Backward reduce-scatters within the group as always; each bucket's shard is then summed over
   the step's participants and divided by their count (torchft's average), so the grads are
   the mean over the groups that took part, whatever their number.
3. ``opt.step()`` waits for the grads, then asks ``should_commit``: the group's ranks agree
   whether every reduction of the step succeeded. If not (a peer group died mid-step) nothing
   changes (params, main params, optimizer state, step counts, loss scale) and the step
   reports ``updated=False``; the next quorum leaves the dead group out.

The lr and the loss scale do not see the number of participants: the grads are a mean, as with
a smaller batch; the loss scaler's verdict is taken on the averaged grads, which every group
holds alike, so every group's scaler moves alike. A failure inside a group (a collective of its
shard group failing) ends the group's processes; its launcher starts them again and they heal.
Only what travels through the replicate group is fault tolerant: the start-up broadcast, the
cross-rank checks and module buffers stay within the group ([Note: hierarchical data
parallelism]); the groups start alike because torchft heals every group from one at step 0.
"""

from __future__ import annotations

from typing import Any

import torch

QUORUM_FIRST = (
    "a fault-tolerant step reduces grads over the replica groups of its quorum, and the quorum "
    "is started by opt.zero_grad(): call opt.zero_grad() before the forward of each step"
)


class ManagedReplicas:
    """The replicate group of a torchft ``Manager``: the second reduction stage, the step's
    quorum and its commit; see [Note: fault-tolerant replicas]."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self._quorum_open = False  # a quorum was started and the step not yet committed

    def start_step(self) -> None:
        """Start this step's quorum, once per step (a heal loads the state here)."""
        if self._quorum_open:
            return
        self.manager.start_quorum()
        self._quorum_open = True

    def all_reduce_avg(self, tensor: torch.Tensor) -> Any:
        """Average ``tensor`` in place over the step's participants (a handle to wait on)."""
        if not self._quorum_open:
            raise RuntimeError(QUORUM_FIRST)
        return _ManagedHandle(self.manager.allreduce(tensor))

    def should_commit(self) -> bool:
        """Whether the step may change the state: the same answer on every rank of the group."""
        if not self._quorum_open:
            raise RuntimeError(QUORUM_FIRST)
        self._quorum_open = False
        return bool(self.manager.should_commit())

    @property
    def participants(self) -> int:
        """The replica groups in the current quorum."""
        return int(self.manager.num_participants())

    @property
    def step(self) -> int:
        """The steps committed, as the Manager counts them (healed ones included)."""
        return int(self.manager.current_step())


class _ManagedHandle:
    """A ``Manager.allreduce`` work as distopt's handles: ``wait`` runs torchft's average
    (its division by the participants is a continuation of the work's future)."""

    __slots__ = ("_work",)

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self) -> bool:
        # torchft reports a failed reduction to the Manager (should_commit is then False)
        # instead of raising, so a dead peer group costs this step only.
        return bool(self._work.wait())

    def is_completed(self) -> bool:
        return False


def managed_replicas_for(manager: Any, *, replicate_group: Any, mesh: Any, experts: Any,
                         options: Any) -> ManagedReplicas:
    """The replicas of ``manager`` for a DDP built with these arguments, or a ValueError that
    names what the fault-tolerant replicas do not cover (the same on every rank, raised before
    any collective)."""
    missing = [name for name in ("start_quorum", "allreduce", "should_commit",
                                 "register_state_dict_fn") if not hasattr(manager, name)]
    if missing:
        raise TypeError(
            f"ft_manager must be a torchft.Manager, got {type(manager).__name__} (no "
            f"{', '.join(missing)})")
    refusal = _refusal(manager, replicate_group=replicate_group, mesh=mesh, experts=experts,
                       options=options)
    if refusal:
        raise ValueError(f"ft_manager= {refusal}")
    return ManagedReplicas(manager)


def _refusal(manager: Any, *, replicate_group: Any, mesh: Any, experts: Any,
             options: Any) -> str | None:
    if getattr(manager, "_use_async_quorum", False):
        return ("needs a Manager built with use_async_quorum=False: a group that heals loads "
                "its state before the forward, so that it takes part in the step it heals at")
    if replicate_group is not None:
        return ("runs the replicate dimension itself: pass the shard group alone "
                "(process_group=, or a 1-D mesh), not a ('dp_replicate', 'dp_shard') mesh")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ()) if mesh is not None else ()
    if "tp" in names or "pp" in names:
        return ("covers data parallelism alone: tensor-parallel and pipeline meshes are not "
                "covered; drop ft_manager= or the 'tp'/'pp' dimension")
    if experts is not None:
        return "does not cover experts=: drop one of the two"
    if not options.grad_policy.reduce_scatter:
        return ("covers the distributed optimizer (its reduced shards are what the replica "
                "groups average): use_distributed_optimizer=True, sharding 'optim' or "
                "'optim_grads'")
    if options.reduce_scatter_with_fp32_accumulation:
        return ("averages over the replica groups in the grads' own dtype: drop "
                "reduce_scatter_with_fp32_accumulation=True, or keep fp32 grads")
    if options.find_unused_parameters:
        return ("needs every param to get a grad on every group (the unused params' flags "
                "are not agreed across groups): drop find_unused_parameters=True")
    return None
