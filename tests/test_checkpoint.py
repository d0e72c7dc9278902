"""Checkpoints across DP sizes: save at d = 4, resume at d = 1, 2, 3 and 4, export to plain
torch and back, a rank killed in the middle of a save, and damaged checkpoints.

One spawned group at d = 4 trains every configuration for 10 steps, saves, and goes on to step
20, writing the trajectory as the reference. Then one group per d in 1, 2, 3 (and the d = 4 group
itself, after saving) loads the checkpoints, trains the same global batches to step 20 and
compares. Checkpoints live in a directory that outlives each group.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR

import distopt
from distopt.checkpoint import merge_state_dicts

from dist_harness import case_result, context, run_cases
from helpers import (
    BF16_TOL,
    FP32_TOL,
    lm_loss,
    max_diff,
    params_of,
    same,
    snapshot,
    state_diff,
    world_params,
)
from models import VOCAB, AwkwardLM, batches, rank_slice

pytestmark = pytest.mark.slow

SAVE_AT, EXPORT_TO, END = 10, 15, 20
# A run resumed at another DP size sums its grads in another order: fp32 runs within
# helpers.FP32_TOL (AdamW's drift, as in test_parity.py). bf16 params: every rank computes its
# grads in bf16 on its slice of the batch, so at another DP size the grads round differently
# and a bf16 weight next to a rounding boundary can land on the neighbouring value, one ulp
# away: up to 2**-6 for the weights here (below 4), so helpers.BF16_TOL, test_parity's bound.

CONFIGS = {
    # param groups, clipping, params unused on odd steps, an LR schedule in `extra`
    "adamw": dict(dtype=torch.float32, cls=torch.optim.AdamW, groups=True, clip=0.5,
                  unused=True, kwargs={"lr": 1e-2, "betas": (0.8, 0.95)}),
    # the default param group (every trainable param)
    "sgd": dict(dtype=torch.float32, cls=torch.optim.SGD, groups=False, clip=None,
                unused=True, kwargs={"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    # bf16 params with fp32 main params, which the checkpoint must keep at full precision
    "bf16": dict(dtype=torch.bfloat16, cls=torch.optim.AdamW, groups=False, clip=0.5,
                 unused=True, kwargs={"lr": 1e-2}),
}


def build(name: str, bucket_size: int | None = 100, model: nn.Module | None = None,
          cls: type | None = None):
    config = CONFIGS[name]
    torch.manual_seed(0)
    model = (model or AwkwardLM()).to(config["dtype"])
    ddp = distopt.DistributedDataParallel(model, bucket_size=bucket_size,
                                          find_unused_parameters=config["unused"])
    params = None
    if config["groups"]:
        params = [{**g, "params": [p for p in g["params"] if p is not None]}
                  for g in model.param_groups(wd_lr=2e-2, other_lr=1e-2)]
    opt = distopt.DistributedOptimizer(ddp, cls or config["cls"], params=params,
                                       clip_grad=config["clip"], **config["kwargs"])
    return model, ddp, opt, CosineAnnealingLR(opt, T_max=END)


def train(ddp, opt, sched, steps) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        tokens, targets = batches(step)
        opt.zero_grad()
        lm_loss(ddp, rank_slice(tokens, rank, world), rank_slice(targets, rank, world),
              step).backward()
        opt.step()
        sched.step()


# ---------------------------------------------------------------------- cases (in the ranks)


def save_and_continue(name: str, root: Path) -> dict:
    """Train to SAVE_AT, save, train on to END; rank 0 writes the trajectory."""
    model, ddp, opt, sched = build(name)
    train(ddp, opt, sched, range(SAVE_AT))
    saved = distopt.save_checkpoint(root / name, ddp, opt,
                                    extra={"step": SAVE_AT, "sched": sched.state_dict()})
    ref = {"saved": params_of(model), "sched": sched.state_dict()}
    sd = opt.sharded_state_dict()
    torch.save(sd, root / f"{name}-sd-{dist.get_rank()}.pt")  # the in-memory format, per rank
    train(ddp, opt, sched, range(SAVE_AT, EXPORT_TO))
    ref["export"] = params_of(model)
    train(ddp, opt, sched, range(EXPORT_TO, END))
    ref["final"] = params_of(model)
    if dist.get_rank() == 0:
        torch.save(ref, root / f"{name}-ref.pt")
    return {"dir": saved.name, "moved": max_diff(model, ref["saved"])}


def resume(name: str, root: Path, bucket_size: int | None) -> dict:
    model, ddp, opt, sched = build(name, bucket_size)
    ddp.comm_stats.reset()
    extra = distopt.load_checkpoint(root / name, ddp, opt)
    calls = dict(ddp.comm_stats.calls)
    sched.load_state_dict(extra["sched"])
    ref = torch.load(root / f"{name}-ref.pt")
    at_load = max_diff(model, ref["saved"])
    # The state each rank loaded is, element for element, the state the d = 4 ranks saved.
    saved = merge_state_dicts([torch.load(root / f"{name}-sd-{r}.pt", weights_only=False)
                               for r in range(4)])
    worst_state = state_diff(opt, saved)
    train(ddp, opt, sched, range(extra["step"], END))
    return {"at_load": at_load, "state_diff": worst_state, "final": max_diff(model, ref["final"]),
            "calls": calls, "buckets": len(ddp.buckets)}


def resume_in_memory(name: str, root: Path) -> dict:
    """Every rank's opt.state_dict() from d = 4, merged, loaded at this DP size."""
    model, ddp, opt, sched = build(name, bucket_size=None)
    merged = merge_state_dicts([torch.load(root / f"{name}-sd-{r}.pt", weights_only=False)
                                for r in range(4)])
    opt.load_state_dict(merged)
    ref = torch.load(root / f"{name}-ref.pt")
    at_load = max_diff(model, ref["saved"])
    sched.load_state_dict(ref["sched"])  # the schedule is the caller's, as with torch.optim
    train(ddp, opt, sched, range(SAVE_AT, END))
    return {"at_load": at_load, "final": max_diff(model, ref["final"])}


