"""Another program's ``torch.save`` file, read a slice at a time and without its classes.

[Note: reading foreign torch.save files]
``distopt convert`` reads checkpoints that DeepSpeed and Megatron-Core wrote with
``torch.save``. ``torch.load`` would read every tensor of a file into memory (or map the file,
whose touched pages then count in the process's resident memory until it exits), and its
pickle names the writer's own classes (DeepSpeed's ``ZeroStageEnum`` and loss scaler,
Megatron's config objects), which it would import. Here the file is read as what it is: a zip
archive (stored, not compressed) whose ``data.pkl`` pickles the object tree, each tensor naming
a storage record ``data/<key>``. The pickle is loaded with every tensor as a ``StoredTensor``
(where its elements lie in the file) and every class outside a short list of plain modules as
a ``Foreign`` stand-in that keeps its arguments and state, so neither program need be
installed. ``StoredTensor.read(lo, hi)`` then reads elements [lo, hi) of the tensor flattened
with one positioned read: memory holds only what a caller asked for.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from .files import CheckpointError

# Modules whose classes a checkpoint's pickle may build for real: containers, numbers, paths,
# torch's sizes and dtypes. Everything else becomes a ``Foreign`` stand-in.
_PLAIN_MODULES = ("builtins", "collections", "copyreg", "_codecs", "enum", "argparse",
                  "datetime", "pathlib", "numpy", "torch")
_TENSOR_REBUILDS = {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3"}
_PARAMETER_REBUILDS = {"_rebuild_parameter", "_rebuild_parameter_with_state"}


class Foreign:
    """A stand-in for an object of a class not imported (DeepSpeed's, Megatron's): its class's
    name, the arguments it was built from and its pickled state."""

    _module = _name = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Foreign:
        self = super().__new__(cls)
        self.args, self.state = args, None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self._module}.{self._name}{self.args or ''}>"

    @property
    def value(self) -> Any:
        """An enum member's value (``ZeroStageEnum(2)`` pickles as the class called with 2)."""
        return self.args[0] if len(self.args) == 1 else None


_FOREIGN_CLASSES: dict[tuple[str, str], type] = {}


def _foreign_class(module: str, name: str) -> type:
    key = (module, name)
    if key not in _FOREIGN_CLASSES:
        _FOREIGN_CLASSES[key] = type(name, (Foreign,), {"_module": module, "_name": name})
    return _FOREIGN_CLASSES[key]


