"""A Megatron-Core distributed-optimizer checkpoint (``dist_checkpointing.save`` in its
``torch_dist`` format) read as torch's layout, without Megatron-Core ([Note: converted
checkpoints] in convert.py).

[Note: Megatron-Core's torch_dist checkpoint layout]
``dist_checkpointing.save(sharded_state_dict, dir)`` writes ``dir/metadata.json``
(``{"sharded_backend": "torch_dist", ...}``) and a DCP checkpoint: ``dir/.metadata`` and the
ranks' ``__<rank>_<n>.distcp`` files. Each ``ShardedTensor`` is saved under its key as one
global tensor (its ranks' pieces as DCP chunks): a model param under its sharded key (for a
model of torch modules, its FQN: ``decoder.layers.0.mlp.linear_fc1.weight``), and the
``DistributedOptimizer``'s state, in the ``fully_reshardable`` sharding, under
``optimizer.state.<k>.<param key>`` with the param's shape: ``k`` is ``param`` (the fp32
master; ``fp32_param`` in older releases), ``exp_avg``, ``exp_avg_sq``. Everything else, the
"common state", is pickled whole as the DCP object ``common_state`` (older releases: a
``common.pt`` file beside): there the optimizer's part holds ``param_state_sharding_type`` and
torch's ``param_groups`` without their ``params`` and with the step count in each group
(``step``), and Megatron-LM adds its iteration, args, RNG and scheduler states. In the
``dp_reshardable`` sharding (Megatron-LM's default) the state is the optimizer's flat buckets
instead, and the param groups an object beside ([Note: Megatron-Core's dp_reshardable
buckets] in from_megatron_buckets.py). Megatron-LM
saves each iteration into ``dir/iter_<7 digits>`` and names the last in
``dir/latest_checkpointed_iteration.txt``.

The param groups' membership is not saved (Megatron-Core rebuilds it from the model when it
loads), so it is rebuilt here as Megatron-Core's default rule builds it: a param whose key ends
in ``.bias`` or that has one dimension is in the group with ``wd_mult`` 0, the others in the
group with ``wd_mult`` 1 (both with ``lr_mult`` 1, neither expert-parallel nor with a decoupled
LR). A run whose groups that rule does not reproduce is refused by name.

Each output tensor is one DCP tensor of the source (or, from a bucket, one param's slice of
it), read alone when it is written (DCP's reader assembles its chunks from the ranks' files).
Refused by name: other shardings, other backends (``zarr``), model chunks or several
optimizers in one checkpoint, and a source whose files are missing or short.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from . import from_megatron_buckets as buckets
from .converted import Converted, Lazy
from .files import CheckpointError
from .torch_layout import torch_fqn
from .torch_zip import TorchFile

_STATE = "optimizer.state."
_MASTER_KEYS = ("param", "fp32_param")
_SHARDINGS = ("fully_reshardable", "dp_reshardable")
_FIX = ("save it from Megatron-Core with the optimizer's sharded_state_dict(..., metadata="
        "{'distrib_optim_sharding_type': 'fully_reshardable'}) (Megatron-LM: "
        "--dist-ckpt-optim-fully-reshardable), which names each param's state")


def looks_like(path: Path) -> bool:
    """Whether ``path`` is a Megatron checkpoint directory (or one iteration of it)."""
    return (path / "latest_checkpointed_iteration.txt").is_file() or (
        (path / ".metadata").is_file() and ((path / "metadata.json").is_file()
                                            or (path / "common.pt").is_file()))


def iteration_directory(path: Path) -> Path:
    """The directory of one saved iteration: ``path`` itself, or the one that
    ``latest_checkpointed_iteration.txt`` names."""
    if (path / ".metadata").is_file():
        return path
    latest = path / "latest_checkpointed_iteration.txt"
    if not latest.is_file():
        raise CheckpointError(f"{path} has no .metadata and no latest_checkpointed_iteration.txt:"
                              " give the directory dist_checkpointing.save wrote, or the "
                              "Megatron-LM save directory above it")
    text = latest.read_text().strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else ""
    if not name or not (path / name).is_dir():
        raise CheckpointError(f"{latest} names iteration '{text}', but {path / (name or text)} "
                              "is missing")
    if not (path / name / ".metadata").is_file():
        raise CheckpointError(f"{path / name} holds no .metadata: not a torch_dist checkpoint, "
                              "or a partial one")
    return path / name


class _Source:
    """One torch_dist checkpoint: its DCP metadata, read once, and a reader of its tensors."""

    def __init__(self, directory: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.directory = directory
        self._check_backend()
        self.reader = FileSystemReader(str(directory))
        try:
            self.metadata = self.reader.read_metadata()
        except Exception as exc:  # a truncated or foreign .metadata
            raise CheckpointError(f"{directory / '.metadata'} cannot be read ({exc}): the "
                                  "checkpoint is damaged") from None
        self.reader.read_metadata = lambda *a, **k: self.metadata  # read once, not per tensor
        self._check_files()

    def _check_backend(self) -> None:
        import json

        path = self.directory / "metadata.json"
        if not path.is_file():
            if (self.directory / "common.pt").is_file():
                return  # older releases: no metadata.json, the common state in common.pt
            raise CheckpointError(f"{self.directory} is partial: metadata.json (the backend "
                                  "that wrote it) is missing")
        backend = json.loads(path.read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(f"{self.directory} was saved with Megatron-Core's "
                                  f"'{backend}' backend; distopt convert reads 'torch_dist' "
                                  "checkpoints")

    def _check_files(self) -> None:
        """Every file that .metadata names exists and holds its records: a partial copy is
        named here rather than failing at its first missing tensor."""
        ends: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0),
                                           info.offset + info.length)
        missing = sorted(f for f in ends if not (self.directory / f).is_file())
        if missing:
            raise CheckpointError(f"{self.directory} is partial: {', '.join(missing)} (named "
                                  "by its .metadata) missing")
        for name, end in sorted(ends.items()):
            size = os.path.getsize(self.directory / name)
            if size < end:
                raise CheckpointError(f"{self.directory / name} is truncated: {size} bytes, "
                                      f"its .metadata places records up to byte {end}")

    def tensors(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return {k: v for k, v in self.metadata.state_dict_metadata.items()
                if isinstance(v, TensorStorageMetadata)}

    def objects(self) -> list[str]:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        return [k for k, v in self.metadata.state_dict_metadata.items()
                if isinstance(v, BytesStorageMetadata)]

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor saved under ``key``, assembled from its chunks."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        meta = self.metadata.state_dict_metadata[key]
        out = torch.empty(meta.size, dtype=meta.properties.dtype)
        try:
            dcp.load({key: out}, storage_reader=self.reader, no_dist=True)
        except CheckpointException as exc:
            error = next(iter(exc.failures.values()))
            raise CheckpointError(f"{self.directory}: reading '{key}' failed: {error}") from None
        return out

    def read_slice(self, key: str, start: int, numel: int) -> torch.Tensor:
        """Elements ``start:start + numel`` of the 1-D tensor saved under ``key``, read
        without the rest of it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import (
            create_read_items_for_chunk_list,
        )

        meta = self.metadata.state_dict_metadata[key]

        class _SlicePlanner(DefaultLoadPlanner):
            def create_local_plan(self) -> LoadPlan:
                chunk = ChunkStorageMetadata(torch.Size([start]), torch.Size([numel]))
                return LoadPlan(create_read_items_for_chunk_list(key, meta, [chunk]))

            def resolve_tensor(self, read_item: Any) -> torch.Tensor:
                # ``out`` is the one destination; the default lookup expects a
                # ShardedTensor where the destination chunk has an offset.
                return out[read_item.dest_offsets[0]:][:read_item.lengths[0]]

        out = torch.empty(numel, dtype=meta.properties.dtype)
        try:
            dcp.load({key: out}, storage_reader=self.reader, planner=_SlicePlanner(),
                     no_dist=True)
        except CheckpointException as exc:
            error = next(iter(exc.failures.values()))
            raise CheckpointError(f"{self.directory}: reading '{key}' failed: {error}") from None
        return out

    def object_tree(self, name: str) -> Any | None:
        """The object saved under ``name`` (a ``ShardedObject``'s key: its one shard), read
        without Megatron-Core's classes; None when there is none."""
        names = [k for k in self.objects() if k.split("/")[0] == name]
        if not names:
            return None
        index = next(i for i in self.metadata.storage_data if i.fqn == names[0])
        info = self.metadata.storage_data[index]
        if info.transform_descriptors:
            raise CheckpointError(f"{self.directory}: '{name}' is stored with transforms "
                                  f"{info.transform_descriptors}, which distopt convert does "
                                  "not read")
        with open(self.directory / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        tree = TorchFile(self.directory / info.relative_path, data=data).tree
        if isinstance(tree, list) and len(tree) == 1:  # a ShardedObject's one shard
            tree = tree[0]
        return tree

    def common(self) -> Any:
        """The common state: the ``common_state`` object, or common.pt, read without
        Megatron-Core's classes."""
        tree = self.object_tree("common_state")
        if tree is None and (self.directory / "common.pt").is_file():
            tree = TorchFile(self.directory / "common.pt").tree
        elif tree is None:
            raise CheckpointError(f"{self.directory} is partial: its common state (the "
                                  "'common_state' object, or common.pt) is missing")
        if isinstance(tree, list) and len(tree) == 1:  # a ShardedObject's one shard
            tree = tree[0]
        if not isinstance(tree, dict):
            raise CheckpointError(f"{self.directory}: the common state is not a dict")
        return tree


def _optimizer_common(common: dict[str, Any], where: Path) -> tuple[str, dict[str, Any]]:
    """The top-level key of the optimizer's common state, and that state."""
    found = [(k, v) for k, v in common.items()
             if isinstance(v, dict) and "param_state_sharding_type" in v]
    if not found:
        chained = [k for k, v in common.items() if isinstance(v, dict) and
                   any(isinstance(x, dict) and "param_state_sharding_type" in x
                       for x in v.values())]
        if chained:
            raise CheckpointError(f"{where} holds the state of several optimizers under "
                                  f"'{chained[0]}' (a ChainedOptimizer: model chunks, experts "
                                  "or several optimizer classes), which distopt convert does "
                                  "not cover")
        raise CheckpointError(f"{where} holds no distributed-optimizer state (no "
                              "param_state_sharding_type in its common state): saved without "
                              "the optimizer's sharded_state_dict?")
    if len(found) > 1:
        raise CheckpointError(f"{where} holds {len(found)} optimizers' states "
                              f"({', '.join(k for k, _ in found)}); distopt convert covers one")
    key, state = found[0]
    sharding = state["param_state_sharding_type"]
    if sharding not in _SHARDINGS:
        raise CheckpointError(f"{where}: the distributed optimizer's state was saved in the "
                              f"'{sharding}' sharding, which distopt convert does not read; "
                              f"{_FIX}")
    return key, state


def _with_param_groups(source: _Source, state: dict[str, Any],
                       tensors: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's common state with its param groups (and grad scaler): in the common
    state, or, in the dp_reshardable sharding, in objects beside."""
    if state["param_state_sharding_type"] == "dp_reshardable":
        state = dict(state)
        for name in buckets.object_names(tensors, source.directory):
            value = source.object_tree(name)
            if value is not None:
                state[name.rsplit(".", 1)[1]] = value
    inner = state.get("optimizer")
    if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
        raise CheckpointError(f"{source.directory}: the optimizer's state holds no "
                              "param_groups")
    return state


def _group_key(fqn: str, shape: tuple[int, ...]) -> float:
    """Megatron-Core's default rule: biases and 1-D params without weight decay."""
    return 0.0 if fqn.endswith(".bias") or len(shape) == 1 else 1.0


def _assign_groups(params: dict[str, tuple[int, ...]], groups: list[dict[str, Any]],
                   where: Path) -> list[list[str]]:
    members: list[list[str]] = [[] for _ in groups]
    if len(groups) == 1:
        members[0] = list(params)
        return members
    for fqn, shape in params.items():
        wd_mult = _group_key(fqn, shape)
        matches = [i for i, g in enumerate(groups)
                   if g.get("wd_mult") == wd_mult and g.get("lr_mult", 1.0) == 1.0
                   and not g.get("is_expert_parallel") and not g.get("is_decoupled_lr")]
        if len(matches) != 1:
            raise CheckpointError(
                f"{where}: param '{fqn}' matches {len(matches)} of the {len(groups)} saved "
                "param groups by Megatron-Core's default rule (wd_mult 0 for biases and 1-D "
                "params, lr_mult 1): the run grouped its params otherwise (no_weight_decay_cond"
                ", scale_lr_cond, decoupled LR, experts), which the checkpoint does not record")
        members[matches[0]].append(fqn)
    return members


def _step(groups: list[dict[str, Any]], where: Path) -> torch.Tensor:
    steps = {float(g["step"]) for g in groups if g.get("step") is not None}
    if len(steps) != 1:
        raise CheckpointError(f"{where}: the param groups hold steps {sorted(steps)}; one step "
                              "count is needed (saved before the first step?)")
    return torch.tensor(steps.pop(), dtype=torch.float32)  # torch's Adam keeps a float step


def _not_carried(common: dict[str, Any], optimizer_key: str, optimizer: dict[str, Any],
                 objects: list[str], skipped: list[str]) -> list[str]:
    notes = []
    if optimizer.get("grad_scaler") is not None:
        notes.append("the fp16/bf16 grad scaler's state")
    others = sorted(str(k) for k in common if k != optimizer_key
                    and not (isinstance(k, str) and k.startswith("model")))
    if others:
        notes.append(f"the common state saved beside the model and optimizer "
                     f"({', '.join(others)}: iteration, RNG, scheduler, args, ...)")
    sharded = sorted({k.split("/")[0] for k in objects if not k.startswith("common_state")})
    if sharded:
        notes.append(f"the sharded objects ({', '.join(sharded)})")
    if skipped:
        notes.append(f"{len(skipped)} non-tensor model entries (e.g. {skipped[0]})")
    return notes


def _lazy(source: _Source, key: str, meta: Any, dtype: torch.dtype | None = None) -> Lazy:
    return Lazy(tuple(meta.size), dtype or meta.properties.dtype, lambda: source.read(key))


def _named_state(source: _Source, tensors: dict[str, Any],
                 where: Path) -> dict[str, dict[str, tuple[tuple[int, ...], Lazy]]]:
    """fully_reshardable: each param key's states (``param``: its master), read whole."""
    state_keys: dict[str, dict[str, str]] = {}  # param key -> state name -> DCP key
    for key in tensors:
        if key.startswith(_STATE):
            name, _, param = key[len(_STATE):].partition(".")
            state_keys.setdefault(param, {})[name] = key
    if not state_keys:
        raise CheckpointError(f"{where} holds no optimizer state tensors "
                              f"({_STATE}<name>.<param>): saved without the optimizer?")
    out = {}
    for param, names in state_keys.items():
        master = next((names[k] for k in _MASTER_KEYS if k in names), None)
        if master is None:
            raise CheckpointError(f"{where} is partial: the fp32 master of '{param}' "
                                  f"({_STATE}param.{param}) is missing")
        shape = tuple(tensors[master].size)
        for key in names.values():
            if tuple(tensors[key].size) != shape:
                raise CheckpointError(f"{where}: '{key}' has shape "
                                      f"{tuple(tensors[key].size)}, its param {shape}")
        out[param] = {"param" if k == master else n: _lazy(source, k, tensors[k])
                      for n, k in sorted(names.items())}
    return out


def _bucket_state(source: _Source, tensors: dict[str, Any],
                  where: Path) -> dict[str, dict[str, Lazy]]:
    """dp_reshardable: each param key's states, read as slices of the buckets; see [Note:
    Megatron-Core's dp_reshardable buckets]."""
    params = [k for k in tensors if not k.startswith("optimizer.")]
    out = {}
    for param, (start, keys) in buckets.places(tensors, params, where).items():
        shape = tuple(tensors[param].size)
        numel = 1
        for n in shape:
            numel *= n

        def reader(key: str, start: int = start, numel: int = numel) -> Any:
            return lambda: source.read_slice(key, start, numel)

        lazies = {name: Lazy(shape, tensors[key].properties.dtype, reader(key))
                  for name, key in sorted(keys.items()) if name != "param"}
        master = buckets.checked_master(reader(keys["param"]),
                                        lambda param=param: source.read(param), param, where)
        lazies["param"] = Lazy(shape, tensors[keys["param"]].properties.dtype, master)
        out[param] = lazies
    return out


def read(path: Path) -> Converted:
    """The Megatron-Core checkpoint at ``path`` (a saved iteration, or the Megatron-LM save
    directory above it) as torch's layout; see [Note: Megatron-Core's torch_dist checkpoint
    layout]."""
    directory = iteration_directory(path)
    source = _Source(directory)
    common = source.common()
    optimizer_key, optimizer = _optimizer_common(common, directory)
    tensors = source.tensors()
    optimizer = _with_param_groups(source, optimizer, tensors)
    sharding = optimizer["param_state_sharding_type"]
    has_buckets = any(k.startswith(buckets.PREFIX) for k in tensors)
    if has_buckets != (sharding == "dp_reshardable"):
        raise CheckpointError(f"{directory}: its optimizer state tensors do not match its "
                              f"'{sharding}' sharding")
    per_param = (_bucket_state(source, tensors, directory) if has_buckets
                 else _named_state(source, tensors, directory))
    model: dict[str, Lazy | torch.Tensor] = {}
    state: dict[str, dict[str, Lazy | torch.Tensor]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    groups = optimizer["optimizer"]["param_groups"]
    step = _step(groups, directory)
    for param, lazies in per_param.items():
        fqn = torch_fqn(param)
        master = lazies["param"]
        model[fqn] = Lazy(master.shape, torch.float32, master.read)
        state[fqn] = {"step": step.clone()}
        state[fqn].update({n: v for n, v in lazies.items() if n != "param"})
        shapes[fqn] = master.shape
    for key, meta in tensors.items():  # buffers and frozen params, saved as they are
        if not key.startswith("optimizer.") and torch_fqn(key) not in model:
            model[torch_fqn(key)] = _lazy(source, key, meta)
    skipped = [k for k in source.objects()
               if not k.startswith("common_state") and "_extra_state" in k]
    members = _assign_groups(shapes, groups, directory)
    param_groups = []
    for group, fqns in zip(groups, members, strict=True):
        if fqns:
            options = {k: v for k, v in group.items() if k not in ("params", "step")}
            param_groups.append({**options, "params": fqns})
    objects = [k for k in source.objects() if "_extra_state" not in k
               and not k.startswith(buckets.PREFIX)]
    world = len({info.relative_path for info in source.metadata.storage_data.values()})
    return Converted(f"Megatron-Core checkpoint {directory} ({sharding}, {world} file(s))",
                     model, state, param_groups,
                     _not_carried(common, optimizer_key, optimizer, objects, skipped))
