"""What every rank of ``distopt train`` runs: data, model, distopt, the loop, logs and summary.

It reads its rank and world from the environment torchrun (or distopt's launcher) sets, so
``torchrun --nnodes N --nproc-per-node M -m distopt.train [options]`` runs the same code.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import distopt

from ..comm.gloo_io import idle_gloo_io_threads
from ..dtypes import DTYPES, parse_state_dtype
from ..optim.kinds import whole_tensor_cost
from ..plan import ownership
from . import elastic, ft
from .config import OPTIMIZERS, TrainConfig, default_shard_size, param_groups
from .data import BatchSampler, eval_batches, load_corpus
from .faults import faults_for
from .model import GPT, gpt_config
from .report import MetricsLog, progress_bar, write_loss_plot, write_summary
from .stages import GPTStage, StagedSteps

FT_TIMEOUT_S = 30.0
"""With --ft-groups and no --timeout: how long a torchft collective or quorum waits."""


def warmup_cosine(config: TrainConfig):
    """LR multiplier: linear warm-up to 1, then cosine down to 0.1 at the last step."""

    def factor(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        progress = (step - config.warmup) / max(1, config.steps - config.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


class Trainer:
    """One rank's training run."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        config.check_world_size(self.world)
        self.device = _device(config.device_type())
        # With --ft-groups this rank's replica group, in a folder of its own; see train/ft.py.
        self.group = ft.group_index() if config.ft_groups else 0
        groups = config.ft_groups or 1
        self.out = ft.group_out(Path(config.out), self.group) if config.ft_groups else Path(
            config.out)
        self.ckpt_dir = self.out / "checkpoints"
        mesh = self._pipeline_mesh()
        # With --pp each stage's ranks are one data-parallel group of world / pp ranks.
        pp_rank, self.dp_rank = mesh.get_coordinate() if mesh is not None else (0, self.rank)
        self.dp_size = self.world // config.pp

        corpus = load_corpus(config.data, max_bytes=config.max_bytes)
        self.corpus = corpus
        self.sampler = BatchSampler(
            corpus.train, seq_len=config.seq_len, global_batch_size=config.batch_size,
            # The replica groups split one global batch, as the ranks of one group would.
            dp_rank=self.group * self.dp_size + self.dp_rank, dp_size=groups * self.dp_size,
            seed=config.seed,
        )
        self.heldout = [
            (x.to(self.device), y.to(self.device))
            for x, y in eval_batches(
                corpus.heldout, seq_len=config.seq_len, batch_size=config.batch_size,
                num_batches=config.eval_batches, dp_rank=self.dp_rank, dp_size=self.dp_size,
            )
        ]

        self.manager, self._ft_store = (
            ft.build_manager(self.rank, self.world, config.timeout or FT_TIMEOUT_S)
            if config.ft_groups else (None, None))
        # Without --ft-groups the schedule names ranks of one group, 0 (benchmarks/faults.py).
        self.faults = faults_for(self.group, self.rank, groups=groups, nproc=self.world,
                                 steps=config.steps, log=self.out / ft.FT_LOG)
        torch.manual_seed(config.seed)
        experts, ep_group = self._expert_mesh()
        model = GPT(gpt_config(config.model, seq_len=config.seq_len, n_experts=config.moe),
                    ep_group=ep_group)
        model = model.to(self.device, DTYPES[config.dtype])
        for block in model.blocks if config.moe else ():
            # Sharded params: every rank runs the same modules (idle experts on no rows).
            block.mlp.run_idle_experts = config.shard_params
        dp_mesh = None if mesh is not None or experts is not None else self._data_parallel_mesh()
        # The copies of the optimizer state over the data-parallel ranks (1: every rank
        # shards), logged with the start of every attempt.
        self.dp_replicas = (dp_mesh["dp_replicate"].size() if dp_mesh is not None
                            else self.world if config.no_shard else 1)
        tied: dict[str, Any] = {}
        if mesh is not None:  # this rank's stage of the model; see train/stages.py
            model = GPTStage(model, pp_rank, config.pp)
            tied = model.tied_params()
        self.ddp = distopt.DistributedDataParallel(
            model, tied_params=tied,
            experts=None if experts is None else distopt.ExpertParallel(
                experts, model.expert_lists()),
            grad_dtype=DTYPES[config.grad_dtype],
            bucket_size=config.bucket_size,
            overlap_grad_reduce=config.overlap_grad_reduce,
            use_distributed_optimizer=not config.no_shard,
            device_mesh=mesh if mesh is not None else dp_mesh,
            reduce_scatter_with_fp32_accumulation=config.reduce_scatter_fp32_accumulation,
            shard_grads=config.shard_grads,
            shard_params=config.shard_params,
            # An expert no token chose gets no grad: left out of the step where no rank ran
            # it, as torch.optim skips it ([Note: params without a grad]).
            find_unused_parameters=bool(config.moe) and not config.shard_params,
            ft_manager=self.manager,
        )
        opt_cls, opt_kwargs = OPTIMIZERS[config.optimizer]
        scaler = distopt.DynamicLossScaler() if config.dtype == "fp16" else None
        common = dict(clip_grad=config.clip, loss_scaler=scaler, lr=config.lr,
                      state_dtype=parse_state_dtype(config.state_dtype),
                      state_block_size=config.state_block_size,
                      state_rounding=config.state_rounding, **opt_kwargs)
        groups = param_groups(config.optimizer, model, config.lr)
        if groups is not None:
            common["params"] = groups
        if config.no_shard:
            self.opt = distopt.BasicOptimizer(self.ddp, opt_cls, **common)
        else:
            self.opt = distopt.DistributedOptimizer(
                self.ddp, opt_cls, overlap_param_gather=config.overlap_param_gather,
                store_param_remainders=config.store_param_remainders, **common
            )
        self.stages = None if mesh is None else StagedSteps(
            self.ddp, model, pp_rank, config.pp, config.grad_accum, config.schedule, self.device)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup_cosine(config))
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.pending: tuple[int, distopt.checkpoint.AsyncCheckpoint] | None = None
        if self.manager is not None:  # what a healing group takes beside the optimizer's
            self.manager.register_state_dict_fn("train", self._load_train_state,
                                                self._train_state)

    def _pipeline_mesh(self) -> Any:
        """The ("pp", "dp") mesh of a run with --pp, else None."""
        if self.config.pp == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (self.config.pp, self.world // self.config.pp),
                                mesh_dim_names=("pp", "dp"))

    def _expert_mesh(self) -> tuple[Any, dist.ProcessGroup | None]:
        """With --moe, the ("dp", "ep") mesh of the experts and the group tokens are exchanged
        over; see [Note: expert parallelism] in distopt/parallel/experts.py."""
        if not self.config.moe:
            return None, None
        from torch.distributed.device_mesh import init_device_mesh

        ep, pp = self.config.ep, self.config.pp
        if pp == 1:
            mesh = init_device_mesh(self.device.type, (self.world // ep, ep),
                                    mesh_dim_names=("dp", "ep"))
        else:  # within each stage's data-parallel ranks: a slice of a (pp, dp, ep) mesh
            mesh = init_device_mesh(self.device.type, (pp, self.world // pp // ep, ep),
                                    mesh_dim_names=("pp", "dp", "ep"))["dp", "ep"]
        return mesh, mesh["ep"].get_group()

    def _data_parallel_mesh(self) -> Any:
        """A ("dp_replicate", "dp_shard") mesh for --shard-size, or by default on several
        nodes for the ranks of one node, else None (every rank shards; see
        [Note: hierarchical data parallelism])."""
        shard = self.config.shard_size
        # Replicated optimizer state (--no-shard) is plain DDP's all-reduce over every rank.
        if shard is None and not self.config.no_shard:
            nodes: list[Any] = [None] * self.world
            dist.all_gather_object(nodes, _node_id())
            shard = default_shard_size(nodes)
        if shard is None or shard == self.world:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device.type, (self.world // shard, shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
        if self.config.timeout is not None:  # the mesh's groups take torch's default
            timeout = datetime.timedelta(seconds=self.config.timeout)
            for name in ("dp_replicate", "dp_shard"):
                dist.distributed_c10d._set_pg_timeout(timeout, mesh.get_group(name))
        return mesh

    # ------------------------------------------------------------------ checkpoints

    def _extra(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "scheduler": self.sched.state_dict(),
            "rng": torch.get_rng_state(),
            "history": self.history,
            **({} if self.manager is None else {"ft": self.manager.state_dict()}),
        }

    def save(self, log: MetricsLog) -> None:
        """Save a checkpoint (with --async-save, start one). One that fails has changed nothing
        on disk (see [Note: failed saves]): it is reported and training goes on, unless
        --stop-on-save-failure. The time the loop was held is logged as checkpoint_stall_s."""
        began = time.perf_counter()
        waited = self.settle(log)
        self._fault("save")
        try:
            saved = distopt.save_checkpoint(self.ckpt_dir, self.ddp, self.opt,
                                            extra=self._extra(), keep=self.config.keep,
                                            async_save=self.config.async_save)
        except distopt.CheckpointError as error:  # raised alike on every rank
            self._save_failed(log, self.step, error)
            return
        if self.config.async_save:
            self.pending = (self.step, saved)
        log.write({"step": self.step, "checkpoint_stall_s": time.perf_counter() - began,
                   "checkpoint_wait_s": waited})

    def settle(self, log: MetricsLog) -> float:
        """Wait for the async save in flight, if any, and report its failure; every rank
        waits here, at the same step, so that all learn the outcome together. Returns the
        seconds waited."""
        if self.pending is None:
            return 0.0
        (step, pending), self.pending = self.pending, None
        began = time.perf_counter()
        try:
            pending.wait()
        except distopt.CheckpointError as error:
            self._save_failed(log, step, error)
        return time.perf_counter() - began

    def _save_failed(self, log: MetricsLog, step: int, error: Exception) -> None:
        if self.config.stop_on_save_failure:
            raise error
        log.write({"step": step, "checkpoint_error": str(error)})
        if self.rank == 0:
            print(f"distopt train: warning: step {step}: {error}; training goes on "
                  "(--stop-on-save-failure stops instead)", file=sys.stderr, flush=True)

    def _train_state(self) -> dict[str, Any]:
        self._fault("heal", self.manager.current_step())  # the healing source fails
        return {"scheduler": self.sched.state_dict(), "history": list(self.history)}

    def _load_train_state(self, state: dict[str, Any]) -> None:
        self._fault("heal", self.manager.current_step())  # the healing group fails again
        self.sched.load_state_dict(state["scheduler"])
        self.history = list(state["history"])

    def maybe_resume(self) -> bool:
        """Resume from the latest checkpoint with --resume or when the launcher restarted
        the run (after a failure, or with another number of nodes: see train/elastic.py), at
        whatever world size it has now; collective. A restarted replica group resumes from
        its own last save and its Manager's step, then heals from a group ahead of it, if
        any: when every group failed (the healing source died in the heal), the groups go on
        from their saves instead of from step 0."""
        if self.manager is not None:
            restarted = elastic.restart_count() > 0
        else:
            restarted = elastic.is_restart(self.out, self.rank)
        if not (self.config.resume or restarted) or not distopt.has_checkpoint(self.ckpt_dir):
            return False
        extra = distopt.load_checkpoint(self.ckpt_dir, self.ddp, self.opt)
        self.step = int(extra["step"])
        self.sampler.load_state_dict(extra["sampler"])
        self.sched.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng"])
        self.history = list(extra["history"])
        if self.manager is not None:
            self.manager.load_state_dict(extra["ft"])
        return True

    # ------------------------------------------------------------------ loop

    @torch.no_grad()
    def evaluate(self) -> float:
        self.ddp.eval()
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for x, y in self.heldout:
            # With --pp the last stage's ranks hold the loss, the others add 0.
            loss = self.ddp(x, y)[1] if self.stages is None else self.stages.evaluate(x, y)
            total += loss.double()
        total /= len(self.heldout)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        self.ddp.train()
        return float(total.item()) / self.dp_size

    def train_step(self) -> dict[str, Any]:
        self.opt.zero_grad()  # with --ft-groups the quorum, where a group behind heals
        if self.manager is not None:  # the committed steps, a healed group's included
            if elastic.restart_count() > 0 and self.manager.current_step() == 0:
                # A restarted group alone in its quorum would train from scratch beside a
                # finished run: it must heal from a group still training, or stop.
                raise RuntimeError(
                    "this replica group was restarted but no healthy group was left to heal "
                    "from (the others had finished or failed) and it has no checkpoint: it "
                    "stops instead of training from step 0")
            self.step = self.manager.current_step()
            x, y = self.sampler.batch_at(self.step)
        else:
            x, y = self.sampler.next_batch()
        self._fault("forward")
        x, y = x.to(self.device), y.to(self.device)
        # With --pp the schedule runs the micro-batches.
        loss_avg = (self._accumulate(x, y) if self.stages is None
                    else self.stages.train(x, y))
        self._fault("step")
        result = self.opt.step()
        if result.updated:
            self.sched.step()
        dist.all_reduce(loss_avg, op=dist.ReduceOp.SUM)
        return {
            "loss": float(loss_avg.item()) / self.dp_size,
            "grad_norm": result.grad_norm,
            "updated": result.updated,
            "lr": self.opt.param_groups[0]["lr"],
            **({} if self.manager is None else {"quorum": self.manager.num_participants()}),
        }

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The step's micro-batches, each reduced by the last backward; their mean loss."""
        accum = self.config.grad_accum
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for i, (mx, my) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
            with self.ddp.no_sync() if i < accum - 1 else contextlib.nullcontext():
                _, loss = self.ddp(mx, my)
                self._fault("backward")
                self.opt.scale_loss(loss / accum).backward()
            loss_sum += loss.detach().float()
        return loss_sum / accum

    def run(self) -> dict[str, Any]:
        config = self.config
        resumed = self.maybe_resume()
        metrics_path = self.out / "metrics.jsonl"
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.json").write_text(json.dumps(config.as_dict(), indent=2))
            if not resumed:
                metrics_path.unlink(missing_ok=True)
        log = MetricsLog(metrics_path if self.rank == 0 else None)
        if resumed:
            log.write({"step": self.step, "resumed": True, "world_size": self.world,
                       "dp_replicas": self.dp_replicas})
        else:
            self._record(log, {"step": 0, "heldout_loss": self.evaluate(),
                               "world_size": self.world, "dp_replicas": self.dp_replicas})
        fail_step, fail = elastic.failure_injection(self.rank)
        self._heals_logged = 0
        if self.manager is not None and self.rank == 0:
            ft.log_event(self.out, {"event": "start", "attempt": elastic.restart_count(),
                                    "step": self.step})

        tokens_per_step = config.batch_size * config.seq_len
        bar = progress_bar(config, self.rank, initial=self.step)
        window_start, window_steps = time.perf_counter(), 0
        while self.step < config.steps:
            if self.step == fail_step:
                fail()
            stats = self.train_step()
            if self.manager is not None and not self._committed(log):
                continue
            self.step += 1
            window_steps += 1
            elapsed = time.perf_counter() - window_start
            stats.update(step=self.step, tokens_per_s=tokens_per_step * window_steps / elapsed)
            if self.step % 10 == 0 or self.step == config.steps:
                window_start, window_steps = time.perf_counter(), 0
            if config.eval_every and self.step % config.eval_every == 0 or (
                self.step == config.steps
            ):
                stats["heldout_loss"] = self.evaluate()
            self._record(log, stats)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{stats['loss']:.3f}",
                                tok_s=f"{stats['tokens_per_s']:.0f}",
                                **({"quorum": stats["quorum"]} if "quorum" in stats else {}))
            if config.save and (config.save_every and self.step % config.save_every == 0
                                or self.step == config.steps):
                self.save(log)
        if bar is not None:
            bar.close()
        self.settle(log)  # the last checkpoint is published before the run ends
        return self.finish()

    def _committed(self, log: MetricsLog) -> bool:
        """With --ft-groups, after a step: whether the quorum committed it (else it is tried
        again); this group's rank 0 logs it for the run's ``ft`` summary."""
        self._heals_logged = ft.log_step(self.out, self.rank, self.step, self.manager,
                                         self.opt._fault_tolerance.record, self._heals_logged)
        return self.manager.current_step() > self.step

    def _fault(self, phase: str, step: int | None = None) -> None:
        """DISTOPT_TRAIN_FAIL_SCHEDULE: die here if a kill of this phase is due; see
        [Note: failure schedules] in train/faults.py."""
        if self.faults is not None:
            self.faults.at(phase, self.step if step is None else step)

    def _record(self, log: MetricsLog, stats: dict[str, Any]) -> None:
        log.write(stats)
        keep = {k: stats[k] for k in ("step", "loss", "heldout_loss") if k in stats}
        self.history.append(keep)

    def finish(self) -> dict[str, Any]:
        report = distopt.measure_state_bytes(self.opt)
        reports = [None] * self.world
        dist.all_gather_object(reports, report.as_dict())
        if self.manager is not None:
            restarts: list[Any] = [None] * self.world
            dist.all_gather_object(restarts, elastic.restart_count())
            if self.rank == 0:
                ft.log_event(self.out, {"event": "finished", "restarts": restarts})
        summary = None
        if self.rank == 0:
            summary = write_summary(self.out, self.config, self.world, reports, self.history,
                                    shard_size=self.ddp.dp_size,
                                    num_files=(self.corpus.num_files_train,
                                               self.corpus.num_files_heldout),
                                    experts=self._expert_share(),
                                    **self._state_memory())
            write_loss_plot(self.out / "loss.png", self.history)
        return summary or {}

    def _expert_share(self) -> tuple[int, int] | None:
        """With --moe: this rank's expert params and their expert-DP size, for the theory."""
        experts = self.ddp.experts
        if experts is None:
            return None
        return (sum(p.numel() for p in experts.params), experts.parallel.expert_dp_size)

    def _state_memory(self) -> dict[str, Any]:
        """The model's mean optimizer state per param, from the table of optimizer classes,
        and with params owned whole (Muon, Adafactor) the plan of what each rank holds; see
        [Note: memory of whole-tensor ownership] in distopt/plan/ownership.py."""
        steppers = ownership.steppers_of(self.opt)
        shapes = [(tuple(p.shape), steppers.get(p)) for p in self.ddp.params]
        memory: dict[str, Any] = {
            "optimizer_state_bytes": ownership.mean_state_bytes(shapes),
            "held_state_bytes": ownership.mean_state_bytes(
                shapes, self.opt.state_precision.dtypes, self.opt.state_precision.block_size),
        }
        owned_whole = any(whole_tensor_cost(cls) is not None for cls, _ in steppers.values())
        if owned_whole and self.opt.sharded:
            memory["ownership"] = ownership.plan_of(self.opt)
        return memory


def _node_id() -> str:
    """Which node this rank runs on: the launcher's node rank (torchrun's GROUP_RANK, one per
    launcher even when several run on one machine), else the host name."""
    return os.environ.get("GROUP_RANK") or socket.gethostname()


def _device(device_type: str) -> torch.device:
    """This rank's device: its local GPU on cuda, else the CPU."""
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run_worker(config: TrainConfig) -> dict[str, Any]:
    """Entry point of every rank; the process group comes from torchrun's environment."""
    on_cuda = config.device_type() == "cuda"
    if not on_cuda:
        # Ranks share the machine's cores; one thread each avoids oversubscription.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    backend = "nccl" if on_cuda else "gloo"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = None if config.timeout is None else datetime.timedelta(seconds=config.timeout)
    dist.init_process_group(backend, store=elastic.attempt_store(rank, world), rank=rank,
                            world_size=world, timeout=timeout)
    # A failed rank leaves without tearing the group down: that would wait on the very peers
    # that failed it, while the launcher waits for this process to exit.
    trainer = Trainer(config)
    if not on_cuda:
        idle_gloo_io_threads()  # its groups exist now; see [Note: gloo's I/O thread]
    summary = trainer.run()
    if trainer.manager is not None:
        dist.barrier()  # every rank is done with the group's Manager before rank 0 ends it
        trainer.manager.shutdown(wait=False)
    dist.destroy_process_group()
    return summary
