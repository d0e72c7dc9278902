"""Checkpoint directories on disk: atomic commits, the ``latest`` pointer, rotation, checksums.

No torch and no collectives here: the caller decides which rank does what.

[Note: atomic checkpoints]
A run directory holds complete checkpoints only::

    run_dir/
      latest                    the name of the newest complete checkpoint
      ckpt-000001/              a complete checkpoint
        distopt.json            manifest: model and optimizer structure, files with digests
        .metadata               DCP's index of every saved chunk
        __0_0.distcp ...        one file per saving rank
      .ckpt-000002.distopt-tmp/ a save in progress, or one that was interrupted

A save writes everything into the hidden temporary directory, fsyncs every file and then the
directory, renames it into place (atomic on POSIX file systems), fsyncs the run directory, and
only then replaces ``latest`` (write, fsync, rename). So whenever a rank dies, ``latest`` names a
complete checkpoint. The next save removes what an interrupted one left behind. Old checkpoints
are renamed to a hidden name before they are deleted, so a crash while pruning cannot leave a
half-deleted directory that looks like a checkpoint.

[Note: failed saves]
A save that raises (a full disk, a directory that is not writable, on any rank) changes nothing
that a load reads: the ranks agree on the outcome before rank 0 publishes (see save.py), and on
failure ``discard`` removes the temporary directory, a half-written ``latest`` pointer and the
renamed checkpoint if ``latest`` does not name it yet. Whatever cannot be removed keeps its
hidden temporary name, which loads never read and the next save deletes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from . import digest
from .crc import file_crc32

MANIFEST = "distopt.json"
LATEST = "latest"
FORMAT = "distopt-checkpoint"
# 2: torch's layout ([Note: torch's layout on disk] in layout.py) where it applies; 3: each
# file's XXH3 digest in place of its CRC32 ([Note: the files' digest] in digest.py), so that an
# earlier distopt refuses by name what it cannot verify.
VERSION = 3
READABLE = (1, 2, 3)  # every version a load reads
TMP_SUFFIX = ".distopt-tmp"
OLD_SUFFIX = ".distopt-old"


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded here; raised before anything changes."""


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``path`` names: itself, or the one its ``latest`` points to."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    latest = path / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        target = path / name
        if not name or "/" in name or not (target / MANIFEST).is_file():
            raise CheckpointError(
                f"{latest} names '{name}', which is not a complete checkpoint in {path}: "
                "restore the directory or point 'latest' at one that exists"
            )
        return target
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the path does not exist")
    raise CheckpointError(
        f"{path} is neither a distopt checkpoint (no {MANIFEST}) nor a run directory (no "
        f"'{LATEST}'); a save interrupted before its commit leaves no checkpoint behind"
    )


def has_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a complete checkpoint or a run directory whose ``latest`` is one."""
    try:
        resolve(path)
    except (CheckpointError, OSError):
        return False
    return True


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((ckpt_dir / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {ckpt_dir / MANIFEST}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt_dir / MANIFEST} is not a distopt checkpoint manifest")
    if manifest.get("version") not in READABLE:
        raise CheckpointError(
            f"{ckpt_dir} has checkpoint format version {manifest.get('version')}; this distopt "
            f"reads versions {', '.join(map(str, READABLE))}: load it with a newer distopt"
        )
    return manifest


def _complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(sequence, directory) of every complete checkpoint in ``run_dir``, oldest first."""
    found = []
    for child in run_dir.iterdir() if run_dir.is_dir() else ():
        if child.name.startswith(".") or not (child / MANIFEST).is_file():
            continue
        try:
            found.append((int(json.loads((child / MANIFEST).read_text())["sequence"]), child))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours to order or delete
    return sorted(found)


