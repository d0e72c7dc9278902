"""Leave distopt and come back: a checkpoint as one plain PyTorch file, and the reverse.

``export_checkpoint`` writes ``{"model": module.state_dict(), "optimizer": torch_optimizer_state,
"extra": ..., "loss_scaler": ...}`` such that ``torch.optim.<Class>(model.parameters(), ...)``
(or the same param groups as the distopt run) loads the optimizer state and training goes on
without distopt. ``load_plain_checkpoint`` starts a distopt run from such a file.

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

import argparse
import collections
import os
import pickle
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import checkpoint_files as files
from .checkpoint_files import CheckpointError
from .checkpoint_state import (
    hyper_params,
    model_prefixes,
    new_state_value,
    owned_pieces,
    piece_of,
)

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from .optimizer import _BufferOptimizer

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
                 storage: torch.UntypedStorage | None = None) -> None:
        self.fqn, self.dtype, self.numel, self.storage = fqn, dtype, numel, storage


class _Placeholder:
    """Pickles as a contiguous tensor whose bytes are the record written later."""

    def __init__(self, fqn: str, shape: list[int], dtype: torch.dtype) -> None:
        numel = 1
        for n in shape:
            numel *= n
        self.record = _Record(fqn=fqn, dtype=dtype, numel=numel)
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
) -> Path:
    """Write checkpoint ``ckpt`` (or the latest in a run directory) as one torch.save file.

    ``master_weights`` writes trainable params from the fp32 main params (float32) instead of
    the model's own dtype: what plain fp32 training should continue from after bf16/fp16.
    One process, no process group; memory stays bounded (see [Note: bounded export]).
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from . import checkpoint_dcp

    out = Path(out)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"cannot write {out}: {out.parent} is not a directory")
    ckpt_dir = files.resolve(ckpt)
    manifest = files.read_manifest(ckpt_dir)
    if verify:
        files.verify_files(ckpt_dir, manifest["files"])
    metadata = checkpoint_dcp.read_metadata(ckpt_dir)
    index = metadata.state_dict_metadata
    objects: dict[str, Any] = {k: None for k, v in index.items()
                               if isinstance(v, BytesStorageMetadata)}
    checkpoint_dcp.load(objects, ckpt_dir, None, metadata)
    tree = _export_tree(manifest, index, objects, master_weights)

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

    # torch numbers params by their position in the param groups, in order.
    order = [all_names] if manifest["default_param_groups"] else manifest["param_groups"]
    position: dict[str, int] = {}
    groups = []
    for names, options in zip(order, objects["meta/param_groups"], strict=True):
        ids = [position.setdefault(n, len(position)) for n in names]
        groups.append({**{k: v for k, v in options.items() if k != "params"}, "params": ids})
    state: dict[int, dict[str, Any]] = {}
    for fqn, entry in index.items():
        if not fqn.startswith("state/"):
            continue
        name, _, key = fqn[len("state/"):].rpartition("/")
        if isinstance(entry, BytesStorageMetadata):
            value: Any = objects[fqn]
        else:
            value = tensor(fqn, shape_of[name] if len(entry.size) else [])
        state.setdefault(position[name], {})[key] = value
    return {
        "model": model_dicts[0] if len(model_dicts) == 1 else model_dicts,
        "optimizer": {"state": dict(sorted(state.items())), "param_groups": groups},
        "extra": objects.get("extra"),
        "loss_scaler": manifest["loss_scaler"],
    }


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
    from . import checkpoint_dcp

    entry = metadata.state_dict_metadata[record.fqn]
    target = torch.empty(entry.size, dtype=entry.properties.dtype)
    state = {record.fqn: target}
    checkpoint_dcp.load(state, ckpt_dir, None, metadata)
    return target.untyped_storage()


def export_main(argv: list[str]) -> int:
    """``distopt export CKPT OUT.pt``."""
    parser = argparse.ArgumentParser(
        prog="distopt export",
        description="Write a distopt checkpoint as one plain PyTorch file: the model's "
        "state_dict and a torch.optim state dict (load it with torch.load(weights_only=True)).",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run directory "
                        "(its latest checkpoint is exported)")
    parser.add_argument("out", help="the .pt file to write")
    parser.add_argument("--master-weights", action="store_true",
                        help="write trainable params as their fp32 main params")
    parser.add_argument("--no-verify", action="store_true", help="skip the CRC32 checks")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, master_weights=args.master_weights,
                                verify=not args.no_verify)
    except (CheckpointError, OSError) as exc:
        print(f"distopt export: error: {exc}", file=sys.stderr)
        return 2
    source = files.resolve(args.checkpoint)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) from {source}")
    return 0


# ---------------------------------------------------------------------- plain -> distopt


