"""The optimizer's side of torchft's replica groups: quorum, commit and heal; see
[Note: fault-tolerant replicas] in parallel/managed_replicas.py.

What a healthy rank sends a healing one is what it holds (``opt.heal_state()``): its pieces of
the state in the sharded state-dict format (fp32 main params, each piece's optimizer state and
step, the loss scaler) and the model params it holds between steps. The same rank of the
healing group loads them alone, with no collective: its pieces are the same pieces (the groups
are built alike), and torchft decides per rank which ranks heal.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..parallel.managed_replicas import ManagedReplicas

HEAL_STATE_KEY = "distopt"
"""The name of the optimizer's state among the Manager's state functions."""


@dataclass(slots=True)
class HealRecord:
    """What this rank's heals cost: per heal sent or received, its steps and bytes."""

    sent: list[dict[str, Any]] = field(default_factory=list)
    """One entry per state sent to a healing group: ``{"step", "bytes"}``."""
    received: list[dict[str, Any]] = field(default_factory=list)
    """One entry per state loaded from a healthy group: ``{"step", "bytes", "seconds"}``
    (seconds: the quorum that fetched and loaded it, from its start to the state loaded)."""


class FaultTolerantSteps:
    """Starts each step's quorum, commits each step, and serves and loads the heal state of
    one optimizer."""

    def __init__(self, replicas: ManagedReplicas, opt: Any) -> None:
        self.replicas = replicas
        self.record = HealRecord()
        self._opt = opt
        self._quorum_started = 0.0
        replicas.manager.register_state_dict_fn(HEAL_STATE_KEY, self._load, self._state)

    def begin_step(self) -> None:
        """Before the forward: the quorum (a heal loads the state in it)."""
        self._quorum_started = time.perf_counter()
        self.replicas.start_step()

    def commit(self) -> bool:
        """After the grads are reduced: whether this step may change the state."""
        return self.replicas.should_commit()

    def _state(self) -> dict[str, Any]:
        # Runs in torchft's quorum thread while this rank's main thread waits for the quorum,
        # so the state is still; tensors that own their storage are sent as they are (no
        # copy): the step that would change them waits in should_commit for the transfer.
        state = own_storage(self._opt.heal_state())
        self.record.sent.append({"step": self.replicas.manager.current_step(),
                                 "bytes": tensor_bytes(state)})
        return state

    def _load(self, state: dict[str, Any]) -> None:
        self._opt.load_heal_state(state)
        self.record.received.append({
            "step": self.replicas.manager.current_step(), "bytes": tensor_bytes(state),
            "seconds": time.perf_counter() - self._quorum_started})


def own_storage(tree: Any) -> Any:
    """``tree`` with every tensor that views a larger storage copied out: torch's serializer
    writes a tensor's whole storage, so a main param that views the param buffer would send the
    whole buffer. Tensors that own their storage are sent as they are."""
    if isinstance(tree, torch.Tensor):
        whole = tree.untyped_storage().nbytes() == tree.numel() * tree.element_size()
        return tree if whole else tree.clone()
    if isinstance(tree, dict):
        return {k: own_storage(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(own_storage(v) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(tree, **{f.name: own_storage(getattr(tree, f.name))
                                            for f in dataclasses.fields(tree) if f.init})
    return tree


def tensor_bytes(tree: Any) -> int:
    """The bytes of every tensor in a nested state dict (``FlatShard`` values included)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return sum(tensor_bytes(getattr(tree, f.name)) for f in dataclasses.fields(tree))
    return 0
