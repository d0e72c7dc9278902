"""`distopt train` end to end: a real launch, resume, a killed rank restarted by the launcher, a
stopped rank that fails its peers within --timeout, failed saves, a lost node of two launchers
under an elastic launch resumed at fewer ranks, and one-line errors for bad options. Runs whose
tests are about the ranks' code, not the launcher, are cases of the test pool."""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

import distopt
from distopt import cli
from distopt.train import elastic
from distopt.train.config import default_shard_size

from dist_harness import case_result, run_cases
from early_launches import Command, launch_early
from helpers import LOSS_RTOL, SMALL_TRAIN, train_in_pool, train_in_pool_streams


def _train(out: Path, *extra: str, env: dict[str, str] | None = None) -> Command:
    """``distopt train`` on two ranks, the small run, writing to ``out``."""
    return Command.module("distopt", "train", "--nproc", "2", *SMALL_TRAIN, "--out", str(out),
                          *extra, env=env)


def _final_heldout(out: Path) -> float:
    return json.loads((out / "summary.json").read_text())["heldout_loss_end"]


# The launches of this module's tests start with the session (see early_launches.py); each
# writes its run to WORKDIR/out.
CRASHED = launch_early(
    "test_resume_after_a_crash_matches_the_uninterrupted_run",
    lambda workdir: [_train(workdir / "out", env={"DISTOPT_TRAIN_FAIL_AT_STEP": "6",
                                                  "DISTOPT_TRAIN_FAIL_RANK": "1"})])
RESTARTED = launch_early(
    "test_launcher_restarts_a_killed_rank_and_the_run_finishes_identically",
    lambda workdir: [_train(workdir / "out", "--max-restarts", "1",
                            env={"DISTOPT_TRAIN_FAIL_AT_STEP": "6",
                                 "DISTOPT_TRAIN_FAIL_RANK": "0"})])
BAD_OPTION = launch_early(
    "test_bad_option_exits_2_with_one_line_from_the_shell",
    lambda workdir: [Command.module("distopt", "train", "--nproc", "0")])

STOPPED_TIMEOUT = 15  # seconds; long enough for ranks starved on a loaded machine
# Rank 1 stops (SIGSTOP) at step 6 of a run that may restart once. Most of this run is waiting:
# --timeout seconds for rank 0 to give up, then the launcher's grace period (30 s) for the
# stopped rank to exit before it kills it and restarts the group; so it starts at once.
STOPPED = launch_early(
    "test_a_stopped_rank_fails_its_peers_within_the_timeout_and_the_group_restarts",
    lambda workdir: [_train(workdir / "out", "--timeout", str(STOPPED_TIMEOUT),
                            "--max-restarts", "1",
                            env={"DISTOPT_TRAIN_FAIL_AT_STEP": "6",
                                 "DISTOPT_TRAIN_FAIL_RANK": "1",
                                 "DISTOPT_TRAIN_FAIL_SIGNAL": "SIGSTOP"})],
    alongside=True)


POOL_RUNS = {
    "baseline": (),
    "shard-size-1": ("--shard-size", "1"),
    "bf16": ("--dtype", "bf16", "--grad-dtype", "bf16", "--steps", "4",
             "--reduce-scatter-fp32-accumulation", "--store-param-remainders"),
    "shard-grads": ("--shard-grads",),
    "shard-params": ("--shard-params",),
}


@dataclass
class Run:
    out: Path
    stdout: str  # rank 0's


@pytest.fixture(scope="module")
def pool_runs(tmp_path_factory) -> dict[str, Run]:
    outs = {name: tmp_path_factory.mktemp(name) for name in POOL_RUNS}
    printed = run_cases(2, [(name, train_in_pool,
                             (*SMALL_TRAIN, "--out", str(outs[name]), *extra))
                            for name, extra in POOL_RUNS.items()])
    return {name: Run(outs[name], case_result(printed, name)[0]) for name in POOL_RUNS}


