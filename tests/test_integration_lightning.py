"""DistoptStrategy: Lightning's Trainer on distopt, against Lightning's own DDPStrategy.

One spawned gloo group of 2 ranks fits a small GPT for 30 optimizer steps (accumulate_grad_batches
= 2, gradient_clip_val = 1.0, a cosine LR schedule, validation and self.log(sync_dist=True)) under
DDPStrategy, under DistoptStrategy and under DistoptStrategy(basic=True), and compares per-step
losses, final weights and what each rank holds; the distopt run saves a checkpoint halfway. The
same group runs the other cases (Muon, mixed precision, manual optimization, the errors). Then a
group of 1 and a group of 3 resume from that checkpoint and must end where the 2-rank run ended.

The ranks come from tests/dist_harness.py (a FileStore, no ports): each case sets LOCAL_RANK so
that Lightning takes the processes as launched already and uses the process group in place.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distopt
from distopt.integrations.lightning import DistoptStrategy
from distopt.memory import storage_bytes
from distopt.train.model import GPT, GPTConfig

from dist_harness import case_result, run_cases
from helpers import (
    WEIGHTS_TO_RELATIVE,
    autocast_weights_tol,
    error_of,
    muon_weights_tol,
    world_params,
)

CONFIG = dict(seq_len=16, n_layer=2, n_head=2, n_embd=32, vocab_size=64)
GLOBAL_BATCH = 12  # sequences per micro-batch over all ranks: divides at 1, 2 and 3 ranks
BATCHES_PER_EPOCH = 10  # micro-batches, so 5 optimizer steps per epoch with accumulation 2
ACCUMULATE, EPOCHS, SAVE_AFTER_EPOCH = 2, 6, 3
STEPS = EPOCHS * BATCHES_PER_EPOCH // ACCUMULATE  # 30
# The GPT's AdamW fits (lr 3e-3, clipped at 1.0) run in fp32 stay within 2.4e-6 of the same
# steps in fp64, whatever order their batch's grads are summed in (emulated in plain torch, the
# batch whole or summed over 2 to 6 ranks either way): 6.7e-7 over a fit's 30 steps, 2.4e-6 over
# two fits of 4 (the fits in turn), whose first AdamW steps, lr * g / (|g| + eps), carry the
# roundoff of a near-zero grad furthest. Two runs are within twice that of each other; twice
# again for orders not tried, as helpers.FP32_TOL. Losses (about ln 64 = 4.2) are compared
# relative to their size, helpers.WEIGHTS_TO_RELATIVE times as far.
TOL = 2 * 2 * 2.5e-6  # 1e-5
# bf16 autocast rounds every matmul input to 8 significant bits, so the last-bit differences
# of two correct reductions (a clip coefficient, say) can flip roundings in the next forward:
# helpers.autocast_weights_tol over the 4 steps at lr 3e-3 (the cosine over 30 steps has barely
# begun); 16-mixed alike.
MIXED_TOL = autocast_weights_tol([3e-3] * 4)  # 3.8e-4
# Muon: torch's Newton-Schulz runs in bf16, where grads that differ in their last bits round
# apart (helpers.muon_weights_tol): lr 0.02 for the 4 steps, sqrt(2) for the (64, 32) matrices.
MUON_TOL = muon_weights_tol([0.02] * 4, lr_ratio=2**0.5)  # 1.8e-3
LOSS_RTOL = WEIGHTS_TO_RELATIVE * TOL
# This GPT's grad norm is ~0.5 at init; the training loss is scaled up so that
# gradient_clip_val=1.0 really clips (AdamW's step is otherwise blind to the scale).
LOSS_FACTOR = 4.0


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (n, CONFIG["seq_len"] + 1),
                         generator=torch.Generator().manual_seed(seed))


class GPTModule(pl.LightningModule):
    """A small GPT as a LightningModule: AdamW over two param groups, a cosine schedule."""

    def __init__(self, optimizer: str = "adamw", lr: float = 3e-3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT(GPTConfig(**CONFIG))
        # Softmax ignores a shift of the keys, so a key bias gets no gradient, only rounding
        # noise, which AdamW normalizes into lr-sized steps: two correct reductions summing in
        # different orders would then train it differently. The parity model has none.
        for block in self.gpt.blocks:
            block.attn.c_attn = nn.Linear(CONFIG["n_embd"], 3 * CONFIG["n_embd"], bias=False)
            nn.init.normal_(block.attn.c_attn.weight, std=0.02)
        self.optimizer_name, self.lr = optimizer, lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (seq,) = batch
        _, loss = self.gpt(seq[:, :-1], seq[:, 1:])
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return LOSS_FACTOR * loss

    def validation_step(self, batch, batch_idx):
        (seq,) = batch
        _, loss = self.gpt(seq[:, :-1], seq[:, 1:])
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        other = [p for p in self.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": other, "weight_decay": 0.0}],
                                lr=self.lr, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        per_rank = GLOBAL_BATCH // self.trainer.world_size
        return DataLoader(TensorDataset(tokens(GLOBAL_BATCH * BATCHES_PER_EPOCH, 1)),
                          batch_size=per_rank)

    def val_dataloader(self):
        per_rank = GLOBAL_BATCH // self.trainer.world_size
        return DataLoader(TensorDataset(tokens(GLOBAL_BATCH, 2)), batch_size=per_rank)


class BatchNormModule(pl.LightningModule):
    """A BatchNorm MLP on a regression task: what its running statistics become is compared."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # No bias before the BatchNorm: its grad would be roundoff that AdamW turns into steps.
        self.net = nn.Sequential(nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(),
                                 nn.Linear(16, 3))
        self.losses: list[float] = []

    def _loss(self, batch):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def _data(self, batches: int, seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        n = GLOBAL_BATCH * batches
        data = TensorDataset(2 * torch.randn(n, 6, generator=g) + 0.5,
                             torch.randn(n, 3, generator=g))
        return DataLoader(data, batch_size=GLOBAL_BATCH // self.trainer.world_size)

    def train_dataloader(self):
        return self._data(BATCHES_PER_EPOCH, 3)

    def val_dataloader(self):
        return self._data(1, 4)


class SaveAfterEpoch(pl.Callback):
    def __init__(self, epoch: int, path: Path) -> None:
        self.epoch, self.path = epoch, path

    def on_train_epoch_end(self, trainer, module) -> None:
        if trainer.current_epoch == self.epoch - 1:
            trainer.save_checkpoint(self.path)


class Probe(pl.Callback):
    """What a rank holds while training (params, grads, optimizer state, measured before the
    last step, with grads), the grad norm before clipping, and how many of distopt's
    collectives each micro-batch issued."""

    def __init__(self) -> None:
        self.state_bytes, self.grad_norms, self.collectives = None, [], []
        self._calls = 0

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, DistoptStrategy):
            self.state_bytes = distopt.measure_state_bytes(strategy.optimizer).total
            return
        seen: set[int] = set()
        params = list(module.parameters())
        state = trainer.optimizers[0].state.values()
        self.state_bytes = (
            storage_bytes(params, seen) + storage_bytes((p.grad for p in params), seen)
            + storage_bytes((v for s in state for k, v in s.items() if k != "step"), seen)
        )
        grads = [p.grad for p in params if p.grad is not None]
        self.grad_norms.append(torch.nn.utils.get_total_norm(grads).item())

    def on_train_start(self, trainer, module) -> None:
        # From here on: what the DDP's construction sent (the model check) is not a step's.
        if isinstance(trainer.strategy, DistoptStrategy):
            self._calls = sum(trainer.strategy.ddp.comm_stats.calls.values())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if isinstance(trainer.strategy, DistoptStrategy):
            calls = sum(trainer.strategy.ddp.comm_stats.calls.values())
            self.collectives.append(calls - self._calls)
            self._calls = calls


def trainer(strategy, **kwargs) -> pl.Trainer:
    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # launched already: see the module docstring
    os.environ["NODE_RANK"] = "0"
    os.environ["OMP_NUM_THREADS"] = "1"  # else Lightning gives a lone rank every core
    settings = dict(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1,
                    accumulate_grad_batches=ACCUMULATE, gradient_clip_val=1.0,
                    max_epochs=EPOCHS, default_root_dir=tempfile.gettempdir())
    settings.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and sampler seeds
        return pl.Trainer(**settings)


def outcome(module: pl.LightningModule, trainer: pl.Trainer) -> dict:
    probe = next(c for c in trainer.callbacks if isinstance(c, Probe))
    return {
        "state_bytes": probe.state_bytes,
        "grad_norms": probe.grad_norms,
        "collectives": probe.collectives,
        "losses": list(module.losses),
        "params": {k: v.detach().float().clone() for k, v in module.named_parameters()},
        "buffers": {k: v.detach().double().clone() for k, v in module.named_buffers()},
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "num_params": sum(p.numel() for p in module.parameters()),
        "steps": trainer.global_step,
    }


def fit(strategy, module=None, callbacks=(), **kwargs) -> dict:
    module = module or GPTModule()
    t = trainer(strategy, callbacks=[Probe(), *callbacks], **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(module)
    return outcome(module, t)


class MuonModule(GPTModule):
    """Bias-free matrices only, as torch.optim.Muon requires; distopt owns each one whole."""

    def __init__(self) -> None:
        super().__init__(lr=0.02)
        torch.manual_seed(0)
        self.gpt = None
        vocab = CONFIG["vocab_size"]
        self.net = nn.Sequential(nn.Embedding(vocab, 32), nn.Linear(32, 64, bias=False),
                                 nn.GELU(), nn.Linear(64, vocab, bias=False))

    def _loss(self, seq):
        logits = self.net(seq[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch[0])
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch[0]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Muon(self.parameters(), lr=self.lr, momentum=0.9)


class ManualModule(GPTModule):
    """Manual optimization through self.optimizers() (the optimizer there is distopt's),
    accumulating micro-batches by hand with Lightning's toggle_model(sync_grad=...)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt, sched = self.optimizers(), self.lr_schedulers()
        last = batch_idx % ACCUMULATE == ACCUMULATE - 1
        with opt.toggle_model(sync_grad=last):
            (seq,) = batch
            _, loss = self.gpt(seq[:, :-1], seq[:, 1:])
            self.manual_backward(LOSS_FACTOR * loss / ACCUMULATE)
        self.losses.append(loss.item())
        if last:
            opt.step()
            opt.zero_grad()
            sched.step()


class FrozenModule(GPTModule):
    """A frozen first block whose params configure_optimizers still hands to AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt.blocks[0].requires_grad_(False)


class NoOptimizerModule(ManualModule):
    def configure_optimizers(self):
        return None


class WrappedInsideModule(GPTModule):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))


# ---------------------------------------------------------------------- cases (in the ranks)

SHORT = dict(max_epochs=1, limit_train_batches=8)  # 4 optimizer steps


def ddp_run() -> dict:
    return fit(DDPStrategy())


class Collectives(pl.Callback):
    """strategy.reduce, broadcast and barrier, as a LightningModule or callback calls them."""

    def on_train_end(self, trainer, module) -> None:
        strategy, rank = trainer.strategy, trainer.global_rank
        module.collectives = {
            "reduce_sum": strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item(),
            "reduce_mean": strategy.reduce(torch.tensor(float(rank + 1))).item(),
            "broadcast": strategy.broadcast(f"from rank {rank}", src=1),
        }
        strategy.barrier("test")


def distopt_run(ckpt: str) -> dict:
    module = GPTModule()
    result = fit(DistoptStrategy(bucket_size=2000), module,
                 callbacks=[SaveAfterEpoch(SAVE_AFTER_EPOCH, Path(ckpt)), Collectives()])
    return {**result, "strategy_collectives": module.collectives}


def basic_run() -> dict:
    return fit(DistoptStrategy(basic=True), **SHORT)


def shard_grads_run() -> dict:
    return fit(DistoptStrategy(bucket_size=2000, shard_grads=True))


def muon_runs() -> dict:
    return {name: fit(strategy, MuonModule(), **SHORT)
            for name, strategy in (("ddp", DDPStrategy()), ("distopt", DistoptStrategy()))}


def frozen_runs() -> dict:
    return {name: fit(strategy, FrozenModule(), **SHORT)
            for name, strategy in (("ddp", DDPStrategy()), ("distopt", DistoptStrategy()))}


def precision_runs() -> dict:
    fp16 = lambda: dict(precision=None, plugins=[MixedPrecision("16-mixed", "cpu")])  # noqa: E731
    runs = {}
    for name, kwargs in (("bf16-mixed", dict(precision="bf16-mixed")), ("16-mixed", fp16())):
        runs[name] = {"ddp": fit(DDPStrategy(), **kwargs, **SHORT),
                      "distopt": fit(DistoptStrategy(), **kwargs, **SHORT)}
    strategy = DistoptStrategy()
    module = GPTModule()
    runs["bf16-true"] = fit(strategy, module, precision="bf16-true", **SHORT)
    runs["bf16-true"]["dtype"] = str(next(module.parameters()).dtype)
    runs["bf16-true"]["main_params"] = distopt.measure_state_bytes(strategy.optimizer).main_params
    return runs


def manual_runs() -> dict:
    kwargs = dict(accumulate_grad_batches=1, gradient_clip_val=None, **SHORT)
    return {name: fit(strategy, ManualModule(), **kwargs)
            for name, strategy in (("ddp", DDPStrategy()), ("distopt", DistoptStrategy()))}


def batchnorm_runs() -> dict:
    """The BatchNorm module fitted under DDPStrategy and DistoptStrategy, with broadcast_buffers
    True and False; and Trainer(sync_batchnorm=True): the group its layers get."""
    runs = {}
    for broadcast in (True, False):
        runs[broadcast] = {
            name: fit(strategy, BatchNormModule(), **SHORT)
            for name, strategy in (("ddp", DDPStrategy(broadcast_buffers=broadcast)),
                                   ("distopt", DistoptStrategy(broadcast_buffers=broadcast)))}
    groups = []

    class SeeGroups(pl.Callback):  # Lightning turns the layers back into BatchNorm at teardown
        def on_fit_start(self, trainer, module) -> None:
            groups.extend(m.process_group for m in trainer.strategy.ddp.modules()
                          if isinstance(m, nn.SyncBatchNorm))

    t = trainer(DistoptStrategy(), sync_batchnorm=True, max_steps=0, limit_val_batches=0,
                callbacks=[SeeGroups()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(BatchNormModule())
    runs["sync_batchnorm"] = len(groups) == 1 and groups[0] is dist.group.WORLD
    return runs


def fits_in_turn() -> dict:
    """One module fitted by two Trainers in turn (each a fresh optimizer and schedule, as
    configure_optimizers builds them), under each strategy; distopt's wrapper is released in
    between and at the end."""
    out = {}
    for name, strategy in (("ddp", DDPStrategy), ("distopt", DistoptStrategy)):
        module = GPTModule()
        runs = [fit(strategy(), module, **SHORT) for _ in range(2)]
        params = list(module.parameters())
        out[name] = {"runs": runs,
                     "hooks_left": sum(len(p._post_accumulate_grad_hooks or {}) for p in params),
                     "main_grads_left": sum(hasattr(p, "main_grad") for p in params)}
    return out


def ddp_resume_run(ckpt: str) -> dict:
    """Lightning's own DDPStrategy resumed from the file DistoptStrategy saved halfway."""
    module = GPTModule()
    t = trainer(DDPStrategy(), callbacks=[Probe()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(module, ckpt_path=ckpt)
    saved = torch.load(ckpt, weights_only=True)
    return {**outcome(module, t), "file_keys": sorted(saved),
            "optimizer_state_keys": sorted(saved["optimizer_states"][0])}


def model_checkpoint_run(root: str) -> dict:
    """Lightning's ModelCheckpoint writes distopt checkpoints, replaces last.ckpt, prunes the
    worse one, and fit(ckpt_path="last") resumes from it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def callback():
        return ModelCheckpoint(dirpath=root, save_last=True, save_top_k=1, monitor="val_loss")

    fit(DistoptStrategy(), callbacks=[callback()], enable_checkpointing=True, max_epochs=2,
        limit_train_batches=4)
    saved = sorted(os.listdir(root))
    t = trainer(DistoptStrategy(), callbacks=[Probe(), callback()], enable_checkpointing=True,
                max_epochs=3, limit_train_batches=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(GPTModule(), ckpt_path="last")
    t.save_checkpoint(Path(root) / "after-fit.ckpt")  # once fit has returned, too
    return {"saved": saved, "steps": t.global_step,
            "after_fit": distopt.has_checkpoint(Path(root) / "after-fit.ckpt.distopt")
            and (Path(root) / "after-fit.ckpt").is_file(),
            "complete": all(distopt.has_checkpoint(Path(root) / f"{name}.distopt")
                            for name in saved if name.endswith(".ckpt"))}


def error_runs(plain_file: str) -> dict:
    torch.save({"state_dict": {}}, plain_file) if dist.get_rank() == 0 else None
    dist.barrier()
    calls = {
        "value_clipping": lambda: fit(DistoptStrategy(), gradient_clip_algorithm="value",
                                      **SHORT),
        "no_optimizer": lambda: fit(DistoptStrategy(), NoOptimizerModule(),
                                    accumulate_grad_batches=1, gradient_clip_val=None, **SHORT),
        "double_wrap": lambda: fit(DistoptStrategy(), WrappedInsideModule(), **SHORT),
        "plain_checkpoint": lambda: resume_run(plain_file),
    }
    # Any exception: the tests check which one, and its words.
    return {name: error_of(call, (Exception,)) for name, call in calls.items()}


def resume_run(ckpt: str) -> dict:
    module = GPTModule()
    t = trainer(DistoptStrategy(bucket_size=2000), callbacks=[Probe()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(module, ckpt_path=ckpt)
    return outcome(module, t)


# ---------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def ckpt_root():
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


@pytest.fixture(scope="module")
def two_ranks(ckpt_root):
    ckpt = str(ckpt_root / "half.ckpt")
    cases = [("ddp", ddp_run, ()), ("distopt", distopt_run, (ckpt,)),
             ("ddp_resumed", ddp_resume_run, (ckpt,)), ("turns", fits_in_turn, ()),
             ("basic", basic_run, ()),
             ("shard_grads", shard_grads_run, ()),
             ("muon", muon_runs, ()), ("frozen", frozen_runs, ()),
             ("precision", precision_runs, ()),
             ("manual", manual_runs, ()), ("batchnorm", batchnorm_runs, ()),
             ("errors", error_runs, (str(ckpt_root / "plain.ckpt"),)),
             ("model_checkpoint", model_checkpoint_run, (str(ckpt_root / "callback"),))]
    return run_cases(2, cases)


def losses_rdiff(ours: list[float], ref: list[float]) -> float:
    """The largest difference of two runs' losses, relative to the reference's."""
    return max(abs(a - b) / abs(b) for a, b in zip(ours, ref, strict=True))


def assert_same_run(ours: dict, ref: dict, tol: float = TOL) -> None:
    """Losses within WEIGHTS_TO_RELATIVE * tol of ``ref``'s (relative), weights within tol."""
    assert ours["steps"] == ref["steps"] > 0
    rdiff = losses_rdiff(ours["losses"], ref["losses"])
    param_diff = max((ours["params"][k] - v).abs().max().item() for k, v in ref["params"].items())
    print(f"max loss rdiff {rdiff:.3g}, max param diff {param_diff:.3g}")
    assert rdiff < WEIGHTS_TO_RELATIVE * tol, rdiff
    for name, value in ref["params"].items():
        assert (ours["params"][name] - value).abs().max().item() < tol, name


def test_fit_matches_ddp_strategy(two_ranks):
    ddp, ours = case_result(two_ranks, "ddp"), case_result(two_ranks, "distopt")
    for rank in range(2):
        assert ours[rank]["steps"] == STEPS
        assert len(ours[rank]["losses"]) == STEPS * ACCUMULATE
        assert_same_run(ours[rank], ddp[rank])
        assert losses_rdiff([ours[rank]["val_loss"]], [ddp[rank]["val_loss"]]) < LOSS_RTOL
    # Training moved the weights by far more than the tolerance, and clipping was active.
    first, last = ddp[0]["losses"][:4], ddp[0]["losses"][-4:]
    assert sum(first) / 4 - sum(last) / 4 > 0.1, (first, last)
    assert len(ddp[0]["grad_norms"]) == STEPS
    print(f"grad norms before clipping: {min(ddp[0]['grad_norms']):.2f} to "
          f"{max(ddp[0]['grad_norms']):.2f}")
    assert sum(n > 1.0 for n in ddp[0]["grad_norms"]) >= STEPS // 2, ddp[0]["grad_norms"]


def test_accumulation_steps_do_not_communicate(two_ranks):
    for result in case_result(two_ranks, "distopt"):
        calls = result["collectives"]
        assert len(calls) == STEPS * ACCUMULATE
        assert calls[0::2] == [0] * STEPS  # backward under ddp.no_sync()
        assert min(calls[1::2]) > 0  # reduce-scatters, the norm's all-reduce, all-gathers


def test_collectives(two_ranks):
    for rank, result in enumerate(case_result(two_ranks, "distopt")):
        assert result["strategy_collectives"] == {"reduce_sum": 3.0, "reduce_mean": 1.5,
                                         "broadcast": "from rank 1"}, rank


def test_state_per_rank_against_ddp_strategy(two_ranks):
    ddp, ours = case_result(two_ranks, "ddp"), case_result(two_ranks, "distopt")
    basic = case_result(two_ranks, "basic")
    n = ddp[0]["num_params"]
    theory = distopt.theoretical_bytes_per_param(torch.float32, torch.float32, 2)
    for rank in range(2):
        # DDP: fp32 params, grads and AdamW's two moments on every rank, 16 bytes per param
        # (and a few hundred bytes of autograd's grad storages, larger than the grads they
        # hold); BasicOptimizer keeps the same replicated state in its buffers.
        assert 16 * n <= ddp[rank]["state_bytes"] < 1.01 * 16 * n
        assert 16 * n <= basic[rank]["state_bytes"] < 1.01 * 16 * n
        # distopt: the moments sharded over the 2 ranks, 12 bytes per param, and padding.
        assert theory == 12
        assert theory * n <= ours[rank]["state_bytes"] < 1.01 * theory * n
        assert ours[rank]["state_bytes"] < 0.76 * ddp[rank]["state_bytes"]
    print(f"\nstate per rank, {n} params: DDPStrategy {ddp[0]['state_bytes']} B, "
          f"DistoptStrategy {ours[0]['state_bytes']} B, basic=True {basic[0]['state_bytes']} B")


def test_shard_grads_fits_as_ddp_strategy_in_12_of_16_bytes(two_ranks):
    ddp, ours = case_result(two_ranks, "ddp"), case_result(two_ranks, "shard_grads")
    n = ddp[0]["num_params"]
    theory = distopt.theoretical_bytes_per_param(torch.float32, torch.float32, 2,
                                                 shard_grads=True)
    for rank in range(2):
        # Each micro-batch reduced and added to the kept shard: the same sum as DDPStrategy's
        # one reduction of the added micro-batches, in other roundings.
        assert_same_run(ours[rank], ddp[rank])
        # fp32: params whole, grads and AdamW's moments sharded over 2: 4 + 12/2 = 10 bytes.
        assert theory == 10
        assert theory * n <= ours[rank]["state_bytes"] < 1.01 * theory * n
        # Every micro-batch reduce-scatters now, the ones under no_sync too.
        assert min(ours[rank]["collectives"]) > 0


def test_basic_flag_matches_ddp_strategy(two_ranks):
    ddp, basic = case_result(two_ranks, "ddp"), case_result(two_ranks, "basic")
    for rank in range(2):
        losses = basic[rank]["losses"]
        assert len(losses) == 8
        rdiff = losses_rdiff(losses, ddp[rank]["losses"][:8])
        print(f"basic=True: max loss rdiff {rdiff:.3g} over 4 steps")
        assert rdiff < LOSS_RTOL


def test_muon_owned_whole(two_ranks):
    for result in case_result(two_ranks, "muon"):
        assert_same_run(result["distopt"], result["ddp"], MUON_TOL)


def test_frozen_params_in_the_optimizer(two_ranks):
    for result in case_result(two_ranks, "frozen"):
        assert_same_run(result["distopt"], result["ddp"])


def test_mixed_precision(two_ranks):
    for result in case_result(two_ranks, "precision"):
        assert_same_run(result["bf16-mixed"]["distopt"], result["bf16-mixed"]["ddp"], MIXED_TOL)
        assert_same_run(result["16-mixed"]["distopt"], result["16-mixed"]["ddp"], MIXED_TOL)
        bf16 = result["bf16-true"]
        assert bf16["dtype"] == "torch.bfloat16"
        # fp32 masters of the 1/2 of the bf16 weights this rank owns.
        assert bf16["main_params"] >= 4 * bf16["num_params"] // 2
        assert bf16["losses"][-1] < bf16["losses"][0]


def test_manual_optimization(two_ranks):
    for result in case_result(two_ranks, "manual"):
        assert_same_run(result["distopt"], result["ddp"])
        calls = result["distopt"]["collectives"]
        assert calls[0::2] == [0] * 4 and min(calls[1::2]) > 0


def test_unsupported_settings_raise_on_every_rank(two_ranks):
    errors = case_result(two_ranks, "errors")
    assert errors[0] == errors[1]
    assert errors[0]["value_clipping"].startswith("ValueError: DistoptStrategy clips by the global")
    assert "gradient_clip_algorithm='value'" in errors[0]["value_clipping"]
    assert errors[0]["no_optimizer"].startswith("ValueError: configure_optimizers returned no ")
    assert "(manual optimization)" in errors[0]["no_optimizer"]
    assert errors[0]["double_wrap"].startswith("ValueError: DistoptStrategy wraps the Lightning")
    assert "'head' is already a torch.nn.parallel" in errors[0]["double_wrap"]
    assert "is not a distopt checkpoint" in errors[0]["plain_checkpoint"]


def test_options_that_would_double_wrap_are_refused():
    with pytest.raises(ValueError, match="static_graph would configure a torch DDP wrapper"):
        DistoptStrategy(static_graph=True)
    with pytest.raises(ValueError, match="belong to the sharded optimizer"):
        DistoptStrategy(basic=True, overlap_param_gather=True)
    with pytest.raises(ValueError, match="shard_grads and shard_params belong"):
        DistoptStrategy(basic=True, shard_grads=True)


def test_registered_by_name():
    t = pl.Trainer(accelerator="cpu", devices=2, strategy="distopt", logger=False)
    assert type(t.strategy) is DistoptStrategy


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_unsupported_precision_is_refused_when_the_trainer_is_built(precision):
    with pytest.raises(ValueError, match=f"got .*precision='{precision}'"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=DistoptStrategy(), precision=precision)


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast", "own-buffers"])
def test_batchnorm_statistics_as_ddp_strategy(two_ranks, broadcast):
    """Params and running statistics within TOL of DDPStrategy's on each rank, with
    broadcast_buffers either way; broadcasting, the validation forward after training starts
    from rank 0's statistics on both ranks, and leaves them equal (eval mode updates none)."""
    runs = [v[broadcast] for v in case_result(two_ranks, "batchnorm")]
    for run in runs:
        assert_same_run(run["distopt"], run["ddp"])
        for name, value in run["ddp"]["buffers"].items():
            assert (run["distopt"]["buffers"][name] - value).abs().max() < TOL, name
    for name in ("ddp", "distopt"):
        means = [run[name]["buffers"]["net.1.running_mean"] for run in runs]
        gap = (means[0] - means[1]).abs().max().item()
        assert (gap == 0.0) if broadcast else (gap > 1e-2), (name, gap)


def test_sync_batchnorm_layers_reduce_over_the_data_parallel_group(two_ranks):
    assert all(v["sync_batchnorm"] for v in case_result(two_ranks, "batchnorm"))


def test_model_checkpoint_callback(two_ranks):
    for result in case_result(two_ranks, "model_checkpoint"):
        assert result["complete"] and result["after_fit"]
        # last.ckpt and the best one, each a file with its sharded part, and nothing else in
        # the callback's folder (no 'latest' pointer).
        files = [n for n in result["saved"] if n.endswith(".ckpt")]
        assert "last.ckpt" in files and len(files) == 2
        assert sorted(result["saved"]) == sorted([*files, *(f + ".distopt" for f in files)])
        assert result["steps"] == 3 * 2


def test_a_second_fit_of_the_same_module_trains_as_ddp_strategys(two_ranks):
    for result in case_result(two_ranks, "turns"):
        ours, ddp = result["distopt"], result["ddp"]
        for run, ref in zip(ours["runs"], ddp["runs"], strict=True):
            assert_same_run(run, ref)
        # The second fit started where the first ended (the losses of both are in the list).
        assert ours["runs"][1]["losses"][:8] == ours["runs"][0]["losses"]
        assert ours["hooks_left"] == ours["main_grads_left"] == 0  # a plain module again


def test_ddp_strategy_resumes_a_distopt_checkpoint(two_ranks):
    full = case_result(two_ranks, "distopt")
    after = (EPOCHS - SAVE_AFTER_EPOCH) * BATCHES_PER_EPOCH
    for rank, result in enumerate(case_result(two_ranks, "ddp_resumed")):
        # An ordinary Lightning checkpoint file: weights, torch.optim state, Lightning's own.
        assert {"state_dict", "optimizer_states", "loops", "lr_schedulers",
                "epoch"} <= set(result["file_keys"])
        assert result["optimizer_state_keys"] == ["param_groups", "state"]
        assert result["steps"] == STEPS and len(result["losses"]) == after
        assert losses_rdiff(result["losses"], full[rank]["losses"][-after:]) < LOSS_RTOL
        for name, value in full[rank]["params"].items():
            assert (result["params"][name] - value).abs().max().item() < TOL, name


@pytest.mark.parametrize("world_size", world_params([1, 3]))
def test_resume_at_another_number_of_devices(two_ranks, ckpt_root, world_size):
    full = case_result(two_ranks, "distopt")
    resumed = case_result(run_cases(world_size, [("resume", resume_run,
                                                  (str(ckpt_root / "half.ckpt"),))]), "resume")
    after = (EPOCHS - SAVE_AFTER_EPOCH) * BATCHES_PER_EPOCH
    # Each rank's loss is the mean over its slice of the global batch: their mean is the
    # global batch's loss at any number of ranks.
    full_losses = [sum(r["losses"][-after:][i] for r in full) / 2 for i in range(after)]
    for result in resumed:
        assert result["steps"] == STEPS
        assert len(result["losses"]) == after
        losses = [sum(r["losses"][i] for r in resumed) / world_size for i in range(after)]
        assert losses_rdiff(losses, full_losses) < LOSS_RTOL
        for name, value in full[0]["params"].items():
            assert (result["params"][name] - value).abs().max().item() < TOL, name


def test_the_files_optimizer_state_numbers_frozen_params_as_torch_does():
    from distopt.integrations._lightning_checkpoints import _with_frozen

    # distopt's groups hold the trainable params only: 0, 1 in the first, 2 in the second.
    exported = {"state": {0: {"step": 1}, 1: {"step": 2}, 2: {"step": 3}},
                "param_groups": [{"lr": 1, "params": [0, 1]}, {"lr": 2, "params": [2]}]}
    trainable = [[True, False, True], [False, True]]
    model = nn.ModuleList([nn.Linear(1, 1, bias=False) for _ in range(5)])
    params = [m.weight for m in model]
    for p, trains in zip(params, [t for g in trainable for t in g], strict=True):
        p.requires_grad_(trains)
    torch_opt = torch.optim.SGD([{"params": params[:3]}, {"params": params[3:]}], lr=0.1)
    renumbered = _with_frozen(exported, trainable)
    assert renumbered["param_groups"] == [{"lr": 1, "params": [0, 1, 2]},
                                          {"lr": 2, "params": [3, 4]}]
    assert renumbered["state"] == {0: {"step": 1}, 2: {"step": 2}, 4: {"step": 3}}
    assert [g["params"] for g in renumbered["param_groups"]] == [
        g["params"] for g in torch_opt.state_dict()["param_groups"]]
    assert _with_frozen(exported, [[True, True], [True]]) is exported
