"""Resume a pipelined distopt run's checkpoint in the unpipelined model with torch alone: torch
DDP, torch's own recipe (``get_state_dict``, ``dcp.load``, ``set_state_dict``), in processes
that never import distopt.

    python tests/torch_resume_stages.py OUT WORLD CKPT

starts WORLD gloo processes; each loads CKPT into the whole ``StagedLM`` under torch DDP, trains
to ``STEPS`` and rank 0 writes, with ``torch.save`` into OUT, ``{"ends": [each rank's params and
AdamW state, whole], "distopt_imported": ...}``. The model (and how a stage is cut out of it),
the batches and the learning rate are test_checkpoint_torch_layout_stages.py's, defined here so
that this file imports torch only.
"""

from __future__ import annotations

import copy
import gc
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_state_dict,
)
from torch_resume import ends, one_process_run

VOCAB, DIM, SEQ, BATCH, LAYERS = 16, 8, 3, 8, 2
SAVED_AT, STEPS, LR = 2, 4, 1e-2


class StagedLM(nn.Module):
    """The whole model, or one stage of it: the layers another stage runs are left out (the
    first stage alone has the embeddings, the last alone the head), names unchanged; the head
    is tied to the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.wte: nn.Embedding | None = nn.Embedding(VOCAB, DIM)
        self.wpe: nn.Embedding | None = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleDict({str(i): nn.Linear(DIM, DIM) for i in range(LAYERS)})
        self.head: nn.Linear | None = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            h = self.wte(h) + self.wpe(torch.arange(h.shape[-1]))
        for layer in self.layers.values():
            h = torch.tanh(layer(h))
        return self.head(h) if self.head is not None else h


def model() -> StagedLM:
    torch.manual_seed(0)
    return StagedLM()


def stage_of(whole: nn.Module, stage: int, stages: int) -> tuple[nn.Module, dict]:
    """Stage ``stage`` of ``stages`` (a copy; ``stages`` divides the number of layers) of a
    model built as ``StagedLM`` is (``wte``, ``wpe``, ``layers``, a ``head`` tied to ``wte``;
    test_pipeline.py's too), and its ``tied_params``: the tie's two ends only, none between."""
    module = copy.deepcopy(whole)
    per = len(whole.layers) // stages
    for name in list(module.layers):
        if not stage * per <= int(name) < (stage + 1) * per:
            del module.layers[name]
    if stage > 0:
        module.wte = module.wpe = None
    if stage < stages - 1:
        module.head = None
    if stages == 1 or 0 < stage < stages - 1:
        return module, {}
    tied = module.wte.weight if module.wte is not None else module.head.weight
    return module, {"wte.weight": tied}


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def reference() -> dict[str, torch.Tensor]:
    """One process, torch's AdamW on the whole batch, ``STEPS`` steps."""
    return one_process_run(model(), loss_fn, batch, STEPS, LR)


def resume(rank: int, world: int, ckpt: str) -> dict[str, torch.Tensor]:
    """torch DDP loads ``ckpt`` and trains on to ``STEPS``; its ends. The DDP is freed on
    return, before the process group: a gloo group whose last owner is a torch DDP destroyed
    after ``destroy_process_group`` can deadlock joining its threads."""
    net = nn.parallel.DistributedDataParallel(model())
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    msd, osd = get_state_dict(net, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=ckpt)
    set_state_dict(net, opt, model_state_dict=msd, optim_state_dict=osd)
    per = BATCH // world
    for step in range(SAVED_AT, STEPS):
        x, y = (t[rank * per : (rank + 1) * per] for t in batch(step))
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
    return ends(net, opt)


def _worker(rank: int, world: int, store: str, out: str, ckpt: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    resumed = resume(rank, world, ckpt)
    gc.collect()  # the DDP's reference cycles, before the group goes
    imported = any(m.split(".")[0] == "distopt" for m in sys.modules)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (resumed, imported))
    if rank == 0:
        torch.save({"ends": [e for e, _ in everyone],
                    "distopt_imported": any(i for _, i in everyone)}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    out, world, ckpt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, f"{tmp}/store", out, ckpt), nprocs=world)
