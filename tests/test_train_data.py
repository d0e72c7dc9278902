"""The embedded training data: corpus loading and splitting, batch samplers."""

from pathlib import Path

import pytest
import torch

from distopt.train.data import (
    _DEFAULT_SKIP_DIRS,
    DOC_SEPARATOR,
    BatchSampler,
    default_data_dir,
    eval_batches,
    load_corpus,
)
from distopt.train.data import _heldout_score as heldout_score
from distopt.train.data import _list_files as list_files


def write_files(root: Path, count: int) -> dict[str, bytes]:
    """`count` small text files in nested folders, each with a unique marker line."""
    files = {}
    for i in range(count):
        rel = f"dir{i % 3}/sub{i % 2}/file{i:03d}.txt"
        content = f"marker-{i:03d}\n".encode() + b"text " * (i % 7 + 1)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
        files[rel] = content
    return files


def split_of(tensor: torch.Tensor) -> list[bytes]:
    return bytes(tensor.tolist()).split(bytes([DOC_SEPARATOR]))


# ---------------------------------------------------------------- corpus


def test_split_is_by_file_disjoint_and_deterministic(tmp_path):
    files = write_files(tmp_path, 60)
    corpus = load_corpus(tmp_path, heldout_fraction=0.2)
    again = load_corpus(tmp_path, heldout_fraction=0.2)
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.heldout, again.heldout)
    assert corpus.train.dtype == torch.uint8 and corpus.source == tmp_path.resolve()

    train_docs, heldout_docs = split_of(corpus.train), split_of(corpus.heldout)
    assert len(train_docs) == corpus.num_files_train
    assert len(heldout_docs) == corpus.num_files_heldout
    # Every file lands whole in exactly one split, each split in sorted path order.
    assert sorted(train_docs + heldout_docs) == sorted(files.values())
    assert not set(train_docs) & set(heldout_docs)
    expected_heldout = [files[rel] for rel in sorted(files) if heldout_score(rel) < 0.2]
    assert heldout_docs == expected_heldout
    assert train_docs == [files[rel] for rel in sorted(files) if heldout_score(rel) >= 0.2]
    assert 0 < corpus.num_files_heldout < 60


def test_split_hash_is_stable():
    # Pinned values: the split must not depend on the process (Python's hash is salted).
    assert heldout_score("a.py") == pytest.approx(0.9408880, abs=1e-6)
    assert heldout_score("dir/b.txt") == pytest.approx(0.4785684, abs=1e-6)


def test_small_folder_still_gets_a_heldout_file(tmp_path):
    write_files(tmp_path, 3)
    corpus = load_corpus(tmp_path)  # 5% of 3 files is usually none: one is held out anyway
    assert corpus.num_files_heldout == 1 and corpus.num_files_train == 2


def test_binary_hidden_and_other_suffix_files_are_skipped(tmp_path):
    files = write_files(tmp_path, 10)
    (tmp_path / "image.bin").write_bytes(bytes(range(256)))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "secret.txt").write_bytes(b"hidden text")
    code = {"code.py": b"print('hi')\n", "sub/more.py": b"x = 1\n"}
    for rel, content in code.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(content)
    corpus = load_corpus(tmp_path, heldout_fraction=0.3)
    docs = split_of(corpus.train) + split_of(corpus.heldout)
    assert sorted(docs) == sorted([*files.values(), *code.values()])

    only_py = load_corpus(tmp_path, suffixes=".py", heldout_fraction=0.3)
    assert sorted(split_of(only_py.train) + split_of(only_py.heldout)) == sorted(code.values())


def test_max_bytes_caps_each_split_with_whole_files(tmp_path):
    files = write_files(tmp_path, 60)
    full = load_corpus(tmp_path, heldout_fraction=0.3)
    cap = 120
    corpus = load_corpus(tmp_path, heldout_fraction=0.3, max_bytes=cap)
    for capped, whole in ((corpus.train, full.train), (corpus.heldout, full.heldout)):
        assert 0 < capped.numel() <= cap
        # A prefix of the uncapped split that ends at a file boundary.
        assert torch.equal(capped, whole[: capped.numel()])
        assert whole[capped.numel()] == DOC_SEPARATOR
        assert set(split_of(capped)) <= set(files.values())


def test_max_bytes_cuts_a_first_file_larger_than_the_cap(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"a" * 1000)
    (tmp_path / "b.txt").write_bytes(b"b" * 1000)
    corpus = load_corpus(tmp_path, max_bytes=100)
    assert corpus.train.numel() == 100 and corpus.heldout.numel() == 100