@pytest.fixture(scope="module")
def baseline(pool_runs) -> Path:
    return pool_runs["baseline"].out


@pytest.mark.slow
def test_run_writes_metrics_summary_plot_and_checkpoints(baseline):
    records = [json.loads(line) for line in (baseline / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 9))
    evals = [r["heldout_loss"] for r in records if "heldout_loss" in r]
    assert len(evals) == 3  # before training, step 4, step 8
    assert evals[-1] < evals[0]  # it learns
    summary = json.loads((baseline / "summary.json").read_text())
    assert summary["world_size"] == 2
    theory = summary["theory_bytes_per_param"]
    assert theory["distopt"] == pytest.approx(12.0) and theory["replicated"] == pytest.approx(16)
    for report in summary["memory_per_rank"]:
        # Measured bytes: the distopt figure plus the padding of the buckets, far below 16.
        assert theory["distopt"] <= report["bytes_per_param"] < theory["distopt"] + 0.5
    assert (baseline / "loss.png").stat().st_size > 10_000
    assert distopt.has_checkpoint(baseline / "checkpoints")


@pytest.mark.slow
def test_resume_after_a_crash_matches_the_uninterrupted_run(baseline):
    """A launched run whose rank 1 is killed at step 6 exits with an error; ``--resume`` (the
    same ranks' code, run in the pool: no launcher is needed to read a checkpoint) ends where
    the uninterrupted run ends."""
    (crashed,) = CRASHED.result()
    assert crashed.returncode != 0
    assert "distopt train: error" in crashed.stderr
    out = CRASHED.workdir / "out"
    resumed = run_cases(2, [("resumed", train_in_pool,
                             (*SMALL_TRAIN, "--out", str(out), "--resume"))])
    case_result(resumed, "resumed")
    assert _final_heldout(out) == _final_heldout(baseline)


@pytest.mark.slow
def test_launcher_restarts_a_killed_rank_and_the_run_finishes_identically(baseline):
    (proc,) = RESTARTED.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _final_heldout(RESTARTED.workdir / "out") == _final_heldout(baseline)


@pytest.mark.slow
def test_a_failed_save_is_reported_and_training_goes_on(tmp_path):
    """The step-8 save cannot create its directory (a stale one of that name is in the way):
    the run reports it, trains to the end, and keeps the step-4 checkpoint as the latest; with
    --stop-on-save-failure every rank stops there with the error. (Both runs are cases of the
    pool: what they test is how the ranks handle a save that fails, not the launcher.)"""
    (tmp_path / "checkpoints" / "ckpt-000002").mkdir(parents=True)
    args = (*SMALL_TRAIN, "--steps", "10", "--out", str(tmp_path))
    goes_on = run_cases(2, [("goes-on", train_in_pool_streams, args)])
    _, stderr = case_result(goes_on, "goes-on")[0]
    assert "distopt train: warning: step 8: cannot save a checkpoint" in stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "checkpoint_error" in r] == [8, 10]
    assert max(r["step"] for r in records) == 10
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "ckpt-000001"
    assert distopt.has_checkpoint(tmp_path / "checkpoints")

    stops = run_cases(2, [("stops", train_in_pool, (*args, "--resume",
                                                    "--stop-on-save-failure"))])
    outcomes = [rank["stops"] for rank in stops]
    assert all(status == "error" and "cannot save a checkpoint" in message
               for status, message in outcomes), outcomes
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "ckpt-000001"


def uninterrupted(out: str) -> float | None:
    """A four-rank distopt train run in the d = 4 pool, on the (2, 2) mesh two nodes make: the
    held-out loss it ends with (rank 0)."""
    from distopt.train.config import parse_args
    from distopt.train.worker import Trainer

    summary = Trainer(parse_args([*SMALL_TRAIN, "--out", out, "--shard-size", "2"])).run()
    return summary.get("heldout_loss_end")


