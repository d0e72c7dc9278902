"""Leave distopt: a checkpoint as one plain PyTorch file (plain.py is the way back).

``export_checkpoint`` writes ``{"model": module.state_dict(), "optimizer": torch_optimizer_state,
"extra": ..., "loss_scaler": ...}`` such that ``torch.optim.<Class>(model.parameters(), ...)``
(or the same param groups as the distopt run) loads the optimizer state and training goes on
without distopt.

[Note: bounded export]
A torch.save file is a zip archive: ``data.pkl`` pickles the object tree, in which each tensor
names a storage record ``data/<key>``, and each record holds one storage's bytes. torch.save
needs every tensor in memory at once. Export instead pickles the tree with placeholders, whose
shapes and dtypes come from the checkpoint's index, writes ``data.pkl``, and then reads one
tensor at a time from the checkpoint (DCP reads just the chunks it needs) and writes its record
before reading the next. Beyond the interpreter it holds about two of the largest tensors: the
one being written and the saved chunk DCP reads into it. The file is what torch.save writes and
loads with ``torch.load(path, weights_only=True)``.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..optim.block_scaling import pow2
from ..optim.state_precision import EXPONENTS
from . import files
from .files import CheckpointError
from .format import CLASS_KEY

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

_STORAGE_TYPES = {
    torch.float32: "FloatStorage", torch.float64: "DoubleStorage",
    torch.float16: "HalfStorage", torch.bfloat16: "BFloat16Storage",
    torch.int64: "LongStorage", torch.int32: "IntStorage", torch.int16: "ShortStorage",
    torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage",
    torch.complex64: "ComplexFloatStorage", torch.complex128: "ComplexDoubleStorage",
}


def _storage_type(dtype: torch.dtype) -> Any:
    if dtype not in _STORAGE_TYPES:
        raise CheckpointError(f"cannot export tensors of dtype {dtype}")
    return getattr(torch, _STORAGE_TYPES[dtype])


class _Record:
    """One storage of the export: a tensor still in the checkpoint, or one already in memory."""

    def __init__(self, *, fqn: str | None = None, dtype: torch.dtype, numel: int,
                 storage: torch.UntypedStorage | None = None,
                 exponents_fqn: str | None = None) -> None:
        self.fqn, self.dtype, self.numel, self.storage = fqn, dtype, numel, storage
        self.exponents_fqn = exponents_fqn  # scaled state: values * 2**exponents


class _Placeholder:
    """Pickles as a contiguous tensor whose bytes are the record written later."""

    def __init__(self, fqn: str, shape: list[int], dtype: torch.dtype,
                 exponents_fqn: str | None = None) -> None:
        numel = 1
        for n in shape:
            numel *= n
        # Read, then cast to dtype.
        self.record = _Record(fqn=fqn, dtype=dtype, numel=numel, exponents_fqn=exponents_fqn)
        self.shape = tuple(shape)

    def __reduce_ex__(self, protocol: int) -> Any:
        stride, step = [], 1
        for n in reversed(self.shape):
            stride.insert(0, step)
            step *= n
        rebuild = torch._utils._rebuild_tensor_v2  # the function torch.save's tensors name
        return rebuild, (self.record, 0, self.shape, tuple(stride), False,
                         collections.OrderedDict())


class _Pickler(pickle.Pickler):
    """torch.save's pickling: storages become ('storage', type, key, location, numel) ids."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=2)
        self.records: list[_Record] = []
        self._keys: dict[Any, str] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Record):
            record, ident = obj, id(obj)
        elif isinstance(obj, torch.storage.TypedStorage):  # a real tensor, e.g. in ``extra``
            untyped = obj.untyped()
            # Tensors that share a storage share a record, as with torch.save.
            ident = (untyped.data_ptr(), untyped.nbytes(), obj.dtype) if untyped.nbytes() else obj
            record = _Record(dtype=obj.dtype, numel=obj.size(), storage=untyped)
        else:
            return None
        if ident not in self._keys:
            self._keys[ident] = str(len(self.records))
            self.records.append(record)
        return ("storage", _storage_type(record.dtype), self._keys[ident], "cpu", record.numel)


