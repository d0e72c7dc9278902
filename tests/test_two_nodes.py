"""Two launchers as two nodes: torchrun twice on this machine, --nnodes 2 --nproc-per-node 2.

Each launcher's two ranks are one shard group of a ("dp_replicate", "dp_shard") = (2, 2) mesh
(tests/two_node_worker.py trains the parity model on it). Every reduce-scatter and all-gather,
down to each point-to-point message gloo sends for them, stays inside its launcher; only the
replicate all-reduce crosses. The result equals, bit for bit, one group of four ranks on one
machine on the same mesh (the test harness's pool of four), and single-process torch.optim
within FP32_TOL.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dist_harness import case_result, run_cases
from early_launches import Command, launch_early
from helpers import FP32_TOL, fp32_master_step, lm_loss, parity_groups
from models import AwkwardLM, batches
from two_node_worker import STEPS, params_in_one_group

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "two_node_worker.py"
LAUNCHERS = ("0", "1")


def _torchrun(out: Path, launcher: str, endpoint: str) -> Command:
    """One launcher of two ranks; both launchers join a c10d rendezvous at a store this test
    process holds. Which launcher's ranks come first is the rendezvous's choice (the tests read
    it from GROUP_RANK)."""
    env = {
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}",
        "DISTOPT_TEST_LAUNCHER": launcher,
    }
    return Command.module(
        "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend",
        "c10d", "--rdzv-id", "distopt-two-nodes", "--rdzv-conf", "is_host=false",
        "--rdzv-endpoint", endpoint, str(WORKER), str(out), env=env)


TESTS = ("test_each_launcher_is_one_shard_group",
         "test_no_reduce_scatter_or_all_gather_crosses_launchers",
         "test_two_launchers_equal_one_launcher_and_torch")
# Started with the session (see early_launches.py); the runs write rank{r}.pt to WORKDIR.
LAUNCHERS_RUN = launch_early(
    TESTS, lambda workdir, endpoint: [_torchrun(workdir, launcher, endpoint)
                                      for launcher in LAUNCHERS],
    rendezvous=True)


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    # The same training in one group of four ranks on one machine: the harness's pool.
    one = case_result(run_cases(4, [("one", params_in_one_group, ())]), "one")
    for proc in LAUNCHERS_RUN.result():
        assert proc.returncode == 0, proc.stderr[-3000:]
    two = LAUNCHERS_RUN.workdir
    return {"two": [torch.load(two / f"rank{r}.pt") for r in range(4)],
            "one": [{"params": params} for params in one]}


def _reference() -> dict[str, torch.Tensor]:
    """Single-process torch.optim on the whole global batch, as test_hierarchical.parity."""
    torch.manual_seed(0)
    model = AwkwardLM()
    trainable = [p for p in model.parameters() if p.requires_grad]
    masters = [torch.nn.Parameter(p.detach().clone()) for p in trainable]
    index = {p: i for i, p in enumerate(trainable)}
    groups = [
        {**g, "params": [masters[index[p]] for p in g["params"]]}
        for g in parity_groups(model, "adamw")
    ]
    opt = torch.optim.AdamW(groups, lr=1e-2)
    for step in range(STEPS):
        tokens, targets = batches(step)
        fp32_master_step(trainable, masters, opt, lm_loss(model, tokens, targets, step))
    return {name: p.detach() for name, p in model.named_parameters()}


def test_each_launcher_is_one_shard_group(runs):
    for v in runs["two"]:
        # torchrun numbers ranks launcher by launcher: each launcher's GROUP_RANK g holds ranks
        # 2g and 2g + 1, whichever launcher the rendezvous numbered first.
        mates = [w["rank"] for w in runs["two"] if w["launcher"] == v["launcher"]]
        assert mates == [2 * int(v["group_rank"]), 2 * int(v["group_rank"]) + 1]
        assert v["shard_ranks"] == mates


def test_no_reduce_scatter_or_all_gather_crosses_launchers(runs):
    launcher_of = {v["rank"]: v["launcher"] for v in runs["two"]}
    for v in runs["two"]:
        crossing = {"reduce_scatter_avg": 0, "all_gather": 0, "replicate_all_reduce": 0}
        for op, ranks in v["groups"]:
            crossing[op] += len({launcher_of[r] for r in ranks}) > 1
        counted = {op: sum(1 for o, _ in v["groups"] if o == op) for op in crossing}
        n = v["buckets"]
        assert counted == {
            "reduce_scatter_avg": n * STEPS,
            "all_gather": n * STEPS,
            "replicate_all_reduce": n * STEPS,
        }
        assert crossing == {
            "reduce_scatter_avg": 0,
            "all_gather": 0,
            "replicate_all_reduce": n * STEPS,
        }
        # Down to gloo's messages: one sent to and one received from the other rank of the
        # launcher per bucket, in each reduce-scatter and each all-gather.
        assert len(v["messages"]) == 4 * n * STEPS
        assert {launcher_of[peer] for _, _, peer in v["messages"]} == {v["launcher"]}
        assert {peer for _, _, peer in v["messages"]} == set(v["shard_ranks"]) - {v["rank"]}
        # Each step: one reduce-scatter, replicate all-reduce and all-gather per bucket.
        for calls in v["calls"]:
            assert calls["reduce_scatter"] == calls["all_gather"] == n
            assert calls["replicate_all_reduce"] == n


def test_two_launchers_equal_one_launcher_and_torch(runs):
    reference = _reference()
    for two, one in zip(runs["two"], runs["one"], strict=True):
        assert two["params"].keys() == one["params"].keys() == reference.keys()
        for name, value in two["params"].items():
            assert torch.equal(value, one["params"][name]), name
            assert (value - reference[name]).abs().max().item() < FP32_TOL, name
        torch.manual_seed(0)
        initial = dict(AwkwardLM().named_parameters())
        moved = max((value - initial[k]).abs().max().item() for k, value in two["params"].items())
        assert moved > 0.01