def resume_from_plain(name: str, root: Path) -> dict:
    """distopt -> plain torch file -> distopt at this DP size."""
    model, ddp, opt, sched = build(name, bucket_size=None)
    extra = distopt.load_plain_checkpoint(root / f"{name}.pt", ddp, opt)
    sched.load_state_dict(extra["sched"])
    ref = torch.load(root / f"{name}-ref.pt")
    at_load = max_diff(model, ref["saved"])
    train(ddp, opt, sched, range(SAVE_AT, EXPORT_TO))
    return {"at_load": at_load, "final": max_diff(model, ref["export"])}


class NoBias(AwkwardLM):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 7, bias=False)


class ExtraLayer(AwkwardLM):
    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(6, 6)  # never used in forward


class BiggerVocab(AwkwardLM):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB + 1, 6)


BAD = {
    # case: (checkpoint run, model class, optimizer class, text every rank's error holds)
    "missing-param": ("adamw", ExtraLayer, None,
                      "missing from the checkpoint: extra.weight, extra.bias"),
    "unexpected-param": ("adamw", NoBias, None, "not in this model: l1.bias"),
    "mis-shaped": ("adamw", BiggerVocab, None, "'emb.weight' has shape (11, 6) in the checkpoint"),
    "other-optimizer": ("sgd", AwkwardLM, torch.optim.AdamW, "holds torch.optim.sgd.SGD state"),
    "truncated": ("truncated", AwkwardLM, None, "truncated"),
    "flipped-byte": ("flipped", AwkwardLM, None, "corrupted"),
    "damaged-index": ("bad-index", AwkwardLM, None, ".metadata is corrupted"),
    "damaged-manifest": ("bad-manifest", AwkwardLM, None, "cannot read"),
}


def bad_load(case: str, root: Path) -> dict:
    run, model_cls, opt_cls, _ = BAD[case]
    model, ddp, opt, _ = build("adamw", model=model_cls(), cls=opt_cls)
    tokens = rank_slice(batches(0)[0], dist.get_rank(), dist.get_world_size())
    ddp(tokens).float().square().mean().backward()
    opt.step()  # non-empty state, which must survive untouched
    before = snapshot(model, opt)
    error = None
    try:
        distopt.load_checkpoint(root / run, ddp, opt)
    except distopt.CheckpointError as exc:
        error = str(exc)
    after = snapshot(model, opt)
    return {"error": error, "unchanged": same(before, after)}


