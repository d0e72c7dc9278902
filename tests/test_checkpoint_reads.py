"""How ``save_checkpoint`` writes and ``load_checkpoint`` reads the bytes: one digest per byte
written ([Note: one digest per byte] in checkpoint/writing.py; [Note: the files' digest] in
checkpoint/digest.py), and each saved tensor read
straight into the tensor the load fills where the load wants it whole, DCP's own reading
otherwise ([Note: direct reads] in checkpoint/reading.py), with the same values either way.
A damaged file is still refused before anything is read: test_checkpoint.py's ``bad-*`` cases.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from test_checkpoint_torch_layout import ends, train
from torch import nn
from torch_resume import LR, SAVED_AT

import distopt
from distopt.checkpoint import files
from distopt.checkpoint.reading import DirectReader

from dist_harness import case_result, run_cases


def model() -> nn.Module:
    """torch_resume's inputs and targets, through params large enough that d = 2 and d = 3
    cut them at different elements."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 96), nn.Tanh(), nn.Linear(96, 3))


def build():
    ddp = distopt.DistributedDataParallel(model(), shard_params=True)
    return ddp, distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=LR)


def counted_load(ckpt: Path, ddp, opt) -> dict[str, int]:
    """``load_checkpoint``, counting the tensors read and those read straight into place."""
    counts = {"items": 0, "direct": 0}
    real = DirectReader.read_data

    def read_data(reader, plan, planner):
        out = real(reader, plan, planner)
        counts["items"] += sum(item.type.name == "TENSOR" for item in plan.items)
        counts["direct"] += reader.direct_reads
        return out

    with mock.patch.object(DirectReader, "read_data", read_data):
        distopt.load_checkpoint(ckpt, ddp, opt)
    return counts


def largest_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def save_then_load(root: str) -> dict:
    """Save after two steps, step once more (so that every value moves), load the checkpoint
    back; count the reads. Rank 0 keeps the saved values for the load at d = 3."""
    ddp, opt = build()
    train(ddp, opt, range(SAVED_AT))
    ckpt = distopt.save_checkpoint(Path(root) / "run", ddp, opt)
    saved = ends(ddp, opt)
    if dist.get_rank() == 0:
        torch.save(saved, Path(root) / "saved.pt")
    train(ddp, opt, range(SAVED_AT, SAVED_AT + 1))
    moved = largest_diff({k: v for k, v in saved.items() if not k.startswith("step/")},
                         {k: v for k, v in ends(ddp, opt).items() if not k.startswith("step/")})
    counts = counted_load(ckpt, ddp, opt)
    return {"ckpt": str(ckpt), "moved": moved, "diff": largest_diff(saved, ends(ddp, opt)),
            **counts}


def load_elsewhere(root: str) -> dict:
    """The checkpoint saved at d = 2 loaded here, into a fresh run."""
    ddp, opt = build()
    counts = counted_load(Path(root) / "run", ddp, opt)
    saved = torch.load(Path(root) / "saved.pt")
    return {"diff": largest_diff(saved, ends(ddp, opt)), **counts}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("reads"))


def load_other_byte_order(root: str) -> dict:
    """The checkpoint loaded as if this machine's byte order were the other one: no tensor
    read straight into place (DCP's reading swaps what needs it; here nothing does)."""
    from distopt.checkpoint import reading

    ddp, opt = build()
    with mock.patch.object(reading, "_NATIVE", b"big" if reading._NATIVE == b"little"
                           else b"little"):
        counts = counted_load(Path(root) / "run", ddp, opt)
    saved = torch.load(Path(root) / "saved.pt")
    return {"diff": largest_diff(saved, ends(ddp, opt)), **counts}


@pytest.fixture(scope="module")
def loaded(root):
    return case_result(run_cases(2, [("load", save_then_load, (root,))]), "load")


def test_a_file_of_another_byte_order_is_read_through_dcp(loaded, root):
    for value in case_result(run_cases(2, [("byte-order", load_other_byte_order, (root,))]),
                             "byte-order"):
        assert value["diff"] == 0.0 and value["items"] > 0 and value["direct"] == 0, value


def test_a_load_at_the_saved_layout_reads_every_tensor_straight_into_place(loaded):
    for value in loaded:
        assert value["moved"] > 1e-4, value  # the step after the save changed every value
        assert value["diff"] == 0.0, value  # the saved bits, every one
        assert value["items"] > 0 and value["direct"] == value["items"], value