def begin_save(run_dir: Path, name: str | None) -> tuple[Path, Path, int]:
    """Prepare an empty temporary directory; return (final dir, temporary dir, sequence)."""
    if (run_dir / MANIFEST).is_file():
        raise CheckpointError(
            f"{run_dir} is a checkpoint itself; save_checkpoint takes the run directory that "
            f"holds checkpoints (here {run_dir.parent})"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    for child in run_dir.iterdir():
        if child.name.startswith(".") and child.name.endswith((TMP_SUFFIX, OLD_SUFFIX)):
            _remove(child)  # left by an interrupted save or prune
    existing = _complete_checkpoints(run_dir)
    sequence = existing[-1][0] + 1 if existing else 1
    final = run_dir / (name or f"ckpt-{sequence:06d}")
    if final.exists():
        raise CheckpointError(
            f"{final} already exists: save under another name, or delete it first"
        )
    tmp = run_dir / f".{final.name}{TMP_SUFFIX}"
    tmp.mkdir()
    return final, tmp, sequence


def checksum(path: Path) -> dict[str, int]:
    """Size and digest of a file, read a block at a time from its end (see [Note: the files'
    digest] in digest.py)."""
    size, value = digest.file_digest(path)
    return {"bytes": size, digest.KEY: value}


def _digest_matches(path: Path, expected: dict[str, int]) -> bool:
    """Whether the file has the digest its manifest entry lists: the XXH3 of saves since it was
    introduced, the zlib CRC32 (crc.py) of earlier ones."""
    if digest.KEY in expected:
        return digest.file_digest(path)[1] == expected[digest.KEY]
    if "crc32" in expected:
        return file_crc32(path)[1] == expected["crc32"]
    raise CheckpointError(f"the manifest lists no digest for {path}: it was not written by "
                          "distopt's save_checkpoint")


def verify_files(ckpt_dir: Path, files: dict[str, dict[str, int]]) -> None:
    """Raise CheckpointError naming the first file that is missing, truncated or corrupted."""
    for name, expected in files.items():
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"{path} has {size} bytes, the manifest says {expected['bytes']}: the file is "
                "truncated or was replaced; load an earlier checkpoint"
            )
        if not _digest_matches(path, expected):
            raise CheckpointError(
                f"{path} is corrupted (its digest differs from the manifest's): load an "
                "earlier checkpoint"
            )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def commit(tmp: Path, final: Path, manifest: dict[str, Any], keep: int | None,
           latest: bool = True) -> None:
    """Write the manifest, move the checkpoint into place, point ``latest`` at it (unless
    ``latest`` is False: a folder another tool owns), prune.

    Raises OSError if the checkpoint could not be published; a checkpoint that was published
    stays so even if deleting old ones fails (a warning names what is left)."""
    run_dir = final.parent
    _write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1))
    _fsync_dir(tmp)
    os.rename(tmp, final)
    _fsync_dir(run_dir)
    if latest:
        pointer = run_dir / f".{LATEST}{TMP_SUFFIX}"
        _write_durably(pointer, final.name + "\n")
        os.replace(pointer, run_dir / LATEST)
        _fsync_dir(run_dir)
    if keep is not None:
        for _, old in _complete_checkpoints(run_dir)[:-keep]:
            if old != final:
                trash = run_dir / f".{old.name}{OLD_SUFFIX}"
                try:
                    os.rename(old, trash)
                except OSError as exc:
                    warnings.warn(f"cannot delete old checkpoint {old} (keep={keep}): {exc}",
                                  stacklevel=2)
                    continue
                shutil.rmtree(trash, ignore_errors=True)


def latest_name(run_dir: Path) -> str | None:
    """The checkpoint ``run_dir/latest`` names, or None."""
    try:
        return (run_dir / LATEST).read_text().strip() or None
    except OSError:
        return None


def discard(tmp: Path, final: Path) -> list[Path]:
    """Remove what a failed save left (see [Note: failed saves]); return what could not be."""
    run_dir = final.parent
    left = [p for p in (tmp, run_dir / f".{LATEST}{TMP_SUFFIX}") if not _remove(p)]
    if final.is_dir() and latest_name(run_dir) != final.name:
        trash = run_dir / f".{final.name}{OLD_SUFFIX}"
        try:
            os.rename(final, trash)
        except OSError:
            left.append(final)
        else:
            if not _remove(trash):
                left.append(trash)
    return left


def _remove(path: Path) -> bool:
    """Delete a file or a directory tree if it exists; False if some of it remains."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
    return not os.path.lexists(path)
