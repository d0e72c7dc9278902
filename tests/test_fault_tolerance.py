"""Replica groups under torchft: one group's rank is killed mid-run, the other group goes on
without a restart, the failed group is started again and heals from the other, and from then
on every rank of both groups holds bitwise the same state as its peer in the other group; the
run's losses and weights are those of a one-process run that saw, at each step, the batches of
the groups that took part in it.

Two replica groups of two ranks each (the state sharded inside each group), started by
ft_worker.start_groups (the launcher: it restarts a group whose rank died) and a Lighthouse in
this process. The refusals run on one process: they are raised before any collective.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import distopt

from early_launches import Command, launch_early
from helpers import LOSS_RTOL, error_of

torchft = pytest.importorskip("torchft")

import ft_worker  # noqa: E402  (after the skip: it needs torchft's classes at run time)

STEPS = 16
FAIL_AT = 3  # group 1's rank 1 dies after this step's forward
GROUPS, WORLD = 2, 2
# Each step computes this long. The failed group is started again once the healthy one has
# committed a step alone, and the healthy one waits for it to be up two steps past the failure
# (ft_worker's hold), so a slow restart delays the run but cannot miss its end.
STEP_S = 0.2


def _alone(out: Path) -> bool:
    """Whether group 0 has committed a step without group 1 since the failure."""
    path = out / "steps-g0-r0.jsonl"
    return any(e["step"] > FAIL_AT and e["participants"] == 1
               for e in map(json.loads, path.read_text().splitlines()))

# The weights of the one-process control against the groups': the same steps, each grad the
# mean of the same 4 or 8 rank batches' grads, averaged in another order (each group's pair,
# then the groups, against one mean). AdamW at lr 1e-2 turns that roundoff into a drift: this
# model's 16 steps (with both groups, and with one group for some steps), run in fp64 and in
# fp32 with the rank batches' grads summed forward, reversed, by group pairs and as one mean
# loss, stay within 1.8e-7 of the fp64 run; two runs within twice that of each other, and
# twice again for orders not tried. A lost group's grad or a stale param moves weights by
# about lr (1e-2) in one step.
WEIGHTS_TOL = 2 * 2 * 1.8e-7


# The CLI runs: 10 steps of the tiny GPT, 2 groups of 2 ranks. --ft-min-groups 2: a step needs
# both groups, so the healthy group waits for the failed one to come back and heal instead of
# racing its restart to the end of the run (on a loaded machine a restart takes many steps);
# every step then averages both groups' batches, as in the run without failures.
TRAIN_ARGS = ["--model", "tiny", "--steps", "10", "--batch-size", "8", "--seq-len", "32",
              "--max-bytes", "300000", "--eval-every", "5", "--eval-batches", "2",
              "--save-every", "2", "--no-progress", "--warmup", "2", "--timeout", "120"]


def _train_groups(out: Path, env: dict[str, str] | None = None) -> Command:
    """``distopt train`` with 2 replica groups of 2 ranks, the small run."""
    return Command.module("distopt", "train", "--nproc", "2", "--ft-groups", "2",
                          "--ft-min-groups", "2", "--max-restarts", "2", *TRAIN_ARGS,
                          "--out", str(out), env=env)


# Group 1's rank 1 is killed at step 3 by the single-failure hooks; then by the schedule during
# its heal (loading the state: it fails again, is restarted again and heals), and group 0's
# rank 1 on entering the save at step 6 (its rank 0 is in the save's collectives).
TRAIN_FAIL = {"DISTOPT_TRAIN_FAIL_GROUP": "1", "DISTOPT_TRAIN_FAIL_AT_STEP": "3",
              "DISTOPT_TRAIN_FAIL_RANK": "1",
              "DISTOPT_TRAIN_FAIL_SCHEDULE": "1/1/3/heal,0/1/6/save"}
# Three groups of one rank: group 0 killed at step 12, then each possible source of its heal
# killed while sending it: every live copy of the state is lost, and the groups go on from
# their last saves.
SOURCE_FAIL = {"DISTOPT_TRAIN_FAIL_SCHEDULE": "0/0/12/forward,1/0/13/heal,2/0/13/heal"}
SOURCE_RUN = launch_early(
    "test_train_survives_the_healing_source_dying_in_the_heal",
    lambda workdir: [Command.module(
        # --ft-min-groups 2: no group commits a step alone (its own grads only) while the
        # others restart, which a loaded machine's timing would otherwise allow. While all
        # three restart, a group back first can wait out a quorum's timeout before the others
        # join, and torchrun then restarts it once more than the schedule's kills: restarts to
        # spare, so that it joins them the next time.
        "distopt", "train", "--nproc", "1", "--ft-groups", "3", "--ft-min-groups", "2",
        "--max-restarts", "6",
        "--model", "tiny", "--steps", "40", "--batch-size", "6", "--seq-len", "32",
        "--max-bytes", "300000", "--eval-every", "20", "--eval-batches", "2",
        "--save-every", "10", "--no-progress", "--warmup", "2", "--timeout", "60",
        "--out", str(workdir / "failed"), env=SOURCE_FAIL)])
TRAIN_RUNS = launch_early(
    "test_train_with_failures_in_a_heal_and_a_save_ends_as_the_run_without",
    lambda workdir: [_train_groups(workdir / "clean"),
                     _train_groups(workdir / "failed", env=TRAIN_FAIL)])


@pytest.fixture(scope="module")
def lighthouse():
    from torchft._torchft import LighthouseServer

    # A dead group leaves the quorum once its heartbeats stop for heartbeat_timeout_ms.
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000,
                              quorum_tick_ms=20, heartbeat_timeout_ms=1000)
    yield server.address()
    server.shutdown()


def _run(mode: str, lighthouse: str, out: Path) -> dict:
    restarts = ft_worker.start_groups(GROUPS, WORLD, mode=mode, steps=STEPS, out=out,
                                      lighthouse=lighthouse, fail=(1, 1, FAIL_AT),
                                      step_s=STEP_S, restart_when=lambda: _alone(out))
    logs = {(g, r): [json.loads(line) for line in
                     (out / f"steps-g{g}-r{r}.jsonl").read_text().splitlines()]
            for g in range(GROUPS) for r in range(WORLD)}
    states = {(g, r): torch.load(out / f"state-g{g}-r{r}.pt", weights_only=False)
              for g in range(GROUPS) for r in range(WORLD)}
    return {"mode": mode, "restarts": restarts, "logs": logs, "states": states}


@pytest.fixture(scope="module", params=[
    "optim",
    *(pytest.param(mode, marks=pytest.mark.slow)
      for mode in ("grads", "params", *ft_worker.PRECISIONS)),
])
def failed_run(request, lighthouse, tmp_path_factory) -> dict:
    return _run(request.param, lighthouse, tmp_path_factory.mktemp(f"ft-{request.param}"))


def test_only_the_failed_group_restarts(failed_run):
    assert failed_run["restarts"] == {0: 0, 1: 1}


def _groups_of_steps(failed_run) -> list[list[int]]:
    """The groups that took part in each step: those that committed it (a group that heals
    takes part in the step it heals at)."""
    return [[g for g in range(GROUPS)
             if any(e["step"] == step for e in failed_run["logs"][(g, 0)])]
            for step in range(STEPS)]


def test_the_healthy_group_commits_every_step_once(failed_run):
    groups = _groups_of_steps(failed_run)
    for r in range(WORLD):
        log = failed_run["logs"][(0, r)]
        steps = [e["step"] for e in log]
        # The group that starts second joins a step or two later, healed from the other
        # (torchft's init_sync); from then on it commits every step once.
        assert steps[0] < FAIL_AT and steps == list(range(steps[0], STEPS))
        # Every rank saw the quorum of the groups that committed the step.
        assert [e["participants"] for e in log] == [len(groups[step]) for step in steps]
    alone = [step for step, g in enumerate(groups) if g == [0]]
    assert any(step >= FAIL_AT for step in alone), groups
    assert groups[-1] == [0, 1], groups


def test_the_failed_group_heals_and_finishes(failed_run):
    for r in range(WORLD):
        log = failed_run["logs"][(1, r)]
        before = [e["step"] for e in log if e["attempt"] == 0]
        after = [e["step"] for e in log if e["attempt"] == 1]
        # Group 1 may join at step 0 or a step later (it heals from group 0 then).
        assert before and before == list(range(before[0], FAIL_AT))
        assert after and after == list(range(after[0], STEPS)) and after[0] > FAIL_AT
        healed = failed_run["states"][(1, r)]["heals"]["received"]
        # At step 0 torchft syncs the groups' start (init_sync); the restart's heal comes next.
        assert healed[-1]["step"] == after[0] and healed[-1]["bytes"] > 0


def test_peers_hold_bitwise_the_same_state(failed_run):
    for r in range(WORLD):
        a, b = failed_run["states"][(0, r)], failed_run["states"][(1, r)]
        for name, value in a["params"].items():
            assert torch.equal(value, b["params"][name]), name
        oa, ob = a["optimizer"], b["optimizer"]
        assert oa["main_params"].keys() == ob["main_params"].keys()
        for name, shard in oa["main_params"].items():
            assert torch.equal(shard.local, ob["main_params"][name].local), name
        assert oa["state"].keys() == ob["state"].keys() and oa["state"]
        for name, entries in oa["state"].items():
            for key, value in entries.items():
                other = ob["state"][name][key]
                value = getattr(value, "local", value)
                other = getattr(other, "local", other)
                assert (torch.equal(value, other) if isinstance(value, torch.Tensor)
                        else value == other), (name, key)


def test_the_healed_group_starts_from_the_peers_buffers(failed_run):
    """The module buffers (BatchNorm's running statistics) travel with the heal: at the step
    a group heals at, each rank starts the step from the buffers its peer in the healthy group
    starts it from (after that each group's own batches move them)."""
    for r in range(WORLD):
        log1 = failed_run["logs"][(1, r)]
        healed = failed_run["states"][(1, r)]["heals"]["received"][-1]["step"]
        first = next(e for e in log1 if e["attempt"] == 1)
        assert first["step"] == healed
        peer = next(e for e in failed_run["logs"][(0, r)] if e["step"] == healed)
        assert first["buffers"] == peer["buffers"], (r, healed)
        # A fresh BatchNorm's statistics (mean 0, var 1, 0 batches) are not what was sent.
        assert any(v not in (0.0, 1.0) for v in peer["buffers"]), peer["buffers"]


def test_the_run_is_the_control_over_the_same_participants(failed_run):
    """One process steps torch's AdamW on the batches of the groups that took part in each
    step (the healthy group's log says how many did)."""
    if failed_run["mode"] in ft_worker.PRECISIONS:
        pytest.skip("the control is fp32 AdamW; this mode is held to its peer bitwise")
    model = ft_worker.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=ft_worker.LR, weight_decay=0.1)
    losses = {}
    for step, groups in enumerate(_groups_of_steps(failed_run)):
        rows = [ft_worker.batch(step, g, r, WORLD) for g in groups for r in range(WORLD)]
        with torch.no_grad():
            for g in groups:
                for r in range(WORLD):
                    x, y = ft_worker.batch(step, g, r, WORLD)
                    losses[(g, r, step)] = ft_worker.loss_of(model, x, y).item()
        opt.zero_grad()
        # The mean of the rank losses: every rank's batch has the same size.
        torch.stack([ft_worker.loss_of(model, x, y) for x, y in rows]).mean().backward()
        opt.step()
    for (g, r), log in failed_run["logs"].items():
        for entry in log:
            expected = losses[(g, r, entry["step"])]
            assert entry["loss"] == pytest.approx(expected, rel=LOSS_RTOL), (g, r, entry)
    final = failed_run["states"][(0, 0)]["params"]
    assert final.keys() == dict(model.named_parameters()).keys()
    for name, value in model.named_parameters():
        diff = (final[name] - value.detach()).abs().max().item()
        assert diff <= WEIGHTS_TOL, (name, diff)


# ---------------------------------------------------------------- distopt train --ft-groups


@pytest.mark.slow
def test_train_with_failures_in_a_heal_and_a_save_ends_as_the_run_without():
    """Three kills (in a forward, during a heal, on entering a save): the run finishes, group 0
    restarts once and group 1 twice, each kill is in the summary with its phase, every group
    ends with the same params as the run without failures (bitwise: every committed step
    averaged both groups' batches, none was lost), and each group's last checkpoint is
    complete."""
    from distopt.checkpoint.files import read_manifest, resolve, verify_files

    clean, failed = TRAIN_RUNS.result()
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert failed.returncode == 0, failed.stderr[-3000:]
    summaries = [json.loads((TRAIN_RUNS.workdir / name / "summary.json").read_text())
                 for name in ("clean", "failed")]
    assert all(g["restarts"] == [0, 0] for g in summaries[0]["ft"]["groups"])
    g0, g1 = summaries[1]["ft"]["groups"]
    assert g0["restarts"] == [1, 1] and g1["restarts"] == [2, 2]
    assert [(k["step"], k["phase"]) for k in g0["kills"]] == [(6, "save")]
    assert [(k["step"], k["phase"]) for k in g1["kills"]] == [(3, "heal")]
    assert g1["failed_at"][0] == 3 and g0["failed_at"] == [6]
    assert summaries[1]["ft"]["schedule"]["unfired"] == []
    # Healed twice after its first join: once at the restart after step 3's kill, whose load
    # the schedule killed (not logged: the rank died loading), and once at the next restart.
    assert g1["healed_at"][-1] >= 3 and g0["healed_at"] == [6]
    assert summaries[1]["ft"]["heldout_loss"] == summaries[0]["ft"]["heldout_loss"]
    assert len(set(summaries[1]["ft"]["heldout_loss"])) == 1
    for g in range(2):
        ckpt = resolve(TRAIN_RUNS.workdir / "failed" / "groups" / f"g{g}" / "checkpoints")
        verify_files(ckpt, read_manifest(ckpt)["files"])


@pytest.mark.slow
def test_train_survives_the_healing_source_dying_in_the_heal():
    """The groups that a restarted group heals from die while sending: the healing group's
    heal fails, the sources restart from their last saves and the healing group heals from
    them; the run finishes with every group at the same params, and only the steps since the
    last save were committed twice."""
    from distopt.checkpoint.files import read_manifest, resolve, verify_files

    (failed,) = SOURCE_RUN.result()
    assert failed.returncode == 0, failed.stderr[-3000:]
    out = SOURCE_RUN.workdir / "failed"
    summary = json.loads((out / "summary.json").read_text())
    groups = summary["ft"]["groups"]
    assert [(k["step"], k["phase"]) for k in groups[0]["kills"]] == [(12, "forward")]
    sources = [k for g in groups[1:] for k in g["kills"]]
    assert sources and all(k["phase"] == "heal" for k in sources), groups
    assert len(set(summary["ft"]["heldout_loss"])) == 1
    for g in range(3):
        events = [json.loads(line) for line in
                  (out / "groups" / f"g{g}" / "ft.jsonl").read_text().splitlines()]
        committed = [e["step"] for e in events if e["event"] == "committed"]
        assert len(committed) - len(set(committed)) < 10 and max(committed) == 40, g
        ckpt = resolve(out / "groups" / f"g{g}" / "checkpoints")
        verify_files(ckpt, read_manifest(ckpt)["files"])


def test_a_seeded_schedule_is_spread_over_the_run():
    from distopt.train.faults import PHASES, draw_schedule, parse_schedule

    kills = parse_schedule("7:8", groups=3, nproc=2, steps=400)
    assert kills == draw_schedule(7, 8, groups=3, nproc=2, steps=400)
    steps = [k.step for k in kills]
    # One in each eighth of steps 41 to 360: increasing, at least 1 apart, inside the run.
    assert steps == sorted(steps) and len(set(steps)) == 8 and steps[0] >= 41
    assert steps[-1] <= 360
    assert {k.phase for k in kills} <= set(PHASES) and {k.group for k in kills} <= {0, 1, 2}
    assert kills != draw_schedule(8, 8, groups=3, nproc=2, steps=400)
    named = parse_schedule("1/0/5/heal,0/1/6/save", groups=2, nproc=2, steps=10)
    assert [(k.group, k.rank, k.step, k.phase) for k in named] == [(1, 0, 5, "heal"),
                                                                   (0, 1, 6, "save")]
    with pytest.raises(ValueError, match="GROUP/RANK/STEP/PHASE"):
        parse_schedule("1/0/5/evaluate", groups=2, nproc=2, steps=10)
    for bad in ("7", "7:x", "1/0/5", "3/0/5/heal"):
        with pytest.raises(ValueError, match="GROUP/RANK/STEP/PHASE"):
            parse_schedule(bad, groups=2, nproc=2, steps=10)


# ---------------------------------------------------------------- the heal state, one process


def _muon_groups(model: nn.Module) -> list[dict]:
    return [{"params": [model[0].weight, model[2].weight], "lr": 0.02},
            {"params": [model[0].bias, model[2].bias], "optimizer": torch.optim.AdamW,
             "lr": 1e-2}]


HEAL_CASES = {  # (param dtype, DDP arguments, optimizer class, optimizer arguments)
    "fp32": (torch.float32, {}, torch.optim.AdamW, {}),
    "fp32-shard-params": (torch.float32, {"shard_params": True}, torch.optim.AdamW, {}),
    "bf16-fp32-masters": (torch.bfloat16, {}, torch.optim.AdamW, {}),
    "bf16-remainders-bf16-state": (torch.bfloat16, {"shard_grads": True}, torch.optim.AdamW,
                                   {"store_param_remainders": True,
                                    "state_dtype": torch.bfloat16}),
    "fp8-state": (torch.float32, {}, torch.optim.AdamW, {"state_dtype": torch.float8_e4m3fn}),
    "muon-whole-tensor": (torch.float32, {}, torch.optim.Muon, {"params": _muon_groups}),
    "fp16-loss-scaler": (torch.float16, {}, torch.optim.AdamW,
                         {"loss_scaler": distopt.DynamicLossScaler}),
}


def _trained(case: str, steps: int) -> tuple:
    dtype, ddp_kwargs, cls, opt_kwargs = HEAL_CASES[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)
    ddp = distopt.DistributedDataParallel(model, **ddp_kwargs)
    opt_kwargs = dict(opt_kwargs)
    if "params" in opt_kwargs:
        opt_kwargs["params"] = opt_kwargs["params"](model)
    if "loss_scaler" in opt_kwargs:
        opt_kwargs["loss_scaler"] = opt_kwargs["loss_scaler"]()
    opt = distopt.DistributedOptimizer(ddp, cls, lr=1e-2, **opt_kwargs)
    for step in range(steps):
        _one_step(ddp, opt, step, dtype)
    return ddp, opt


def _one_step(ddp, opt, step: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 8, generator=g).to(dtype), torch.randn(4, 4, generator=g)
    opt.zero_grad()
    opt.scale_loss(torch.nn.functional.mse_loss(ddp(x).float(), y)).backward()
    opt.step()


@pytest.mark.parametrize("case", sorted(HEAL_CASES))
def test_a_fresh_rank_loads_the_heal_state_bitwise(case):
    """What a healthy rank sends (``heal_state``, its tensors copied out of their buffers as
    the transport would see them) makes a fresh rank hold the same bits, and both take the
    same next step: in every mode the heal carries, on one process (no collective)."""
    from distopt.optim.fault_tolerance import own_storage

    dtype = HEAL_CASES[case][0]
    healthy_ddp, healthy = _trained(case, 3)
    fresh_ddp, fresh = _trained(case, 0)
    fresh.load_heal_state(own_storage(healthy.heal_state()))
    for ddp, opt in ((healthy_ddp, healthy), (fresh_ddp, fresh)):
        _one_step(ddp, opt, 3, dtype)
    a, b = healthy.heal_state(), fresh.heal_state()
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    for name, shard in a["optimizer"]["main_params"].items():
        assert torch.equal(shard.local, b["optimizer"]["main_params"][name].local), name
    for name, entries in a["optimizer"]["state"].items():
        for key, value in entries.items():
            other = b["optimizer"]["state"][name][key]
            value, other = getattr(value, "local", value), getattr(other, "local", other)
            assert (torch.equal(value, other) if isinstance(value, torch.Tensor)
                    else value == other), (name, key)
    assert a["optimizer"]["loss_scaler"] == b["optimizer"]["loss_scaler"]
    assert a["optimizer"]["state"], "the state moved nothing"


# ---------------------------------------------------------------- refusals, one process


class _StubManager:
    """Just enough of a torchft Manager for the checks made before any collective."""

    def __init__(self, use_async_quorum: bool = False) -> None:
        self._use_async_quorum = use_async_quorum

    def start_quorum(self) -> None: ...

    def allreduce(self, tensor: torch.Tensor) -> None: ...

    def should_commit(self) -> bool:
        return True

    def register_state_dict_fn(self, *args) -> None: ...


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"use_distributed_optimizer": False}, "use_distributed_optimizer=True"),
    ({"find_unused_parameters": True}, "find_unused_parameters"),
    ({"grad_dtype": torch.bfloat16, "reduce_scatter_with_fp32_accumulation": True},
     "reduce_scatter_with_fp32_accumulation"),
])
def test_what_is_not_covered_is_refused_by_name(kwargs, named):
    message = error_of(lambda: distopt.DistributedDataParallel(
        _model(), ft_manager=_StubManager(), **kwargs))
    assert message.startswith("ValueError: ft_manager=") and named in message


