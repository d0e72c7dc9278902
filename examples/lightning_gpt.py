"""Train a small GPT with Lightning's Trainer on distopt: one strategy swapped, nothing else.

    python examples/lightning_gpt.py --devices 2                       # DistoptStrategy
    python examples/lightning_gpt.py --devices 2 --strategy ddp        # Lightning's DDP, to compare
    python examples/lightning_gpt.py --devices 2 --save run/half.ckpt --steps 40
    python examples/lightning_gpt.py --devices 3 --resume run/half.ckpt --steps 80

Lightning launches the ranks itself (CPU and gloo here; GPUs with --accelerator gpu). The
LightningModule below is plain Lightning: AdamW over two param groups, a cosine schedule,
self.log(sync_dist=True). The text is the byte-level corpus `distopt train` uses (the standard
library's *.py files), cut into fixed windows. At the end each rank prints the bytes of
training state it holds, so the two strategies can be compared.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import distopt
from distopt.integrations.lightning import DistoptStrategy
from distopt.memory import storage_bytes
from distopt.train.data import load_corpus
from distopt.train.model import GPT, gpt_config


class GPTModule(pl.LightningModule):
    def __init__(self, seq_len: int, lr: float, steps: int, global_batch: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.gpt = GPT(gpt_config("tiny", seq_len))

    def training_step(self, batch, batch_idx):
        (seq,) = batch
        _, loss = self.gpt(seq[:, :-1], seq[:, 1:])
        self.log("loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        (seq,) = batch
        _, loss = self.gpt(seq[:, :-1], seq[:, 1:])
        self.log("val_loss", loss, sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        other = [p for p in self.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": other, "weight_decay": 0.0}],
                                lr=self.hparams.lr, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _loader(self, data: torch.Tensor, shuffle: bool) -> DataLoader:
        seq = self.hparams.seq_len + 1
        windows = data[: len(data) // seq * seq].long().view(-1, seq)
        # The global batch is split over the ranks, so any number of devices sees the same data.
        per_rank = self.hparams.global_batch // self.trainer.world_size
        return DataLoader(TensorDataset(windows), batch_size=per_rank, shuffle=shuffle,
                          drop_last=True)

    def setup(self, stage: str) -> None:
        self.corpus = load_corpus(max_bytes=2 << 20)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.corpus.train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.corpus.heldout[: 64 * (self.hparams.seq_len + 1)], shuffle=False)


class StateBytes(pl.Callback):
    """Each rank's training state (params, grads, optimizer state), measured with grads."""

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        if isinstance(trainer.strategy, DistoptStrategy):
            self.total = distopt.measure_state_bytes(trainer.strategy.optimizer).total
            return
        seen: set[int] = set()
        params = list(module.parameters())
        state = (v for s in trainer.optimizers[0].state.values() for k, v in s.items()
                 if k != "step")
        self.total = (storage_bytes(params, seen) + storage_bytes((p.grad for p in params), seen)
                      + storage_bytes(state, seen))

    def on_train_end(self, trainer, module) -> None:
        n = sum(p.numel() for p in module.parameters())
        print(f"rank {trainer.global_rank}: {self.total / 2**20:.2f} MiB of training state, "
              f"{self.total / n:.2f} bytes per parameter", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--strategy", choices=["distopt", "distopt-basic", "ddp"],
                        default="distopt")
    parser.add_argument("--precision", default="32-true",
                        choices=["32-true", "bf16-mixed", "bf16-true", "16-mixed"])
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps in all")
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--save", help="trainer.save_checkpoint here at the end")
    parser.add_argument("--resume", help="a checkpoint to resume from, saved at any --devices")
    args = parser.parse_args()

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    pl.seed_everything(0, verbose=False)
    strategy = {"distopt": lambda: DistoptStrategy(),
                "distopt-basic": lambda: DistoptStrategy(basic=True),
                "ddp": lambda: DDPStrategy()}[args.strategy]()
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy,
        precision=args.precision, max_steps=args.steps, accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip, val_check_interval=20, limit_val_batches=4,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        callbacks=[StateBytes()],
    )
    module = GPTModule(seq_len=64, lr=3e-3, steps=args.steps, global_batch=args.global_batch)
    trainer.fit(module, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    if trainer.is_global_zero:
        metrics = trainer.callback_metrics  # val_loss once a validation ran (every 20 batches)
        print(f"step {trainer.global_step}: "
              + ", ".join(f"{k} {float(metrics[k]):.4f}" for k in ("loss", "val_loss")
                          if k in metrics))
    # End the process group here rather than at the interpreter's exit, where gloo's threads
    # can abort a rank whose training finished.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
