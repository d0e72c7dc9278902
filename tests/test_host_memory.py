"""What distopt does to the process's C heap ([Note: the heap at the edge of memory] in
distopt/host_memory.py): glibc's mmap threshold at 1 MiB for sharded runs on the CPU, the
user's own setting kept, and a switch to turn it off."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distopt import host_memory


def test_threshold_is_one_mebibyte_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv(host_memory.THRESHOLD_VARIABLE, raising=False)
    assert host_memory.edge_of_memory_threshold() == 1 << 20


@pytest.mark.parametrize("value", ["off", "OFF", "0", "none"])
def test_threshold_turned_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv(host_memory.THRESHOLD_VARIABLE, value)
    assert host_memory.edge_of_memory_threshold() is None


def test_threshold_chosen_and_user_setting_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv(host_memory.THRESHOLD_VARIABLE, "4194304")
    assert host_memory.edge_of_memory_threshold() == 4 << 20
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # glibc's own: distopt keeps out
    assert host_memory.edge_of_memory_threshold() is None


@pytest.mark.parametrize("value", ["-5", "lots"])
def test_bad_threshold_named(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv(host_memory.THRESHOLD_VARIABLE, value)
    with pytest.raises(ValueError, match="DISTOPT_MMAP_THRESHOLD=.*'off'"):
        host_memory.edge_of_memory_threshold()


WRAPS = """
import torch.distributed as dist
from torch import nn
import distopt
from distopt import host_memory
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
distopt.DistributedDataParallel(nn.Linear(4, 4))
print(list(host_memory._applied))
distopt.DistributedDataParallel(nn.Linear(4, 4), shard_grads=True)
print(list(host_memory._applied))
"""


def test_only_a_sharded_wrapper_sets_threshold(tmp_path) -> None:
    """A replicated DDP leaves glibc alone; a sharded one on the CPU sets the threshold, in
    its own process (a fresh interpreter, so that this one's heap is untouched)."""
    script = WRAPS.format(store=tmp_path / "store")
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout.split()
    assert out == ["[]", f"[{1 << 20}]"]