def test_an_async_quorum_is_refused():
    message = error_of(lambda: distopt.DistributedDataParallel(
        _model(), ft_manager=_StubManager(use_async_quorum=True)))
    assert "use_async_quorum=False" in message


def test_something_else_than_a_manager_is_refused():
    message = error_of(lambda: distopt.DistributedDataParallel(_model(), ft_manager=object()))
    assert "torchft.Manager" in message


@pytest.mark.parametrize(("args", "named"), [
    (["--ft-groups", "2", "--no-shard"], "--no-shard"),
    (["--ft-groups", "2", "--pp", "2"], "--pp"),
    (["--ft-groups", "2", "--shard-size", "1"], "--shard-size"),
    (["--ft-groups", "0"], "--ft-groups must be >= 1"),
    (["--ft-lighthouse", "http://host:29510"], "add --ft-groups"),
    (["--ft-groups", "2", "--ft-min-groups", "3"], "--ft-min-groups must be in"),
    (["--ft-groups", "2", "--ft-min-groups", "2", "--ft-lighthouse", "http://host:29510"],
     "--min_replicas"),
])
def test_train_refuses_what_the_groups_do_not_cover(args, named):
    from distopt.train.config import parse_args

    with pytest.raises(ValueError, match=named):
        parse_args(args)