def bad_arguments(root: Path) -> list[str]:
    """Wrong arguments raise on every rank before any communication (else this hangs)."""
    model, ddp, opt, _ = build("adamw")
    other = build("adamw")[1]
    errors = []
    for call in (lambda: distopt.save_checkpoint(root / "args", other, opt),
                 lambda: distopt.save_checkpoint(root / "args", ddp, opt, keep=0),
                 lambda: distopt.save_checkpoint(root / "args", ddp, opt, name="a/b"),
                 lambda: distopt.load_checkpoint(root / "adamw", ddp, torch.optim.SGD(
                     model.parameters(), lr=0.1))):
        try:
            call()
        except (ValueError, TypeError) as exc:
            errors.append(type(exc).__name__)
    return errors


def recover(root: Path, run: str) -> dict:
    """Load the run whose second save was killed, resume, and save again."""
    model, ddp, opt, sched = build("adamw", bucket_size=None)
    extra = distopt.load_checkpoint(root / run, ddp, opt)
    sched.load_state_dict(extra["sched"])
    ref = torch.load(root / f"{run}-ref.pt")
    at_load = max_diff(model, ref["saved"])
    train(ddp, opt, sched, range(extra["step"], KILL_AT))
    after = max_diff(model, ref["after"])
    saved = distopt.save_checkpoint(root / run, ddp, opt, extra={"step": KILL_AT})
    listing = sorted(p.name for p in (root / run).iterdir())
    return {"step": extra["step"], "at_load": at_load, "after": after, "saved": saved.name,
            "listing": listing, "latest": (root / run / "latest").read_text().strip()}


# ---------------------------------------------------------------------- the killed save

FIRST_SAVE, KILL_AT = 3, 5


