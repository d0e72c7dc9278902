"""Byte-level text data for `distopt train`: a corpus read from a folder, and batch samplers.

The default corpus is the `*.py` source of the running interpreter's standard library, so a
training run needs no download. A corpus is split into train and held-out sets BY FILE with
a stable hash of each file's relative path, so the split is the same on every rank, every
run and every machine with the same files.

[Note: global batches] The global batch of step `s` is a function of `(seed, s)` only. Every
rank draws the whole global batch's window offsets and keeps its contiguous block of rows,
so the rows of all ranks, concatenated by rank, are exactly the batch of a single process.
A run can therefore be resumed at any DP size that divides the global batch size and see the
same data, and a loss averaged over ranks equals the single-process loss.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DOC_SEPARATOR",
    "BatchSampler",
    "Corpus",
    "default_data_dir",
    "eval_batches",
    "load_corpus",
]

DOC_SEPARATOR = 0
"""Byte placed between two files of a split; text files never contain it."""

# Folders never read: caches and hidden folders (.git, .venv) hold no source text worth
# training on, and installed packages would swamp the standard library in the default corpus.
_SKIP_DIRS = frozenset({"__pycache__"})
_DEFAULT_SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
_DEFAULT_SUFFIXES = (".py",)


def default_data_dir() -> Path:
    """The standard-library source folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(kw_only=True, slots=True)
class Corpus:
    """A corpus split by file into two flat byte streams."""

    train: torch.Tensor
    """uint8 `[n_train_bytes]`: the training files, in path order, joined by DOC_SEPARATOR."""
    heldout: torch.Tensor
    """uint8 `[n_heldout_bytes]`: the held-out files, in path order, joined by DOC_SEPARATOR."""
    num_files_train: int
    """Files (whole or cut by max_bytes) in `train`."""
    num_files_heldout: int
    """Files (whole or cut by max_bytes) in `heldout`."""
    source: Path
    """Folder the files were read from."""