def test_default_corpus_is_the_stdlib():
    corpus = load_corpus(max_bytes=50_000)
    assert corpus.source == default_data_dir().resolve()
    rel_paths = list_files(corpus.source, _DEFAULT_SKIP_DIRS, (".py",))
    assert "os.py" in rel_paths and len(rel_paths) > 100
    assert not any("site-packages/" in rel or "__pycache__" in rel for rel in rel_paths)
    assert (corpus.source / "os.py").is_file()
    assert 0 < corpus.train.numel() <= 50_000 and 0 < corpus.heldout.numel() <= 50_000
    text = bytes(corpus.train.tolist()).decode("utf-8")
    assert "import " in text and "def " in text


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: p / "missing", r"does not exist; pass an existing folder"),
        (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", r"is a file; pass the folder"),
        (lambda p: p, r"no text files found under .*; pass a folder that holds UTF-8 text"),
        (
            lambda p: (p / "b.bin").write_bytes(b"\x00\xff") and p,
            r"no text files found under",
        ),
        (
            lambda p: (p / "one.txt").write_text("only") and p,
            r"single text file, too small .*add at least one more text file",
        ),
    ],
    ids=["missing", "file", "empty", "binary-only", "one-file"],
)
def test_bad_folders(tmp_path, make, match):
    path = make(tmp_path)
    with pytest.raises(ValueError, match=match) as info:
        load_corpus(path)
    assert "\n" not in str(info.value)


def test_bad_options(tmp_path):
    write_files(tmp_path, 4)
    with pytest.raises(ValueError, match="heldout_fraction must be in"):
        load_corpus(tmp_path, heldout_fraction=0.0)
    with pytest.raises(ValueError, match="max_bytes must be a positive int"):
        load_corpus(tmp_path, max_bytes=0)
    with pytest.raises(ValueError, match=r"no text files ending in \.md"):
        load_corpus(tmp_path, suffixes=[".md"])


# ---------------------------------------------------------------- samplers

DATA = torch.arange(1000, dtype=torch.int64) % 251  # distinct windows, easy to check


def sampler(dp_rank=0, dp_size=1, seed=0, data=DATA, **kw) -> BatchSampler:
    kw = {"seq_len": 16, "global_batch_size": 12, **kw}
    return BatchSampler(data, dp_rank=dp_rank, dp_size=dp_size, seed=seed, **kw)


def test_batches_are_next_byte_windows():
    data = torch.randint(0, 256, (500,), dtype=torch.uint8)
    x, y = sampler(data=data).next_batch()
    assert x.shape == y.shape == (12, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    full = data.long()
    for row_x, row_y in zip(x, y, strict=True):
        windows = full.unfold(0, 17, 1)  # every window of 17 tokens
        match = (windows == torch.cat([row_x, row_y[-1:]])).all(dim=1)
        assert match.any()


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_ranks_union_is_the_single_process_batch(dp_size):
    reference = sampler()
    ranks = [sampler(dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for _ in range(3):
        ref_x, ref_y = reference.next_batch()
        parts = [s.next_batch() for s in ranks]
        assert all(x.shape == (12 // dp_size, 16) for x, _ in parts)
        assert torch.equal(torch.cat([x for x, _ in parts]), ref_x)
        assert torch.equal(torch.cat([y for _, y in parts]), ref_y)


def test_resume_from_state_dict():
    first = sampler(seed=7)
    for _ in range(3):
        first.next_batch()
    state = first.state_dict()
    assert state == {"step": 3, "seed": 7}
    expected = [first.next_batch() for _ in range(3)]

    resumed = sampler(seed=0)  # the loaded seed wins
    resumed.load_state_dict(state)
    for (x, y), (ex, ey) in zip((resumed.next_batch() for _ in range(3)), expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)

    # Resuming at another DP size sees the same global batches.
    halves = [sampler(dp_rank=r, dp_size=2) for r in range(2)]
    for s in halves:
        s.load_state_dict(state)
    assert torch.equal(torch.cat([s.next_batch()[0] for s in halves]), expected[0][0])


def test_batches_differ_across_seeds_and_steps():
    a, b = sampler(seed=0), sampler(seed=1)
    a0, a1 = a.next_batch()[0], a.next_batch()[0]
    assert not torch.equal(a0, b.next_batch()[0])
    assert not torch.equal(a0, a1)
    assert torch.equal(a.batch_at(0)[0], a0) and a.step == 2


def test_sampler_errors():
    with pytest.raises(ValueError, match=r"global_batch_size \(12\) must be divisible by dp_size"):
        sampler(dp_size=5)
    with pytest.raises(ValueError, match=r"fewer than seq_len \+ 1 = 17; use a shorter seq_len"):
        sampler(data=torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, 2\)"):
        sampler(dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        sampler(seq_len=0)
    with pytest.raises(ValueError, match="sampler state lacks"):
        sampler().load_state_dict({"step": 1})


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_eval_batches_split_like_single_process(dp_size):
    kw = {"seq_len": 16, "batch_size": 8, "num_batches": 3}
    reference = eval_batches(DATA, dp_rank=0, dp_size=1, **kw)
    assert len(reference) == 3 and reference[0][0].shape == (8, 16)
    assert torch.equal(reference[0][0][0], DATA[:16])  # spans the data: first window ...
    assert torch.equal(reference[-1][1][-1], DATA[-16:])  # ... to the last
    per_rank = [eval_batches(DATA, dp_rank=r, dp_size=dp_size, **kw) for r in range(dp_size)]
    for b, (ref_x, ref_y) in enumerate(reference):
        assert torch.equal(torch.cat([rank[b][0] for rank in per_rank]), ref_x)
        assert torch.equal(torch.cat([rank[b][1] for rank in per_rank]), ref_y)
    with pytest.raises(ValueError, match=r"batch_size \(8\) must be divisible by dp_size \(3\)"):
        eval_batches(DATA, dp_rank=0, dp_size=3, **kw)