def export_checkpoint(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    master_weights: bool = False,
    verify: bool = True,
    transform: Callable[[dict[str, Any]], Any] | None = None,
) -> Path:
    """Write checkpoint ``ckpt`` (or the latest in a run directory) as one torch.save file.

    One process, no process group; memory stays bounded (see [Note: bounded export]). Returns
    the file's path.

    Args:
        ckpt: a checkpoint directory, or a run directory whose ``latest`` checkpoint is
            exported.
        out: the file to write, in a directory that exists; written under a temporary name and
            renamed when complete, so a failed export leaves no partial file.
        master_weights: write the trainable params from the fp32 main params (float32) instead
            of the model's own dtype: what plain fp32 training should continue from after
            bf16/fp16. False (the default): the model's params as the run held them.
        verify: check every file's size and CRC32 against the checkpoint's manifest first
            (True, the default); False skips the read, for files known to be whole.
        transform: makes the object the file holds out of the exported dict (its tensors not
            read yet): ``lambda tree: tree["optimizer"]`` writes the torch optimizer state
            alone, the trainer integrations write their trainers' own file formats; only the
            tensors it keeps are read. None: the dict itself: ``"model"``, ``"optimizer"``
            (``"optimizers"``, one per class, for param groups of several classes),
            ``"extra"`` and ``"loss_scaler"``.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from . import dcp  # see [Note: one-way imports]

    out = Path(out)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"cannot write {out}: {out.parent} is not a directory")
    ckpt_dir = files.resolve(ckpt)
    manifest = files.read_manifest(ckpt_dir)
    if verify:
        files.verify_files(ckpt_dir, manifest["files"])
    metadata = dcp.read_metadata(ckpt_dir)
    index = metadata.state_dict_metadata
    objects: dict[str, Any] = {k: None for k, v in index.items()
                               if isinstance(v, BytesStorageMetadata)}
    dcp.load(objects, ckpt_dir, None, metadata)
    if manifest.get("layout") == "torch":  # [Note: torch's layout on disk] in layout.py
        tree = _export_torch_layout(manifest, metadata, objects, master_weights)
    else:
        tree = _export_tree(manifest, index, objects, master_weights)
    if transform is not None:
        tree = transform(tree)

    tmp = out.with_name(out.name + files.TMP_SUFFIX)
    try:
        _write(tree, tmp, ckpt_dir, metadata)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _export_tree(manifest: dict[str, Any], index: dict[str, Any], objects: dict[str, Any],
                 master_weights: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    def tensor(fqn: str, shape: list[int]) -> _Placeholder:
        return _Placeholder(fqn, shape, index[fqn].properties.dtype)

    model_dicts, all_names, shape_of = [], [], {}
    for saved in manifest["models"]:
        prefix = saved["prefix"]
        trainable = {n for n, _, requires_grad in saved["parameters"] if requires_grad}
        for n, shape, _ in saved["parameters"]:
            all_names.append(prefix + n)
            shape_of[prefix + n] = shape
        sd: dict[str, Any] = {}
        for key, shape, _ in saved["state_dict"]:
            if shape is None:
                sd[key] = objects[f"model/{prefix}{key}"]
            elif master_weights and key in trainable:
                sd[key] = tensor(f"main/{prefix}{key}", shape)
            else:
                sd[key] = tensor(f"model/{prefix}{key}", shape)
        model_dicts.append(sd)

    def state_entries() -> Any:
        whole_state = manifest.get("whole_state", {})
        for fqn, entry in index.items():
            if not fqn.startswith("state/"):
                continue
            name, _, key = fqn[len("state/"):].rpartition("/")
            if key.endswith(EXPONENTS):
                continue  # read with the values they scale
            if isinstance(entry, BytesStorageMetadata):
                value: Any = objects[fqn]
            elif key in whole_state.get(name, {}) or not len(entry.size):
                value = tensor(fqn, list(entry.size))  # whole-parameter state, or a scalar
            else:
                # Per-element state held below fp32 is exported in fp32, what torch.optim
                # steps; see [Note: state precision] in distopt/optim/state_precision.py.
                dtype = entry.properties.dtype
                exponents = fqn + EXPONENTS if fqn + EXPONENTS in index else None
                value = _Placeholder(fqn, shape_of[name],
                                     torch.float32 if dtype.is_floating_point else dtype,
                                     exponents)
            yield name, key, value

    tree = {"model": model_dicts[0] if len(model_dicts) == 1 else model_dicts}
    return tree | _optimizer_tree(manifest, all_names, objects["meta/param_groups"],
                                  state_entries()) | {"extra": objects.get("extra"),
                                                      "loss_scaler": manifest["loss_scaler"]}


def _export_torch_layout(manifest: dict[str, Any], metadata: Metadata, objects: dict[str, Any],
                         master_weights: bool) -> dict[str, Any]:
    """The export of a checkpoint in torch's layout ([Note: torch's layout on disk] in
    layout.py): the same tree as ``_export_tree``'s."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from .layout import EXTRA, _paths, param_groups
    from .torch_layout import torch_fqn

    index = metadata.state_dict_metadata
    paths = _paths(metadata)
    # Model chunks are keyed ``chunk{i}.{key}``, as the earlier layout keys them.
    model_dicts: list[dict[str, Any]] = []
    names: list[str] = []
    shape_of: dict[str, list[int]] = {}
    for saved in manifest["models"]:
        prefix = saved["prefix"]
        trainable = {n for n, _, requires_grad in saved["parameters"] if requires_grad}
        names += [prefix + n for n, _, _ in saved["parameters"]]
        shape_of.update((prefix + n, shape) for n, shape, _ in saved["parameters"])
        sd: dict[str, Any] = {}
        for key, shape, dtype in saved["state_dict"]:
            at = paths[("model", torch_fqn(prefix + key))]
            if shape is None:
                sd[key] = objects[at]
                continue
            # Trainable params are stored as their fp32 masters: the model's dtype is their
            # cast.
            wanted = (torch.float32 if master_weights and key in trainable
                      else getattr(torch, dtype))
            sd[key] = _Placeholder(at, shape, wanted)
        model_dicts.append(sd)
    by_fqn = {torch_fqn(n): n for n in names}
    whole_state = manifest.get("whole_state") or {}

    def state_entries() -> Any:
        for path, at in paths.items():
            if len(path) != 4 or path[:2] != ("optimizer", "state"):
                continue
            name, key, entry = by_fqn[path[2]], path[3], index[at]
            if isinstance(entry, BytesStorageMetadata):
                value: Any = objects[at]
            elif key in whole_state.get(name, {}) or list(entry.size) != shape_of[name] or (
                    key == "step" and not entry.size):
                value = _Placeholder(at, list(entry.size), entry.properties.dtype)
            else:  # per-element state, in fp32 for torch.optim ([Note: state precision])
                dtype = entry.properties.dtype
                value = _Placeholder(at, shape_of[name],
                                     torch.float32 if dtype.is_floating_point else dtype)
            yield name, key, value

    options = [{**g, "params": [by_fqn[f] for f in g.get("params", [])]}
               for g in param_groups(objects, paths)]
    extra = objects.get(paths.get(EXTRA, ""))
    model = model_dicts[0] if len(model_dicts) == 1 else model_dicts
    return ({"model": model} | _optimizer_tree(manifest, names, options, state_entries())
            | {"extra": None if extra is None else torch.load(io.BytesIO(extra),
                                                                weights_only=False),
               "loss_scaler": manifest["loss_scaler"]})