def load_corpus(
    data_dir: str | Path | None = None,
    *,
    heldout_fraction: float = 0.05,
    max_bytes: int | None = None,
    suffixes: str | Iterable[str] | None = None,
) -> Corpus:
    """Read the text files under `data_dir` (default: the standard library's `*.py` files).

    Files are visited in sorted relative-path order; a file is text when it decodes as UTF-8
    and holds no 0 byte (anything else is skipped as binary). About `heldout_fraction` of the
    files go to the held-out split. `max_bytes` caps each split: whole files are taken in
    order while they fit (a first file larger than the cap is cut to it). `suffixes` keeps
    only files whose names end with one of them; None keeps `.py` files for the default
    corpus and every text file for a user folder. Hidden entries and `__pycache__` are
    skipped, and `site-packages` too in the default corpus.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(
            f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}; 0.05 is a good default"
        )
    if max_bytes is not None and (isinstance(max_bytes, bool) or max_bytes <= 0):
        raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
    if data_dir is None:
        root, skip_dirs = default_data_dir(), _DEFAULT_SKIP_DIRS
        suffixes = _DEFAULT_SUFFIXES if suffixes is None else suffixes
    else:
        root, skip_dirs = Path(data_dir).expanduser(), _SKIP_DIRS
    if not root.exists():
        raise ValueError(
            f"data folder {root} does not exist; pass an existing folder of text files, "
            f"or no folder for the built-in standard-library corpus"
        )
    if not root.is_dir():
        raise ValueError(f"data path {root} is a file; pass the folder of text files instead")
    root = root.resolve()
    if isinstance(suffixes, str):
        suffixes = (suffixes,)
    suffix_tuple = None if suffixes is None else tuple(suffixes)

    rel_paths = _list_files(root, skip_dirs, suffix_tuple)
    heldout_paths = [p for p in rel_paths if _heldout_score(p) < heldout_fraction]
    heldout_set = set(heldout_paths)
    heldout, num_heldout = _collect(root, heldout_paths, max_bytes)
    if num_heldout == 0:
        # A small folder can leave no file under the hash threshold: hold out the text file
        # nearest to it instead, which keeps the choice a pure function of the file names.
        for rel in sorted(rel_paths, key=_heldout_score):
            if rel not in heldout_set and _read_text(root / rel) is not None:
                heldout_set.add(rel)
                heldout, num_heldout = _collect(root, [rel], max_bytes)
                break
    train, num_train = _collect(root, [p for p in rel_paths if p not in heldout_set], max_bytes)
    what = "files" if suffix_tuple is None else f"files ending in {', '.join(suffix_tuple)}"
    if num_heldout == 0:
        raise ValueError(
            f"no text {what} found under {root}; pass a folder that holds UTF-8 text files"
        )
    if num_train == 0:
        raise ValueError(
            f"the corpus under {root} has a single text file, too small for a train and a "
            f"held-out split; add at least one more text file to the folder"
        )
    return Corpus(
        train=train,
        heldout=heldout,
        num_files_train=num_train,
        num_files_heldout=num_heldout,
        source=root,
    )


def _list_files(
    root: Path, skip_dirs: frozenset[str], suffixes: tuple[str, ...] | None
) -> list[str]:
    """Relative POSIX paths of the candidate files under `root`, sorted."""
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):  # symlinked folders are not followed
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        base = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.startswith(".") or (suffixes is not None and not name.endswith(suffixes)):
                continue
            rel_paths.append((base / name).as_posix())
    return sorted(rel_paths)


def _heldout_score(rel_path: str) -> float:
    """A uniform number in [0, 1) fixed by the path alone (Python's `hash` is salted)."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _read_text(path: Path) -> bytes | None:
    """The bytes of a non-empty text file, or None for binary, empty or unreadable files."""
    try:
        data = path.read_bytes()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return data if data and DOC_SEPARATOR not in data else None


def _collect(root: Path, rel_paths: list[str], max_bytes: int | None) -> tuple[torch.Tensor, int]:
    """Join the text files among `rel_paths` into one uint8 tensor, at most `max_bytes` long."""
    parts: list[bytes] = []
    size = 0
    for rel in rel_paths:
        data = _read_text(root / rel)
        if data is None:
            continue
        added = len(data) + (1 if parts else 0)
        if max_bytes is not None and size + added > max_bytes:
            if not parts:  # cut a first file that alone exceeds the cap
                parts.append(data[:max_bytes])
            break
        parts.append(data)
        size += added
    if not parts:
        return torch.empty(0, dtype=torch.uint8), 0
    # frombuffer shares the bytearray's memory (and keeps it alive): no second copy.
    blob = bytearray(bytes([DOC_SEPARATOR]).join(parts))
    return torch.frombuffer(blob, dtype=torch.uint8), len(parts)


def _step_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator whose state depends on `(seed, step)` only."""
    digest = hashlib.sha256(f"distopt-batch:{seed}:{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)


def _windows(data: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, ...]:
    """Inputs and next-byte targets, int64 `[len(offsets), seq_len]`, from windows of `data`."""
    rows = data[offsets[:, None] + torch.arange(seq_len + 1)].long()  # [rows, seq_len + 1]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _check_split(
    data: torch.Tensor, seq_len: int, batch_size: int, dp_rank: int, dp_size: int, what: str
) -> None:
    if data.dim() != 1:
        raise ValueError(f"data must be a 1-D tensor of token ids, got shape {tuple(data.shape)}")
    for name, value in (("seq_len", seq_len), (what, batch_size), ("dp_size", dp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank!r}")
    if batch_size % dp_size != 0:
        raise ValueError(
            f"{what} ({batch_size}) must be divisible by dp_size ({dp_size}); "
            f"use a multiple of {dp_size}, e.g. {(batch_size // dp_size + 1) * dp_size}"
        )
    if data.numel() < seq_len + 1:
        raise ValueError(
            f"data has {data.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            f"use a shorter seq_len or more data (a larger max_bytes)"
        )


class BatchSampler:
    """Random windows of `data` for one DP rank, step by step; see [Note: global batches].

    `next_batch()` returns this rank's `global_batch_size // dp_size` rows of the global batch
    of step `self.step` (rows `dp_rank * local` to `(dp_rank + 1) * local`) and advances the
    step. `state_dict()` / `load_state_dict()` save and restore the position.
    """

    def __init__(
        self,
        data: torch.Tensor,
        *,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        _check_split(data, seq_len, global_batch_size, dp_rank, dp_size, "global_batch_size")
        self.data = data
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.step = 0
        """Step whose batch `next_batch()` returns next."""

    @property
    def local_batch_size(self) -> int:
        """Rows of the global batch this rank gets."""
        return self.global_batch_size // self.dp_size

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's `(x, y)`, int64 `[local_batch_size, seq_len]`, of step `step`."""
        # Draw all ranks' offsets so each rank's block is a slice of the same global batch.
        high = self.data.numel() - self.seq_len  # last valid window start is high - 1
        offsets = torch.randint(
            high, (self.global_batch_size,), generator=_step_generator(self.seed, step)
        )
        start = self.dp_rank * self.local_batch_size
        return _windows(self.data, offsets[start : start + self.local_batch_size], self.seq_len)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's `(x, y)` of step `self.step`; then advances the step."""
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The position in the sequence of batches: `{"step": ..., "seed": ...}`."""
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the position saved by `state_dict()` (at any valid DP size)."""
        missing = {"step", "seed"} - set(state)
        if missing:
            raise ValueError(
                f"sampler state lacks {sorted(missing)}; pass a dict from BatchSampler.state_dict()"
            )
        if state["step"] < 0:
            raise ValueError(f"sampler state has a negative step {state['step']!r}")
        self.step = int(state["step"])
        self.seed = int(state["seed"])


def eval_batches(
    data: torch.Tensor,
    *,
    seq_len: int,
    batch_size: int,
    num_batches: int,
    dp_rank: int,
    dp_size: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of `num_batches` evaluation batches of `batch_size` rows (global), split
    across ranks like `BatchSampler`: this rank gets rows `dp_rank * local` to
    `(dp_rank + 1) * local` of each. Windows start at evenly spaced offsets that span `data`,
    so every rank and every DP size evaluates the same windows.
    """
    _check_split(data, seq_len, batch_size, dp_rank, dp_size, "batch_size")
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches <= 0:
        raise ValueError(f"num_batches must be a positive int, got {num_batches!r}")
    total = batch_size * num_batches
    last = data.numel() - seq_len - 1  # last valid window start
    offsets = torch.arange(total, dtype=torch.int64) * last // max(total - 1, 1)
    local = batch_size // dp_size
    batches = []
    for b in range(num_batches):
        start = b * batch_size + dp_rank * local
        batches.append(_windows(data, offsets[start : start + local], seq_len))
    return batches