def _elastic_launcher(out: Path, endpoint: str, env: dict[str, str]) -> Command:
    """torchrun --nnodes 1:2 of two ranks, one node of an elastic run. The rendezvous waits 5 s
    for the other node once one is there, and forgets a node silent for 2 s."""
    conf = "is_host=false,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2"
    return Command.module(
        "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend",
        "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "distopt-elastic", "--rdzv-conf", conf,
        "--max-restarts", "1", "-m", "distopt.train", *SMALL_TRAIN, "--save-every", "2",
        "--async-save", "--timeout", "120", "--out", str(out), env=env)


# Both launchers join a rendezvous store that this process holds, so it outlives the launcher
# that is killed. At step 6 the second launcher and both its ranks are SIGKILLed.
LOST_NODE = launch_early(
    "test_a_lost_node_costs_only_the_steps_since_the_last_save",
    lambda workdir, endpoint: [
        _elastic_launcher(workdir / "out", endpoint, {}),
        _elastic_launcher(workdir / "out", endpoint, {"DISTOPT_TRAIN_FAIL_AT_STEP": "6",
                                                      "DISTOPT_TRAIN_FAIL_RANK": "0",
                                                      "DISTOPT_TRAIN_FAIL_SCOPE": "launcher"})],
    rendezvous=True)


@pytest.mark.slow
def test_a_lost_node_costs_only_the_steps_since_the_last_save(tmp_path):
    """Two launchers of two ranks as two nodes under --nnodes 1:2, saving asynchronously every
    2 steps. At step 6, just after the save of step 6 has started, the second node is lost (its
    launcher and both its ranks SIGKILLed) during that save's background write; the first
    node's ranks fail, its launcher restarts them, they rendezvous alone and resume
    at two ranks from the latest checkpoint, with the same global batch, and finish: the
    held-out loss ends within LOSS_RTOL of an uninterrupted four-rank run (in the pool's four
    ranks)."""
    reference = case_result(
        run_cases(4, [("four", uninterrupted, (str(tmp_path / "four"),))]), "four")[0]
    survivor, lost = LOST_NODE.result()
    out = LOST_NODE.workdir / "out"
    assert lost.returncode == -signal.SIGKILL, lost.stderr[-3000:]
    assert survivor.returncode == 0, survivor.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # The first attempt's four ranks on two launchers: by default each node's ranks are one
    # shard group and the state has a replica per node, the replicate all-reduce crossing the
    # launchers (test_two_nodes.py shows such a run equal, bit for bit, to one group of four
    # on the same mesh). The resumed attempt, on one node, shards over both its ranks.
    assert records[0]["world_size"] == 4 and records[0]["dp_replicas"] == 2, records[0]
    resumed = [r for r in records if r.get("resumed")]
    assert len(resumed) == 1 and resumed[0]["world_size"] == 2, records
    assert resumed[0]["dp_replicas"] == 1
    # A save waits for the one before it, so the save at step 4 was published before the one
    # at step 6 began; that one was in flight when the node was lost, and was never published.
    assert resumed[0]["step"] == 4
    # The first attempt ran on four ranks, two nodes: steps up to the loss were logged by it.
    assert max(r["step"] for r in records[: records.index(resumed[0])]) == 6
    stalls = [r for r in records if "checkpoint_stall_s" in r]
    assert stalls and all(r["checkpoint_stall_s"] < 30 for r in stalls)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    # The same global batches summed over other ranks: AdamW's drift (helpers.LOSS_RTOL).
    assert summary["heldout_loss_end"] == pytest.approx(reference, rel=LOSS_RTOL), summary