@pytest.mark.slow
def test_a_load_of_parts_of_saved_tensors_reads_them_through_dcp(loaded, root):
    """At d = 3 a rank wants parts of the boxes saved at d = 2: those go through DCP's own
    reading, the whole ones still straight into place, and every value is the saved one."""
    for value in case_result(run_cases(3, [("elsewhere", load_elsewhere, (root,))]),
                             "elsewhere"):
        assert value["diff"] == 0.0, value
        assert value["direct"] < value["items"], value
    assert sum(v["direct"] for v in loaded) > 0


def test_the_records_carry_no_second_crc_and_torch_reads_them(loaded):
    """Each saved tensor is torch.save's zip, its records' CRC32 fields left 0 (the file's
    digest in the manifest is the one taken), read by torch.load as saved."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt = Path(loaded[0]["ckpt"])
    manifest = files.read_manifest(ckpt)
    metadata = FileSystemReader(ckpt).read_metadata()
    tensors = 0
    for name, listed in manifest["files"].items():
        assert files.checksum(ckpt / name) == listed, name
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata):
            continue  # a pickled object
        blob = (ckpt / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        records = zipfile.ZipFile(io.BytesIO(blob)).infolist()
        assert records and all(r.CRC == 0 for r in records), index
        value = torch.load(io.BytesIO(blob), weights_only=True)
        assert isinstance(value, torch.Tensor) and value.isfinite().all(), index
        tensors += 1
    assert tensors > 0


def test_a_file_s_crc32_read_from_its_end_is_zlib_s(tmp_path, monkeypatch):
    """[Note: checking a file from its end] in checkpoint/crc.py: blocks' CRC32s folded into
    the file's equal zlib.crc32 of the whole, for every size around the block's."""
    import random
    import zlib

    from distopt.checkpoint import crc

    rng = random.Random(0)
    for _ in range(100):
        a, b = rng.randbytes(rng.randrange(300)), rng.randbytes(rng.randrange(300))
        assert crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    monkeypatch.setattr(crc, "BLOCK", 64)
    for size in (0, 1, 63, 64, 65, 128, 1000):
        data = rng.randbytes(size)
        (tmp_path / "f").write_bytes(data)
        assert crc.file_crc32(tmp_path / "f") == (size, zlib.crc32(data)), size


def test_a_file_s_digest_read_from_its_end_is_the_one_taken_as_it_was_written(
        tmp_path, monkeypatch):
    """[Note: the files' digest] in checkpoint/digest.py: the digest a save takes from writes of
    any size equals the one a load takes reading the file's blocks backwards, for every size
    around the block's; a flipped byte, two blocks swapped, or bytes added change it."""
    import random

    from distopt.checkpoint import digest

    monkeypatch.setattr(digest, "BLOCK", 64)
    rng = random.Random(0)
    path = tmp_path / "f"

    def streamed(data: bytes) -> int:
        stream, at = digest.StreamDigest(), 0
        while at < len(data):
            size = rng.choice((1, 7, 63, 64, 65, 200))
            stream.update(memoryview(data)[at:at + size])
            at += size
        assert stream.nbytes == len(data)
        return stream.intdigest()

    for size in (0, 1, 63, 64, 65, 128, 129, 1000):
        data = rng.randbytes(size)
        path.write_bytes(data)
        value = streamed(data)
        assert digest.file_digest(path) == (size, value), size
        assert files.checksum(path) == {"bytes": size, digest.KEY: value}
    data = rng.randbytes(256)
    value = streamed(data)
    flipped = bytearray(data)
    flipped[200] ^= 1
    changed = [bytes(flipped), data[64:128] + data[:64] + data[128:], data + bytes(1),
               data[:-1]]
    assert all(streamed(other) != value for other in changed)


@pytest.mark.parametrize("key", ["xxh3", "crc32"])
def test_a_manifest_s_digest_or_an_earlier_release_s_crc32_refuses_a_flipped_byte(
        tmp_path, key):
    """A manifest entry lists the digest (this release's saves) or the zlib CRC32 (earlier
    releases', tests/data/v1-checkpoint); either refuses a file with one byte changed."""
    import zlib

    data = bytes(range(256)) * 40
    (tmp_path / "f").write_bytes(data)
    entry = (files.checksum(tmp_path / "f") if key == "xxh3"
             else {"bytes": len(data), "crc32": zlib.crc32(data)})
    assert key in entry
    files.verify_files(tmp_path, {"f": entry})
    damaged = bytearray(data)
    damaged[5000] ^= 0x10
    (tmp_path / "f").write_bytes(bytes(damaged))
    with pytest.raises(files.CheckpointError, match="corrupted"):
        files.verify_files(tmp_path, {"f": entry})
    with pytest.raises(files.CheckpointError, match="lists no digest"):
        files.verify_files(tmp_path, {"f": {"bytes": len(data)}})
