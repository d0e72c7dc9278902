"""A rank of a fault-tolerant run: replica groups of distopt under torchft, one group killed.

Each replica group is its own process group (its own TCP store), its ranks shard the state;
the groups average grads through a torchft Manager and a Lighthouse that the test starts.
``start_groups`` is the test's launcher: it starts every group's ranks from a fork server,
and restarts a group whose rank died (as torchrun does for its own ranks), so that the group
heals from the other one. Each rank writes, as it goes, one line per committed step (the
step, the quorum's size, its loss) and at the end its whole state, for the test to compare.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import distopt

from dist_harness import context

IN, HIDDEN, OUT = 8, 16, 4
BATCH = 4  # rows per rank and step
LR = 1e-2
MODES = {"optim": {}, "grads": {"shard_grads": True}, "params": {"shard_params": True}}
"""The sharding modes inside a group: DistributedDataParallel's arguments."""
PRECISIONS = {  # mode: (the params' dtype, the sharding mode, the optimizer's arguments)
    "bf16": (torch.bfloat16, "optim", {}),  # fp32 main params of bf16 params
    # The lean tier: bf16 params, their fp32 remainders, bf16 optimizer state.
    "lean": (torch.bfloat16, "grads", {"store_param_remainders": True,
                                       "state_dtype": torch.bfloat16}),
    "muon": (torch.float32, "optim", {"muon": True}),  # whole-tensor owners
    "fp16": (torch.float16, "optim", {"loss_scaler": True}),
    # The offload tier: masters and state rest in a file between steps.
    "offload": (torch.float32, "optim", {"offload": True}),
}
"""Modes beyond fp32 AdamW: each runs under a killed group like the sharding modes."""


def build_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    # BatchNorm: running statistics, module buffers that a healed group must take too. After
    # the activation: a bias right before it would get a grad of roundoff alone, which Adam
    # scales up to lr-sized steps that no control reproduces.
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.BatchNorm1d(HIDDEN),
                         nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).to(dtype)


def build_optimizer(ddp: Any, model: nn.Module, mode: str) -> Any:
    """The run's optimizer: AdamW, or the mode's precision (PRECISIONS)."""
    kwargs = dict(PRECISIONS[mode][2]) if mode in PRECISIONS else {}
    if kwargs.pop("loss_scaler", False):
        # The tests hold every step to be committed and stepped. At the default scale (2**16)
        # any grad element above 1 overflows fp16, which some steps' batches reach (step 5
        # with both groups in: a skipped step); at 2**8 this model's grads stay far below
        # fp16's 65504, so no step is skipped, whichever steps the groups take together.
        kwargs["loss_scaler"] = distopt.DynamicLossScaler(initial_scale=2.0**8)
    if kwargs.pop("offload", False):
        kwargs["offload_dir"] = tempfile.gettempdir()
    if kwargs.pop("muon", False):
        matrices = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        return distopt.DistributedOptimizer(
            ddp, torch.optim.Muon, lr=0.02, **kwargs,
            params=[{"params": matrices},
                    {"params": rest, "optimizer": torch.optim.AdamW, "lr": LR}])
    return distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=LR, weight_decay=0.1,
                                        **kwargs)


def dtype_of(mode: str) -> torch.dtype:
    return PRECISIONS[mode][0] if mode in PRECISIONS else torch.float32


def buffers_of(model: nn.Module) -> list[float]:
    """The module buffers' values, in order, as floats (for the log)."""
    return [v for b in model.buffers() for v in b.double().flatten().tolist()]