def test_a_restart_is_told_from_a_first_start_by_the_run_id(tmp_path, monkeypatch):
    """torchrun restarts the ranks when a node joins without counting it a retry: the run id
    written by the first start tells a restart. Rank 0 decides (the broadcast is stubbed)."""
    monkeypatch.setattr(elastic.dist, "broadcast_object_list", lambda box, src: None)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not elastic.is_restart(tmp_path, 0)  # no launcher: never a restart by itself
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id
    assert not elastic.is_restart(tmp_path, 0)
    assert not elastic.is_restart(tmp_path, 0)  # names no run: two starts are two runs
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    assert not elastic.is_restart(tmp_path, 0)  # job-a's first start
    assert elastic.is_restart(tmp_path, 0)  # job-a again: a node joined
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    assert not elastic.is_restart(tmp_path, 0)  # another job in the same folder
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert elastic.is_restart(tmp_path, 0)  # a counted restart


@pytest.fixture(scope="module")
def shard_size_one(pool_runs) -> Run:
    """Two ranks that each shard alone and replicate each other."""
    return pool_runs["shard-size-1"]


@pytest.mark.slow
def test_shard_size_shards_within_groups_and_replicates_across(baseline, shard_size_one):
    """Two ranks each shard alone and replicate each other: memory is the table at d = 1, and
    the run learns what the flat run learns (the same average, summed in another order)."""
    proc = shard_size_one
    summary = json.loads((proc.out / "summary.json").read_text())
    flat = json.loads((baseline / "summary.json").read_text())
    assert summary["theory_bytes_per_param"]["distopt"] == 16.0
    for report in summary["memory_per_rank"]:
        assert report["optimizer_state"] == 8 * report["num_params"]
    assert "sharded over 1 ranks, 2 replicas" in proc.stdout
    assert summary["heldout_loss_end"] == pytest.approx(flat["heldout_loss_end"], rel=LOSS_RTOL)


@pytest.mark.parametrize(
    "node_of_rank,shard",
    [([0, 0, 1, 1], 2),  # torchrun --nnodes 2 --nproc-per-node 2
     (["a"] * 8 + ["b"] * 8 + ["c"] * 8, 8),
     ([0, 1, 2, 3], 1),  # one rank per node: every rank its own shard, all-reduce across
     ([0, 0, 0, 0], None),  # one node: flat
     ([0], None),
     ([0, 0, 0, 1], None),  # nodes of unequal sizes: no shard size fits them
     ([0, 1, 0, 1], None)],  # a node's ranks not consecutive: a shard group would span nodes
)
def test_default_shard_size_is_one_node_on_several(node_of_rank, shard):
    assert default_shard_size(node_of_rank) == shard


@pytest.mark.slow
def test_bf16_run_with_fp32_accumulated_reduce_scatter_and_remainders(pool_runs):
    summary = json.loads((pool_runs["bf16"].out / "summary.json").read_text())
    assert summary["config"]["reduce_scatter_fp32_accumulation"] is True
    assert 0 < summary["heldout_loss_end"] < summary["heldout_loss_start"]
    # bf16 params and grads with remainders at d = 2: 4 + 10/2, against 20 replicated.
    assert summary["theory_bytes_per_param"] == {"distopt": 9.0, "replicated": 20.0}
    for report in summary["memory_per_rank"]:
        # 2 bytes of remainder and 8 of AdamW state per element this rank owns; the fp32
        # copies of the bf16 grads exist only during the step.
        assert 4 * report["main_params"] == report["optimizer_state"] > 0
        assert report["main_grads"] == 0