def _optimizer_tree(manifest: dict[str, Any], all_names: list[str],
                    options: list[dict[str, Any]], entries: Any) -> dict[str, Any]:
    """``"optimizer"`` (or ``"optimizers"``, one per class) of the export, from the groups'
    options and the state entries ``(name, key, value)``."""
    # One torch optimizer state per class, over that class's groups in the run's order (the
    # groups of one class are what its torch optimizer would be built over); torch numbers
    # params by their position in its param groups, in order.
    order = [all_names] if manifest["default_param_groups"] else manifest["param_groups"]
    classes = manifest.get("param_group_classes") or [manifest["optimizer"]] * len(order)
    position: dict[str, tuple[str, int]] = {}  # name -> (class, its position there)
    per_class: dict[str, dict[str, Any]] = {}
    for names, group, cls in zip(order, options, classes, strict=True):
        into = per_class.setdefault(cls, {"state": {}, "param_groups": []})
        first = sum(len(g["params"]) for g in into["param_groups"])
        ids = list(range(first, first + len(names)))
        position.update((n, (cls, i)) for n, i in zip(names, ids, strict=True))
        into["param_groups"].append(
            {**{k: v for k, v in group.items() if k not in ("params", CLASS_KEY)}, "params": ids}
        )
    for name, key, value in entries:
        cls, pid = position[name]
        per_class[cls]["state"].setdefault(pid, {})[key] = value
    for sd in per_class.values():
        sd["state"] = dict(sorted(sd["state"].items()))
    tree: dict[str, Any] = {}
    if len(per_class) == 1:
        tree["optimizer"] = next(iter(per_class.values()))
    else:
        tree["optimizers"] = per_class
    return tree


def _write(tree: dict[str, Any], path: Path, ckpt_dir: Path, metadata: Metadata) -> None:
    buffer = _Buffer()
    pickler = _Pickler(buffer)
    pickler.dump(tree)
    data = buffer.getvalue()
    alignment = str(getattr(torch.serialization, "_get_storage_alignment", lambda: 64)())
    with torch.serialization._open_zipfile_writer(str(path)) as writer:
        writer.write_record("data.pkl", data, len(data))
        writer.write_record(".format_version", "1", 1)
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, record in enumerate(pickler.records):
            storage = record.storage
            if storage is None:
                storage = _read(record, ckpt_dir, metadata)
            storage = storage.cpu()
            writer.write_record(f"data/{key}", storage, storage.nbytes())
            del storage  # one tensor in memory at a time


class _Buffer:
    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self._parts.append(bytes(data))

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


def _read(record: _Record, ckpt_dir: Path, metadata: Metadata) -> torch.UntypedStorage:
    """One whole tensor from the checkpoint (DCP reads the chunks that cover it)."""
    from . import dcp  # see [Note: one-way imports]

    entry = metadata.state_dict_metadata[record.fqn]
    target = torch.empty(entry.size, dtype=entry.properties.dtype)
    state = {record.fqn: target}
    if record.exponents_fqn is not None:
        state[record.exponents_fqn] = torch.empty(entry.size, dtype=torch.int8)
    dcp.load(state, ckpt_dir, None, metadata)
    if record.exponents_fqn is not None:  # scaled state, exactly in fp32
        return (target.float() * pow2(state[record.exponents_fqn])).untyped_storage()
    return target.to(record.dtype).untyped_storage()