def batch(step: int, group: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank`` of group ``group``'s rows at ``step``: the same for a retried step."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * group + rank)
    x = torch.randn(BATCH, IN, generator=g)
    y = torch.randn(BATCH, OUT, generator=g)
    return x, y


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(spec: dict[str, Any]) -> None:
    """One rank of one group, to ``spec["steps"]`` committed steps; exits the process at the
    step given as ``fail_at`` if it is the failing rank."""
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    group, rank, world = spec["group"], spec["rank"], spec["world"]
    timeout = timedelta(seconds=spec["timeout_s"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=world, timeout=timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
        min_replica_size=1, use_async_quorum=False, store_addr="127.0.0.1",
        store_port=spec["port"], rank=rank, world_size=world, replica_id=f"group{group}",
        lighthouse_addr=spec["lighthouse"], timeout=timeout, quorum_timeout=timeout * 3,
        connect_timeout=timeout)
    mode = spec["mode"]
    model = build_model(dtype_of(mode))
    ddp = distopt.DistributedDataParallel(
        model, ft_manager=manager, **MODES[PRECISIONS[mode][1] if mode in PRECISIONS else mode])
    opt = build_optimizer(ddp, model, mode)
    out = Path(spec["out"])
    (out / f"ready-g{group}-r{rank}-a{spec['attempt']}").touch()
    if spec["attempt"] == 0:
        _wait_for_every_group(spec)
    with open(out / f"steps-g{group}-r{rank}.jsonl", "a") as log:
        _train(spec, manager, ddp, opt, log)
    record = opt._fault_tolerance.record
    names = {n for n, _ in model.named_parameters()}
    whole = ddp.full_state_dict()
    # The buffers are each group's own (its batches' statistics); the params are the groups'.
    state = {"params": {n: v for n, v in whole.items() if n in names},
             "optimizer": opt.sharded_state_dict(),
             "heals": {"sent": record.sent, "received": record.received}}
    torch.save(state, out / f"state-g{group}-r{rank}.pt")
    # Every rank of the group has written before any leaves (the group's store lives in rank 0).
    dist.barrier()
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def _wait_for(spec: dict[str, Any], names: list[Path], what: str) -> None:
    end = time.monotonic() + 10 * spec["timeout_s"]
    while not all(n.exists() for n in names):
        if time.monotonic() > end:
            raise TimeoutError(f"{what} did not start")
        time.sleep(0.01)


def _wait_for_every_group(spec: dict[str, Any]) -> None:
    """The first start's barrier: every rank of every group has built its model before any
    asks for a quorum. Without it, a loaded machine starts one group seconds after the other,
    which then commits the first steps alone, and the late group joins (and fails) at a step
    the test did not plan for."""
    out = Path(spec["out"])
    _wait_for(spec, [out / f"ready-g{g}-r{r}-a0" for g in range(spec["groups"])
                     for r in range(spec["world"])], "the other groups")


def _hold_for_the_restart(spec: dict[str, Any]) -> None:
    """A healthy group, at the step ``spec["hold"]`` names, waits until the failed group's
    restarted ranks have built their models: on a loaded machine a restart takes seconds, in
    which the healthy group would otherwise run to the end of the run alone."""
    hold, out = spec["hold"], Path(spec["out"])
    _wait_for(spec, [out / f"ready-g{hold['group']}-r{r}-a1" for r in range(spec["world"])],
              f"group {hold['group']}'s restart")


def _train(spec: dict[str, Any], manager: Any, ddp: Any, opt: Any, log: Any) -> None:
    group, rank, world = spec["group"], spec["rank"], spec["world"]
    dtype = dtype_of(spec["mode"])
    held = spec["hold"] is None or spec["attempt"] > 0
    while manager.current_step() < spec["steps"]:
        if not held and manager.current_step() == spec["hold"]["step"]:
            _hold_for_the_restart(spec)
            held = True
        opt.zero_grad()  # the quorum; a group behind the others heals here
        step = manager.current_step()
        # Before the forward: the buffers the step starts from (a healed group's are the
        # healthy group's at this step).
        buffers = buffers_of(ddp.module)
        x, y = batch(step, group, rank, world)
        loss = loss_of(ddp, x.to(dtype), y)
        if spec["fail_at"] == step and spec["fail_rank"] == rank and spec["attempt"] == 0:
            os._exit(17)  # mid-step: after the forward, before the backward's reductions
        opt.scale_loss(loss).backward()
        # A real model's compute, in every step: the groups' ranks spend most of a step
        # waiting, not spinning, as the test module's `distopt train` runs in the background
        # need (with steps taken back to back they starved those runs of the cores).
        time.sleep(spec["step_s"])
        result = opt.step()
        if result.updated:
            log.write(json.dumps({"step": step, "participants": manager.num_participants(),
                                  "loss": loss.item(), "attempt": spec["attempt"],
                                  "buffers": buffers}) + "\n")
            log.flush()


def _entry(spec: dict[str, Any]) -> None:
    run_rank(spec)


def start_group(ctx: Any, spec: dict[str, Any]) -> list[Any]:
    procs = []
    port = free_port()
    for rank in range(spec["world"]):
        p = ctx.Process(target=_entry, args=({**spec, "rank": rank, "port": port},))
        p.start()
        procs.append(p)
    return procs


def start_groups(groups: int, world: int, *, mode: str, steps: int, out: Path,
                 lighthouse: str, fail: tuple[int, int, int] | None, timeout_s: float = 10,
                 step_s: float = 0.0, restart_when: Any = None,
                 deadline_s: float = 120) -> dict[int, int]:
    """Run ``groups`` replica groups of ``world`` ranks to ``steps`` committed steps; ``fail``:
    (group, rank, step) to kill once; ``step_s``: seconds each step computes while fewer than
    ``groups`` groups take part in it (the steps with every group in do not wait). A group one of
    whose ranks died is stopped and started again, as a launcher does, once ``restart_when()``
    is true (the time a replacement takes to come up; None: at once). Returns each group's
    restarts."""
    ctx = context()  # the test session's fork server (dist_harness.py)
    base = {"groups": groups, "world": world, "mode": mode, "steps": steps, "out": str(out),
            "lighthouse": lighthouse, "timeout_s": timeout_s, "step_s": step_s,
            "fail_at": None, "fail_rank": None, "hold": None}
    specs = {}
    for g in range(groups):
        spec = {**base, "group": g, "attempt": 0}
        if fail is not None and fail[0] == g:
            spec.update(fail_rank=fail[1], fail_at=fail[2])
        elif fail is not None:
            # Two steps past the failure: the healthy group has committed one step alone by
            # then (what restart_when waits for), and waits there for the restarted group.
            spec["hold"] = {"group": fail[0], "step": fail[2] + 2}
        specs[g] = spec
    running = {g: start_group(ctx, specs[g]) for g in specs}
    restarts = dict.fromkeys(specs, 0)
    down: set[int] = set()  # groups stopped, waiting to be started again
    end = time.monotonic() + deadline_s
    while running:
        if time.monotonic() > end:
            for procs in running.values():
                for p in procs:
                    p.kill()
            raise TimeoutError(f"the groups did not finish in {deadline_s} s")
        for g, procs in list(running.items()):
            codes = [p.exitcode for p in procs]
            if g in down:
                if restart_when is None or restart_when():
                    down.discard(g)
                    restarts[g] += 1
                    specs[g] = {**specs[g], "attempt": restarts[g]}
                    running[g] = start_group(ctx, specs[g])
            elif all(c == 0 for c in codes):
                del running[g]
            elif any(c not in (None, 0) for c in codes):
                for p in procs:
                    p.kill()
                    p.join()
                down.add(g)  # the other groups go on meanwhile
        time.sleep(0.05)
    return restarts