@pytest.mark.parametrize(
    "args,message",
    [(["--nproc", "0"], "--nproc must be >= 1"),
     (["--dtype", "fp8"], "--dtype must be one of fp32, bf16, fp16"),
     (["--data", "/nonexistent/distopt"], "does not exist"),
     (["--data", "EMPTY"], "no text files"),
     (["--batch-size", "7"], "multiple of ranks"),
     (["--optimizer", "lbfgs"], "--optimizer must be one of"),
     (["--shard-size", "3"], "--shard-size 3 does not divide the 2 ranks"),
     (["--timeout", "0"], "--timeout must be a positive number of seconds"),
     (["--store-param-remainders"], "--store-param-remainders needs --dtype bf16"),
     (["--reduce-scatter-fp32-accumulation"],
      "--reduce-scatter-fp32-accumulation needs --grad-dtype bf16 or fp16, got fp32"),
     (["--reduce-scatter-fp32-accumulation", "--grad-dtype", "bf16", "--no-shard"],
      "--reduce-scatter-fp32-accumulation needs the sharded optimizer; drop --no-shard"),
     (["--shard-grads", "--no-shard"], "--shard-grads needs the sharded optimizer")],
)
def test_bad_options_give_one_line(tmp_path, capsys, args, message):
    """Every check runs before any rank starts, so the command itself is called here: what
    ``python -m distopt`` exits with is what it returns (the next test runs one for real)."""
    args = [str(tmp_path) if a == "EMPTY" else a for a in args]
    code = cli.main(["train", *args])
    stderr = capsys.readouterr().err
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distopt train: error:"), stderr
    assert message in lines[0]
    assert "Traceback" not in stderr


@pytest.mark.slow  # a fresh interpreter
def test_bad_option_exits_2_with_one_line_from_the_shell():
    (proc,) = BAD_OPTION.result()
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distopt train: error:"), proc.stderr
    assert "--nproc must be >= 1" in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_shard_grads_run_ends_where_the_full_buffer_run_ends(baseline, pool_runs):
    # One backward per step: the same grads reduced by the same collective, so the same bits.
    out = pool_runs["shard-grads"].out
    assert _final_heldout(out) == _final_heldout(baseline)
    summary = json.loads((out / "summary.json").read_text())
    # fp32 at d = 2: params 4, then (grads 4 + Adam 8) / 2, against 4 + 4 + 8/2.
    assert summary["theory_bytes_per_param"]["distopt"] == pytest.approx(10.0)
    full = json.loads((baseline / "summary.json").read_text())["memory_per_rank"]
    for report, before in zip(summary["memory_per_rank"], full, strict=True):
        assert 10.0 <= report["bytes_per_param"] < 10.5
        assert 2 * report["grads"] == before["grads"]  # each rank's half of the buffer


@pytest.mark.slow
def test_shard_params_run_ends_where_the_full_buffer_run_ends(baseline, pool_runs):
    # The same grads and the same step: only where the params live changes, so the same bits.
    out = pool_runs["shard-params"].out
    assert _final_heldout(out) == _final_heldout(baseline)
    summary = json.loads((out / "summary.json").read_text())
    # fp32 at d = 2: (params 4 + grads 4 + Adam 8) / 2.
    assert summary["theory_bytes_per_param"]["distopt"] == pytest.approx(8.0)
    full = json.loads((baseline / "summary.json").read_text())["memory_per_rank"]
    for report, before in zip(summary["memory_per_rank"], full, strict=True):
        assert 8.0 <= report["bytes_per_param"] < 8.5
        assert 2 * report["params"] == before["params"]  # each rank's half of the params


@pytest.mark.slow
def test_a_stopped_rank_fails_its_peers_within_the_timeout_and_the_group_restarts(
        baseline):
    """Rank 1 stops (SIGSTOP) at step 6: rank 0 fails after --timeout seconds with an error
    that names the collective and the bucket, the launcher restarts the group, and it resumes
    from the step-4 checkpoint to the uninterrupted run's loss. (The run started with the
    session; see ``STOPPED``.)"""
    (proc,) = STOPPED.result()
    out = STOPPED.workdir / "out"
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = re.search(r"CollectiveError: (reduce_scatter|all_gather|all_reduce) of bucket \d+ "
                       r"\(\d+ torch.float32 elements\) failed on rank 0 after ([\d.]+) s",
                       proc.stderr)
    assert failed, proc.stderr[-3000:]
    assert STOPPED_TIMEOUT <= float(failed[2]) < 2 * STOPPED_TIMEOUT
    assert _final_heldout(out) == _final_heldout(baseline)
