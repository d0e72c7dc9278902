"""Sharded params: which params are gathered together, chosen along the module tree.

[Note: gather units]
Under ``shard_params=True`` a *gather unit* is a module and the trainable params its subtree
registers, less those of units nested inside it: a transformer block, say, as FSDP2's
``fully_shard`` units are. Buckets never straddle two units (the layout cuts a bucket where
the unit changes, [Note: layout rule] in layout/elementwise.py), so a unit's params are
gathered without a neighbour's, in one or more buckets of at most ``bucket_size`` elements
each; grads reduce-scatter by the same buckets. Params outside every unit (embeddings, a final
norm, the layers of a model too small to cut) are *loose*: bucketed by size among themselves
and gathered around the modules that register them, as every param is gathered around its
registrant too ([Note: where a param is used] in ddp/params/param_unshard.py).

Which modules are units (``DistributedDataParallel(gather_units=...)``):

* ``None`` (the default): the repeated blocks of the model: each child of an
  ``nn.ModuleList`` or ``nn.Sequential`` whose subtree holds at least ``MIN_UNIT_NUMEL``
  trainable elements, outermost first (a GPT's or a transformers model's decoder layers;
  nothing nested inside them). Smaller modules gain nothing from a unit of their own (a few
  MiB gathered, one collective more), so a small model's params are all loose and gathered
  around each module that registers them;
* a module class, or a tuple of them: every instance is a unit (torchtitan's and FSDP2's
  idiom of one ``fully_shard`` per ``TransformerBlock``);
* a callable ``(module) -> bool``: the modules it accepts.

Unless ``bucket_size`` is given, a unit is cut into ``UNIT_BUCKETS`` buckets
(``unit_bucket_size``): gathered together, reduced a quarter at a time. Units are planned once,
from the module tree alone, identically on every rank. Where the forward runs them, and where
code reads a unit's params outside that unit's forward (a head tied to an embedding unit), is
learned by the first forward ([Note: where a param is used] in ddp/params/param_unshard.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

from ...layout.elementwise import MIN_CHUNK

MIN_UNIT_NUMEL = 1 << 20
"""Elements a block needs to become a gather unit by default (4 MiB of fp32)."""

GatherUnitPolicy = (type[nn.Module] | tuple[type[nn.Module], ...]
                    | Callable[[nn.Module], bool] | None)


@dataclass(eq=False)
class GatherUnit:
    """One module and the params gathered with it (registration order)."""

    module: nn.Module
    name: str
    params: list[nn.Parameter] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def _chooser(policy: GatherUnitPolicy) -> Callable[[nn.Module], bool]:
    if isinstance(policy, type) or (isinstance(policy, tuple)
                                    and all(isinstance(c, type) for c in policy)):
        classes = policy
        return lambda module: isinstance(module, classes)
    if callable(policy):
        return lambda module: bool(policy(module))
    raise TypeError(
        f"gather_units must be None (the model's repeated blocks), an nn.Module class or a "
        f"tuple of them, or a callable (module) -> bool; got {type(policy).__name__}"
    )


def _repeated_blocks(root: nn.Module, wanted: set[nn.Parameter]) -> set[nn.Module]:
    """The default units: children of containers with at least MIN_UNIT_NUMEL trainable
    elements, outermost first."""
    blocks: set[nn.Module] = set()

    def visit(module: nn.Module) -> None:
        container = isinstance(module, (nn.ModuleList, nn.Sequential))
        for child in module.children():
            # A list of blocks is not a block: it has no forward of its own.
            if container and not isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                numel = sum(p.numel() for p in child.parameters() if p in wanted)
                if numel >= MIN_UNIT_NUMEL:
                    blocks.add(child)
                    continue
            visit(child)

    visit(root)
    return blocks


def plan_gather_units(root: nn.Module, params: Sequence[nn.Parameter],
                      policy: GatherUnitPolicy) -> list[GatherUnit]:
    """The gather units of ``root`` over ``params`` (its trainable params), ordered by the
    first registration of their params (the forward's order, before a forward shows the real
    one); params in none are loose. See [Note: gather units]."""
    wanted = set(params)
    registrant: dict[nn.Parameter, nn.Module] = {}
    for module in root.modules():  # a tied param belongs where it is registered first
        for param in module.parameters(recurse=False):
            if param in wanted and param not in registrant:
                registrant[param] = module
    own: dict[nn.Module, list[nn.Parameter]] = {}
    for param, module in registrant.items():
        own.setdefault(module, []).append(param)
    if policy is None:
        blocks = _repeated_blocks(root, wanted)
        chooses: Callable[[nn.Module], bool] = blocks.__contains__
    else:
        chooses = _chooser(policy)
    units: list[GatherUnit] = []
    seen: set[nn.Module] = set()

    def visit(module: nn.Module, name: str) -> list[nn.Parameter]:
        seen.add(module)
        pending = list(own.get(module, ()))
        for child_name, child in module.named_children():
            if child not in seen:
                pending += visit(child, f"{name}.{child_name}" if name else child_name)
        if module is not root and pending and chooses(module):
            units.append(GatherUnit(module, name, pending))
            return []
        return pending

    visit(root, "")
    position = {p: i for i, p in enumerate(params)}
    for unit in units:
        unit.params.sort(key=position.__getitem__)
    units.sort(key=lambda u: position[u.params[0]])
    return units


UNIT_BUCKETS = 4
"""Buckets a gather unit is cut into by default: its grads reduce a quarter at a time."""


def unit_bucket_size(default: int, units: Sequence[GatherUnit], dp_size: int) -> int:
    """The default bucket size under sharded params: the largest unit's quarter (but at least
    ``MIN_CHUNK`` elements per rank), where that is below ``default``. A unit is gathered
    whole however many buckets hold it, but its grads are held, and reduced, bucket by bucket:
    smaller buckets start reducing sooner and hold fewer bytes in flight (two buckets' grads,
    and on gloo what they receive; [Note: transient bound] in memory.py)."""
    if not units:
        return default
    largest = max(unit.numel for unit in units)
    return min(default, max(MIN_CHUNK * dp_size, -(-largest // UNIT_BUCKETS)))


def unit_index_of(units: Sequence[GatherUnit]) -> dict[nn.Parameter, int]:
    """Each param's unit, as a position in ``units`` (loose params are absent)."""
    return {p: i for i, unit in enumerate(units) for p in unit.params}