def _kill_worker(rank: int, world: int, store: str, root: Path, run: str) -> None:
    """Save, train on, and save again, rank 1 dying in the middle of writing its file; with
    ``run == "killed-async"`` the second save is async and rank 1 dies in its background
    write, after save_checkpoint has returned."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    model, ddp, opt, sched = build("adamw")
    train(ddp, opt, sched, range(FIRST_SAVE))
    distopt.save_checkpoint(root / run, ddp, opt,
                            extra={"step": FIRST_SAVE, "sched": sched.state_dict()})
    ref = {"saved": params_of(model)}
    train(ddp, opt, sched, range(FIRST_SAVE, KILL_AT))
    ref["after"] = params_of(model)
    if rank == 0:
        torch.save(ref, root / f"{run}-ref.pt")
    if rank == 1:
        # Die (SIGKILL) in the middle of writing this rank's file: after 3 of its items.
        real_save, written = torch.save, []

        def save_then_die(obj, f, *args, **kwargs):
            if len(written) == 3:
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            written.append(obj)
            return real_save(obj, f, *args, **kwargs)

        torch.save = save_then_die
    try:
        saved = distopt.save_checkpoint(root / run, ddp, opt, extra={"step": KILL_AT},
                                        async_save=run == "killed-async")
        if run == "killed-async":
            (root / f"{run}-returned-{rank}").touch()  # before the write has ended
            saved.wait()
    except Exception as exc:  # the survivors see their peer vanish
        (root / f"{run}-error-{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
    os._exit(0)  # skip destroying a group whose peer is gone


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


KILLED_RUNS = ("killed", "killed-async")


@pytest.fixture(scope="module")
def killed(root) -> dict:
    """Both runs at once, a pair of ranks each."""
    ctx = context()
    procs = {run: [ctx.Process(target=_kill_worker,
                               args=(r, 2, str(root / f"{run}-store"), root, run))
                   for r in range(2)] for run in KILLED_RUNS}
    for p in (p for pair in procs.values() for p in pair):
        p.start()
    for p in (p for pair in procs.values() for p in pair):
        p.join(timeout=120)
    out = {}
    for run, pair in procs.items():
        codes = [p.exitcode for p in pair]
        for p in pair:
            if p.is_alive():
                p.kill()
        survivor = root / f"{run}-error-0.txt"
        out[run] = {"codes": codes,
                    "listing": sorted(p.name for p in (root / run).iterdir()),
                    "survivor": survivor.read_text() if survivor.exists() else None,
                    "returned": [(root / f"{run}-returned-{r}").exists() for r in range(2)]}
    return out


# ---------------------------------------------------------------------- the groups

WORLDS = [1, 2, 3]


@pytest.fixture(scope="module")
def saved(root) -> list[dict]:
    cases = [(f"save-{n}", save_and_continue, (n, root)) for n in CONFIGS]
    cases += [(f"resume-{n}", resume, (n, root, 100)) for n in CONFIGS]
    return run_cases(4, cases)


@pytest.fixture(scope="module")
def exported(saved, root) -> dict[str, Path]:
    out = {}
    for name in CONFIGS:
        out[name] = distopt.export_checkpoint(root / name, root / f"{name}.pt")
    return out


@pytest.fixture(scope="module")
def damaged(saved, root) -> None:
    source = root / "adamw" / "ckpt-000001"
    for run in ("truncated", "flipped", "bad-index", "bad-manifest"):
        shutil.copytree(source, root / run / "ckpt-000001")
        (root / run / "latest").write_text("ckpt-000001\n")
    target = root / "truncated" / "ckpt-000001" / "__1_0.distcp"
    os.truncate(target, target.stat().st_size // 2)
    for run, name in (("flipped", "__2_0.distcp"), ("bad-index", ".metadata")):
        path = root / run / "ckpt-000001" / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    (root / "bad-manifest" / "ckpt-000001" / "distopt.json").write_text('{"format": ')


@pytest.fixture(scope="module", params=world_params(WORLDS))
def resumed(request, root, saved, exported, damaged, killed):
    world = request.param
    cases = [(f"resume-{n}", resume, (n, root, None)) for n in CONFIGS]
    cases.append(("memory-adamw", resume_in_memory, ("adamw", root)))
    cases += [(f"plain-{n}", resume_from_plain, (n, root)) for n in ("adamw", "sgd")]
    cases += [(f"bad-{c}", bad_load, (c, root)) for c in BAD]
    cases.append(("bad-arguments", bad_arguments, (root,)))
    if world == 3:
        cases += [(f"recover-{run}", recover, (root, run)) for run in KILLED_RUNS]
    return world, run_cases(world, cases)


# ---------------------------------------------------------------------- tests


def _check_final(name: str, world: int, value: dict) -> None:
    if world == 4:
        assert value["final"] == 0.0, value  # same layout and arithmetic: bitwise equal
    elif CONFIGS[name]["dtype"] == torch.bfloat16:
        assert value["final"] <= BF16_TOL, value
    else:
        assert value["final"] <= FP32_TOL, value


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_at_4_resume_at_4_is_bitwise(saved, name):
    for value in case_result(saved, f"save-{name}"):
        assert value["dir"] == "ckpt-000001" and value["moved"] > 1e-2
    for value in case_result(saved, f"resume-{name}"):
        assert value["at_load"] == 0.0 and value["state_diff"] == 0.0, value
        assert value["final"] == 0.0, value
        # distopt's own communication in a load: one all-gather of the params per bucket
        assert value["calls"] == {"all_gather": value["buckets"]}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_at_4_resume_at_other_sizes(resumed, name):
    world, results = resumed
    for value in case_result(results, f"resume-{name}"):
        assert value["at_load"] == 0.0 and value["state_diff"] == 0.0, value
        _check_final(name, world, value)
        assert value["calls"] == ({"all_gather": value["buckets"]} if world > 1 else {})


def test_in_memory_state_dicts_reshard(resumed):
    world, results = resumed
    for value in case_result(results, "memory-adamw"):
        assert value["at_load"] == 0.0, value
        _check_final("adamw", world, value)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_export_continues_in_plain_torch(exported, root, name):
    """The exported file trains on with torch.optim on one process, as distopt did."""
    config = CONFIGS[name]
    ckpt = torch.load(exported[name], weights_only=True)
    torch.manual_seed(1)
    model = AwkwardLM()
    model.load_state_dict(ckpt["model"])
    params = model.param_groups(wd_lr=2e-2, other_lr=1e-2) if config["groups"] else (
        model.parameters())  # torch's default: every param, the frozen one included
    opt = config["cls"](params, **config["kwargs"])
    opt.load_state_dict(ckpt["optimizer"])
    sched = CosineAnnealingLR(opt, T_max=END)
    sched.load_state_dict(ckpt["extra"]["sched"])
    ref = torch.load(root / f"{name}-ref.pt")
    assert max_diff(model, ref["saved"]) == 0.0
    for step in range(SAVE_AT, EXPORT_TO):
        tokens, targets = batches(step)
        opt.zero_grad(set_to_none=config["unused"])
        lm_loss(model, tokens, targets, step).backward()
        if config["clip"]:
            torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.grad is not None], config["clip"])
        opt.step()
        sched.step()
    assert max_diff(model, ref["export"]) <= FP32_TOL


def test_export_writes_torch_format(exported):
    ckpt = torch.load(exported["sgd"], weights_only=True)
    names = [n for n, _ in AwkwardLM().named_parameters()]
    assert list(ckpt["model"]) == list(AwkwardLM().state_dict())
    assert ckpt["optimizer"]["param_groups"][0]["params"] == list(range(len(names)))
    frozen = {names.index("frozen.weight"), names.index("frozen.bias")}
    assert set(ckpt["optimizer"]["state"]) == set(range(len(names))) - frozen
    for index, entries in ckpt["optimizer"]["state"].items():
        shape = dict(AwkwardLM().named_parameters())[names[index]].shape
        assert entries["momentum_buffer"].shape == shape
    bf16 = torch.load(exported["bf16"], weights_only=True)
    assert {v.dtype for v in bf16["model"].values()} == {torch.bfloat16}
    assert bf16["optimizer"]["state"][0]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_plain_checkpoint_starts_a_distopt_run(resumed, name):
    world, results = resumed
    for value in case_result(results, f"plain-{name}"):
        assert value["at_load"] == 0.0, value
        assert value["final"] <= FP32_TOL, value


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_fails_on_every_rank_and_changes_nothing(resumed, case):
    _, results = resumed
    for value in case_result(results, f"bad-{case}"):
        assert value["error"] is not None and BAD[case][3] in value["error"], value
        assert value["unchanged"], value


def test_bad_arguments_fail_on_every_rank(resumed):
    _, results = resumed
    for value in case_result(results, "bad-arguments"):
        assert value == ["ValueError", "ValueError", "ValueError", "TypeError"]


@pytest.mark.parametrize("run", KILLED_RUNS)
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(killed, resumed, run):
    v = killed[run]
    assert v["codes"] == [0, -signal.SIGKILL]
    assert v["survivor"] is not None  # rank 0's save failed (its peer vanished), no hang
    assert "ckpt-000001" in v["listing"] and "ckpt-000002" not in v["listing"]
    assert v["listing"].count("latest") == 1
    assert ".ckpt-000002.distopt-tmp" in v["listing"]  # the interrupted save's debris
    if run == "killed-async":
        # Both ranks had returned from save_checkpoint: rank 1 died in the background write,
        # and rank 0's handle raised, saying that nothing was published.
        assert v["returned"] == [True, True]
        assert "CheckpointError: cannot save checkpoint" in v["survivor"], v["survivor"]
        assert "'latest' still names ckpt-000001" in v["survivor"], v["survivor"]
    world, results = resumed
    if world != 3:
        pytest.skip("the recovery runs once, at d = 3")
    for value in case_result(results, f"recover-{run}"):
        assert value["step"] == FIRST_SAVE and value["at_load"] == 0.0, value
        assert value["after"] <= FP32_TOL, value
        assert value["saved"] == "ckpt-000002" and value["latest"] == "ckpt-000002"
        assert ".ckpt-000002.distopt-tmp" not in value["listing"], value
