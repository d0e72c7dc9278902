"""``DistributedDataParallel(whole_tensor_params=...)``: the cost each such param's owner balances.

The DDP lays its buffers out when it is built, before any optimizer exists, so the params an
optimizer will step whole are named to it with their classes, and the cost of each comes from
the table of optimizer classes ([Note: optimizer kinds] in optim/kinds.py). That table belongs
to the optimizers, a layer above the DDP, so it hands its lookup down here when it is imported
(``import distopt`` imports it, before any DDP can be built) and the DDP imports nothing above
itself (tests/test_import_graph.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from ..parallel.dtensor import local_tensor

CostLookup = Callable[[type[torch.optim.Optimizer]], Callable[[Sequence[int]], float] | None]
"""A class's cost function (its work on a param of a given shape), or None for a class that
shards element by element: ``distopt.optim.kinds.whole_tensor_cost``."""

_whole_tensor_cost: CostLookup | None = None


def use_cost_table(lookup: CostLookup) -> None:
    """Take the optimizers' table of classes; optim/kinds.py calls this when it is imported."""
    global _whole_tensor_cost
    _whole_tensor_cost = lookup


def costs_of_classes(classes: Mapping[nn.Parameter, type[torch.optim.Optimizer]],
                     names: Mapping[nn.Parameter, str]) -> dict[nn.Parameter, float]:
    """The cost each param's owner balances, for params stepped whole by the classes given
    (``DistributedDataParallel(whole_tensor_params=...)``); an error for a tensor that is not
    a trainable param, or a class that shards element by element."""
    if classes and _whole_tensor_cost is None:
        raise RuntimeError("whole_tensor_params: the table of optimizer classes "
                           "(distopt.optim.kinds) was not imported")
    costs = {}
    for param, cls in classes.items():
        if param not in names:
            raise ValueError("whole_tensor_params holds a tensor that is not a trainable "
                             "parameter of this model")
        cost = _whole_tensor_cost(cls)
        if cost is None:
            raise ValueError(
                f"whole_tensor_params gives parameter '{names[param]}' {cls.__name__}, which "
                "shards element by element: name only the params of whole-tensor optimizers "
                "(Muon, Adafactor)"
            )
        costs[param] = cost(tuple(local_tensor(param).shape))
    return costs
