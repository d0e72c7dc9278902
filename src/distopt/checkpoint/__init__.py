"""Checkpoints that reshard: save at one DP size, resume at any other, export to plain PyTorch.

``save_checkpoint`` and ``load_checkpoint`` are collective over the data-parallel group. Each rank
writes only what it owns, through torch.distributed.checkpoint (DCP), in torch's layout for every
model distopt trains ([Note: torch's layout on disk] in layout.py). Checkpoints written before
it, which ``load_checkpoint`` and ``export_checkpoint`` still read, hold these keys::

    main/{name}          fp32 master values: 1-D [numel], one chunk per owning rank
    state/{name}/{key}   per-element optimizer state (exp_avg, ...): 1-D [numel], same chunks;
                         per-parameter scalars (step) once, as 0-d tensors; whole-parameter
                         state of a param owned whole (Adafactor's row_var) in its own shape,
                         from the owner
    model/{key}          the module's state_dict() in its own dtype, each tensor written once;
                         buffers as the first DP ranks hold them (what the next forward
                         broadcasts, see [Note: buffer broadcasting])
    meta/param_groups    the param groups' options, each naming its parameters
    extra                the caller's object (LR scheduler, data position, RNG), from rank 0

next to ``distopt.json``, the manifest that describes the model and the optimizer and lists
every file with its CRC32. Loading reads the manifest and DCP's index, checks them against the
model and the optimizer, verifies the files' checksums (split over the ranks), and only then,
when every rank agrees, reads each rank's elements into place. See [Note: atomic checkpoints],
[Note: flat shards in DCP], [Note: DP-size independent state], [Note: whole-tensor state],
[Note: which ranks agree] and, for tensor-parallel models, [Note: TP checkpoints].

The modules, each importing only modules listed before it:

    files.py       checkpoint directories on disk: atomic commits, ``latest``, manifest, CRC32s
    format.py      the state as stored: FlatShard, names, owned pieces, TP runs
    dcp.py         DCP for distopt's uneven shards: chunks, a bounded writer, a reader
    checks.py      every check a load makes, and how the ranks agree on the verdict
    install.py     loaded values into the optimizer, the same way for every loader
    state_dict.py  ``opt.state_dict()`` and ``opt.load_state_dict()``
    parts.py       what each rank writes: its part of the pieces, the model entries dealt to it
    staging.py     the host buffer an async save copies this rank's part into
    background.py  async saves: the writer thread, the one save in flight, the handle
    save.py        ``save_checkpoint``
    load.py        ``load_checkpoint``
    export.py      ``export_checkpoint``: one plain torch.save file
    plain.py       ``load_plain_checkpoint``: a distopt run from a plain file
    torch_layout.py  torch's ``get_state_dict`` / ``set_state_dict`` layout from the shards

[Note: one-way imports]
This package builds on the optimizers (``distopt.optim``), a layer below it: it reads the
optimizer's shared class (``distopt.optim.base.BufferOptimizer``) only through the interface
the ``Optimizer`` protocol of format.py names (its pieces, param groups, inner optimizers and
parallel groups). The public classes in ``distopt.optim.optimizers`` have ``state_dict()`` and
``load_state_dict()`` as methods, as torch.optim's do, and their work is done in
``state_dict.py`` with the same checks and install path as the other loaders. The optimizers
do not import this package for it: ``state_dict.py``, when it is imported (this ``__init__``
imports it, and ``import distopt`` imports this package before any optimizer can be built),
hands its functions to ``distopt.optim.optimizers.use_state_dict_functions``. So every import
runs from checkpoint down to optim, never back, as distopt's layers require
(tests/test_import_graph.py, docs/design.md).

One import is deferred on purpose: ``dcp.py`` imports torch.distributed.checkpoint, which is
slow to import, so the functions that save, load or export import it when they run and ``import
distopt`` stays fast for processes that never checkpoint. Nothing in distopt imports ``dcp.py``
back, so the deferral hides no cycle.
"""

import sys

# state_dict.py gives the optimizers their state-dict methods' work when it is imported:
# [Note: one-way imports].
from . import format, state_dict, torch_layout  # noqa: F401
from .background import AsyncCheckpoint
from .export import export_checkpoint
from .files import CheckpointError, has_checkpoint
from .format import FlatShard, merge_state_dicts
from .load import load_checkpoint
from .plain import load_plain_checkpoint
from .save import save_checkpoint
from .staging import staging_bytes

# Pickles name a class by its module. FlatShard is pickled under its public name, so that a
# state dict saved with torch.save survives moves inside this package, and the module that held
# it before the package existed still resolves, so that state dicts saved then load now.
FlatShard.__module__ = __name__
sys.modules.setdefault(f"{__package__.rpartition('.')[0]}.checkpoint_state", format)

__all__ = [
    "AsyncCheckpoint",
    "CheckpointError",
    "FlatShard",
    "export_checkpoint",
    "has_checkpoint",
    "load_checkpoint",
    "load_plain_checkpoint",
    "merge_state_dicts",
    "save_checkpoint",
    "staging_bytes",
]