def load_plain_checkpoint(source: str | os.PathLike | dict[str, Any], ddp: Any,
                          opt: _BufferOptimizer) -> Any:
    """Start a distopt run from ``{"model": state_dict, "optimizer": torch_optimizer_state}``.

    ``source`` is such a dict or a file torch.save wrote (read with mmap: each rank touches only
    the elements it owns). The optimizer state is that of ``torch.optim.<Class>`` over
    ``model.parameters()`` (or over the same param groups as this optimizer's). Checks
    everything before changing anything; needs no communication. Returns ``source["extra"]``.
    """
    from .checkpoint import check_pair

    check_pair(ddp, opt)
    if isinstance(source, dict):
        ckpt = source
    else:
        try:
            ckpt = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise CheckpointError(f"cannot read {source} with torch.load: {exc}") from None
    plan = _plan_plain(ckpt, opt)
    state_of, options = plan
    with torch.no_grad():
        sds = ckpt["model"] if isinstance(ckpt["model"], list) else [ckpt["model"]]
        for model, sd in zip(opt.models, sds, strict=True):
            model.finish_param_sync()
            model.module.load_state_dict(sd)
        group_of_main = {id(m): g for g in opt.param_groups for m in g["params"]}
        for owned, (main, entries) in state_of.items():
            owned.main.detach().copy_(main)  # fp32 values kept exactly, not via the model dtype
            group = group_of_main[id(owned.main)]
            live = opt.state.get(owned.main, {})
            new = {k: new_state_value(v, owned, group, k, live) for k, v in entries.items()}
            if new:
                opt.optimizer.state[owned.main] = new
            else:
                opt.optimizer.state.pop(owned.main, None)
    for group, saved in zip(opt.param_groups, options, strict=True):
        group.update({k: v for k, v in saved.items()
                      if k != "params" and not (k == "foreach" and v is None)})
    scaler = ckpt.get("loss_scaler")
    if opt.loss_scaler is not None and scaler is not None:
        opt.loss_scaler.load_state_dict(scaler["state"])
    return ckpt.get("extra")


def _plan_plain(ckpt: Any, opt: _BufferOptimizer):
    if not (isinstance(ckpt, dict) and "model" in ckpt and "optimizer" in ckpt):
        raise CheckpointError(
            "a plain checkpoint is a dict with 'model' (the module's state_dict) and "
            "'optimizer' (the torch optimizer's state_dict)"
        )
    sds = ckpt["model"] if isinstance(ckpt["model"], list) else [ckpt["model"]]
    if len(sds) != len(opt.models):
        raise CheckpointError(f"the file has {len(sds)} model state dicts, the optimizer "
                              f"{len(opt.models)} models")
    all_names, trainable_names, values = [], [], {}
    for prefix, model, sd in zip(model_prefixes(opt), opt.models, sds, strict=True):
        here = model.module.state_dict()
        missing = sorted(set(here) - set(sd))[:5]
        unexpected = sorted(set(sd) - set(here))[:5]
        reshaped = [k for k in here if k in sd and isinstance(here[k], torch.Tensor)
                    and tuple(sd[k].shape) != tuple(here[k].shape)][:5]
        if missing or unexpected or reshaped:
            raise CheckpointError(
                f"the plain checkpoint is of another model (missing: {missing}, not in this "
                f"model: {unexpected}, other shapes: {reshaped}): load a checkpoint of this model"
            )
        for n, p in model.module.named_parameters():
            all_names.append(prefix + n)
            if p.requires_grad:
                trainable_names.append(prefix + n)
            values[prefix + n] = sd[n]

    osd = ckpt["optimizer"]
    plain_groups = osd.get("param_groups") if isinstance(osd, dict) else None
    if not isinstance(plain_groups, list) or not isinstance(osd.get("state"), dict):
        raise CheckpointError("'optimizer' must be a torch.optim state_dict (state, param_groups)")
    if opt.default_param_groups and len(plain_groups) == 1:
        size = len(plain_groups[0]["params"])
        if size not in (len(all_names), len(trainable_names)):
            raise CheckpointError(
                f"the optimizer state has {size} params, the model {len(all_names)} "
                f"({len(trainable_names)} trainable)"
            )
        orders = [all_names if size == len(all_names) else trainable_names]
    else:
        orders = [group["params"] for group in hyper_params(opt)]
        sizes = [len(g["params"]) for g in plain_groups]
        if sizes != [len(o) for o in orders]:
            raise CheckpointError(
                f"the optimizer state's param groups hold {sizes} params, this optimizer's "
                f"{[len(o) for o in orders]}: build it with the same param groups"
            )
    name_of = {}
    for group, names in zip(plain_groups, orders, strict=True):
        name_of.update(zip(group["params"], names, strict=True))
    plain_state = {name_of[pid]: entries for pid, entries in osd["state"].items()
                   if pid in name_of}

    state_of = {}
    for owned in owned_pieces(opt):
        main = piece_of(values[owned.name], owned, "model value").float()
        entries = {}
        for key, value in plain_state.get(owned.name, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                entries[key] = piece_of(value, owned, f"state '{key}'")
            else:
                entries[key] = value
        state_of[owned] = (main, entries)
    return state_of, plain_groups
