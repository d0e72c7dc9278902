"""What distopt does to the process's C heap ([Note: the heap at the edge of memory] in
distopt/host_memory.py): glibc's mmap threshold at 1 MiB for sharded runs on the CPU whose
state fills more than half of the host's memory, blocks kept in the heap below that, the
user's own setting kept, and a switch to turn it off or to set it whatever the memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distopt import host_memory

TIGHT = host_memory.TIGHT_SETTINGS
MMAP = host_memory.M_MMAP_THRESHOLD


@pytest.fixture
def glibc_defaults(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (*host_memory.GLIBC_VARIABLES, host_memory.THRESHOLD_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_threshold_is_one_mebibyte_where_memory_is_unknown(glibc_defaults) -> None:
    assert host_memory.heap_settings()[MMAP] == 1 << 20
    glibc_defaults.setattr(host_memory, "available_host_bytes", lambda: None)
    assert host_memory.heap_settings(1) == TIGHT


def test_threshold_only_where_memory_is_tight(glibc_defaults) -> None:
    """1 MiB where the host's ranks will hold more than half of the memory available; below
    that, blocks kept in the heap (glibc's largest mmap threshold, a 64 MiB trim threshold):
    no page fault per gather where the holes would fit twice over."""
    glibc_defaults.setattr(host_memory, "available_host_bytes", lambda: 10 << 30)
    assert host_memory.heap_settings((5 << 30) + 1) == TIGHT
    assert host_memory.heap_settings(5 << 30) == {
        MMAP: 32 << 20, host_memory.M_TRIM_THRESHOLD: 64 << 20}
    assert host_memory.heap_settings((5 << 30) + 1, sharded=False) == {}  # tight, replicated
    glibc_defaults.setenv(host_memory.THRESHOLD_VARIABLE, "1048576")  # whatever the memory
    assert host_memory.heap_settings(1) == {MMAP: 1 << 20}


@pytest.mark.parametrize("value", ["off", "OFF", "0", "none"])
def test_threshold_turned_off(glibc_defaults, value: str) -> None:
    glibc_defaults.setenv(host_memory.THRESHOLD_VARIABLE, value)
    assert host_memory.heap_settings() == {}


@pytest.mark.parametrize("variable", host_memory.GLIBC_VARIABLES)
def test_threshold_chosen_and_user_setting_kept(glibc_defaults, variable: str) -> None:
    glibc_defaults.setenv(host_memory.THRESHOLD_VARIABLE, "4194304")
    assert host_memory.heap_settings() == {MMAP: 4 << 20}
    glibc_defaults.setenv(variable, "65536")  # glibc's own: distopt keeps out
    assert host_memory.heap_settings() == {}


@pytest.mark.parametrize("value", ["-5", "lots"])
def test_bad_threshold_named(glibc_defaults, value: str) -> None:
    glibc_defaults.setenv(host_memory.THRESHOLD_VARIABLE, value)
    with pytest.raises(ValueError, match="DISTOPT_MMAP_THRESHOLD=.*'off'"):
        host_memory.heap_settings()


def test_host_state_is_the_design_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/design.md's bytes per param, sharded as the DDP shards them, times the host's
    ranks: fp32 everything sharded is 16/d a rank; bf16 params with fp32 grads replicated
    hold their 2 bytes whole and 4 + 4 + 8 sharded."""
    n = 1_000_000
    state = host_memory.host_state_bytes
    assert state(n, 4, 4, 4, shard_grads=True, shard_params=True, ranks_on_host=4) == 16 * n
    assert state(n, 2, 4, 2, shard_grads=True, shard_params=False, ranks_on_host=2) == (
        2 * (2 * n + 16 * n // 2))
    assert state(n, 4, 4, 2, shard_grads=False, shard_params=False, ranks_on_host=1) == (
        8 * n + 8 * n // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert state(n, 4, 4, 8, shard_grads=True, shard_params=True) == 3 * 16 * n // 8


WRAPS = """
import torch.distributed as dist
from torch import nn
import distopt
from distopt import host_memory
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
host_memory.available_host_bytes = lambda: 1 << 20  # a host this small model fills
distopt.DistributedDataParallel(nn.Linear(512, 512))  # replicated, tight
print(sorted(host_memory._applied[-1].items()) if host_memory._applied else None)
host_memory.available_host_bytes = lambda: 1 << 40
distopt.DistributedDataParallel(nn.Linear(512, 512))  # replicated, roomy
print(sorted(host_memory._applied[-1].items()))
host_memory.available_host_bytes = lambda: 1 << 20
distopt.DistributedDataParallel(nn.Linear(512, 512), shard_grads=True)  # sharded, tight
print(sorted(host_memory._applied[-1].items()))
"""


def test_heap_tuned_by_what_the_wrapper_holds(tmp_path) -> None:
    """On the CPU, a DDP on a roomy host keeps blocks in the heap; one whose grads or params
    are sharded maps them on their own once its state fills the host, and a replicated one
    then leaves glibc alone. In its own process (a fresh interpreter, so that this one's heap
    is untouched)."""
    script = WRAPS.format(store=tmp_path / "store")
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout.splitlines()
    trim, mmap = host_memory.M_TRIM_THRESHOLD, host_memory.M_MMAP_THRESHOLD
    assert out == ["None", str([(mmap, 32 << 20), (trim, 64 << 20)]),
                   str([(mmap, 1 << 20), (trim, 128 << 10)])]