class StoredTensor:
    """A tensor of a ``torch.save`` file, not read: where its elements lie, and its shape."""

    def __init__(self, file: TorchFile, key: str, storage_dtype: torch.dtype, offset: int,
                 shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.file, self.key, self.dtype = file, key, storage_dtype
        self.offset, self.shape, self.stride = offset, tuple(shape), tuple(stride)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def _contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def read(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements [lo, hi) of the tensor flattened, as a new 1-D tensor."""
        hi = self.numel if hi is None else hi
        if not 0 <= lo <= hi <= self.numel:
            raise CheckpointError(f"{self.file.path}: elements [{lo}, {hi}) of a tensor of "
                                  f"{self.numel} elements asked for")
        if not self._contiguous():  # not seen in the files converted; small if it ever is
            whole = self.file.read_elements(self.key, self.dtype, 0,
                                            self.file.storage_numel(self.key, self.dtype))
            view = whole.as_strided(self.shape, self.stride, self.offset)
            return view.reshape(-1)[lo:hi].clone()
        return self.file.read_elements(self.key, self.dtype, self.offset + lo, hi - lo)

    def load(self) -> torch.Tensor:
        """The whole tensor, in its shape."""
        return self.read().view(self.shape)

    def __repr__(self) -> str:
        return f"StoredTensor({list(self.shape)}, {self.dtype})"


class TorchFile:
    """One ``torch.save`` file: its object tree with ``StoredTensor`` leaves, read lazily."""

    def __init__(self, path: str | os.PathLike[str], data: bytes | None = None) -> None:
        # ``data``: the file's bytes, already read (a torch.save archive stored inside another
        # file, as Megatron-Core's common state inside a DCP file); ``path`` then names it.
        self.path = Path(path)
        self._data = data
        self._fd = -1
        try:
            self._zip = zipfile.ZipFile(self.path if data is None else io.BytesIO(data))
        except (OSError, zipfile.BadZipFile) as exc:
            raise CheckpointError(f"{self.path} is not a torch.save file written in torch's zip "
                                  f"format (torch >= 1.6): {exc}") from None
        names = self._zip.namelist()
        pickles = [n for n in names if n.endswith("data.pkl") and n.count("/") == 1]
        if not pickles:
            raise CheckpointError(f"{self.path} holds no data.pkl: not a torch.save file")
        self._prefix = pickles[0][: -len("data.pkl")]
        order = self._prefix + "byteorder"
        if order in names and self._zip.read(order) != b"little":
            raise CheckpointError(f"{self.path} was written on a big-endian machine")
        if data is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        self._offsets: dict[str, int] = {}
        self.tree = _Unpickler(io.BytesIO(self._zip.read(pickles[0])), self).load()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._zip.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # best effort, at interpreter exit too
            self.close()

    def _record(self, key: str) -> tuple[int, int]:
        """(offset of the record's first byte in the file, its size) for storage ``key``."""
        name = f"{self._prefix}data/{key}"
        try:
            info = self._zip.getinfo(name)
        except KeyError:
            raise CheckpointError(f"{self.path} is truncated: storage record {name} is "
                                  "missing") from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{self.path}: record {name} is compressed, which torch.save "
                                  "never does")
        if name not in self._offsets:
            header = self._pread(30, info.header_offset)
            if len(header) != 30 or header[:4] != b"PK\x03\x04":
                raise CheckpointError(f"{self.path} is damaged: no zip header for {name}")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            self._offsets[name] = info.header_offset + 30 + name_len + extra_len
        return self._offsets[name], info.file_size

    def _pread(self, count: int, at: int) -> bytes:
        if self._data is not None:
            return self._data[at : at + count]
        return os.pread(self._fd, count, at)

    def storage_numel(self, key: str, dtype: torch.dtype) -> int:
        return self._record(key)[1] // _itemsize(dtype)

    def read_elements(self, key: str, dtype: torch.dtype, start: int, count: int
                      ) -> torch.Tensor:
        """``count`` elements of storage ``key`` from element ``start``, as a new tensor."""
        at, size = self._record(key)
        width = _itemsize(dtype)
        if (start + count) * width > size:
            raise CheckpointError(f"{self.path} is truncated: storage {key} holds {size} bytes, "
                                  f"{(start + count) * width} needed")
        if count == 0:
            return torch.empty(0, dtype=dtype)
        if self._data is not None:
            begin = at + start * width
            return torch.frombuffer(bytearray(self._data[begin : begin + count * width]),
                                    dtype=dtype)
        buffer = bytearray(count * width)  # the tensor's memory: frombuffer shares it
        view, done = memoryview(buffer), 0
        while done < len(buffer):
            n = os.preadv(self._fd, [view[done:]], at + start * width + done)
            if n <= 0:
                raise CheckpointError(f"{self.path} is truncated: storage {key} ends early")
            done += n
        return torch.frombuffer(buffer, dtype=dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: io.BytesIO, file: TorchFile) -> None:
        super().__init__(data)
        self._file = file

    def persistent_load(self, saved_id: Any) -> Any:
        kind = saved_id[0].decode() if isinstance(saved_id[0], bytes) else saved_id[0]
        if kind != "storage":
            raise CheckpointError(f"{self._file.path}: unknown pickled id {kind!r}")
        storage_type, key, _location, _numel = saved_id[1:]
        if storage_type is torch.UntypedStorage:
            dtype = torch.uint8
        else:
            with warnings.catch_warnings():  # the legacy storage classes warn when asked
                warnings.simplefilter("ignore")
                dtype = storage_type.dtype
        return (self._file, str(key), dtype)

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in _TENSOR_REBUILDS:
            return _stored_tensor
        if module == "torch._utils" and name in _PARAMETER_REBUILDS:
            return _stored_parameter
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _plain_tensor
        if module.split(".")[0] in _PLAIN_MODULES:
            return super().find_class(module, name)
        return _foreign_class(module, name)


def _stored_tensor(storage: tuple[TorchFile, str, torch.dtype], offset: int, size: Any,
                   stride: Any, *args: Any) -> StoredTensor:
    file, key, dtype = storage
    # _rebuild_tensor_v3 names the tensor's dtype after the hooks; the storage's otherwise.
    if len(args) >= 3 and isinstance(args[2], torch.dtype):
        dtype = args[2]
    return StoredTensor(file, key, dtype, offset, tuple(size), tuple(stride))


def _plain_tensor(rebuild: Any, _subclass: type, args: tuple, _state: Any) -> Any:
    """A tensor subclass's pickle (a flat partition that is an ``nn.Parameter`` subclass) as its
    plain tensor."""
    return rebuild(*args)


def _stored_parameter(data: StoredTensor, *args: Any) -> StoredTensor:
    return data
