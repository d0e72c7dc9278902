"""``distopt train --pp N``: the demo GPT split into N pipeline stages, and one step of them.

Each stage is the whole GPT with the other stages' layers left out, so its params keep the
whole model's names and its checkpoints are the unpipelined run's ([Note: pipeline
checkpoints] in distopt/checkpoint/pipeline.py). The blocks are split evenly; the first stage
adds the embeddings, the last the final norm and the head, whose weight is the embedding's
(tied across the two stages, see [Note: tied stage params] in distopt/optim/tied.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..ddp.wrapper import DistributedDataParallel
from .model import GPT

SCHEDULES = ("gpipe", "1f1b")


class GPTStage(nn.Module):
    """Stage ``index`` of ``count`` of a GPT: its modules, under the whole model's names."""

    def __init__(self, gpt: GPT, index: int, count: int) -> None:
        super().__init__()
        per = gpt.config.n_layer // count
        self.first, self.last = index == 0, index == count - 1
        if self.first:
            self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i]
                                     for i in range(index * per, (index + 1) * per)})
        if self.last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def expert_lists(self) -> list[nn.ModuleList]:
        """Each of this stage's blocks' list of (this rank's) experts, as
        ``GPT.expert_lists`` gives the whole model's (``distopt.ExpertParallel`` takes it)."""
        return [e for e in map(GPT.experts_of, self.blocks.values()) if e is not None]

    def tied_params(self) -> dict[str, nn.Parameter]:
        """The embedding, which the first and the last stage both hold."""
        if self.first and self.last:
            return {}  # one stage: one Parameter, tied within the module
        if self.first:
            return {"wte.weight": self.wte.weight}
        return {"wte.weight": self.lm_head.weight} if self.last else {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device)))
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def stage_param_counts(gpt: GPT, count: int) -> list[int]:
    """The trainable elements each of ``count`` stages holds, the tied embedding/head on the
    first and on the last stage (each keeps a copy). Pass a meta-device GPT: only shapes are
    read, and the stages are the ones ``distopt train --pp`` builds."""
    if count < 1 or gpt.config.n_layer % count:
        raise ValueError(f"{count} stages do not divide the GPT's {gpt.config.n_layer} blocks")
    return [sum(p.numel() for p in GPTStage(gpt, index, count).parameters() if p.requires_grad)
            for index in range(count)]


def stage_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss on one micro-batch: mean cross-entropy in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class StagedSteps:
    """One rank's stage under a torch schedule: a training step and a held-out loss."""

    def __init__(self, ddp: DistributedDataParallel, stage: GPTStage, index: int, count: int,
                 micro_batches: int, schedule: str, device: torch.device) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        from ..pipelining import PipelineStage

        self.stage = stage
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        # fp16's loss scale is refused with stages (config.py), so the loss is used as it is.
        self.schedule = cls(PipelineStage(ddp, index, count, device),
                            n_microbatches=micro_batches, loss_fn=stage_loss)
        self.device = device

    def train(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One schedule step; the mean loss on the last stage, 0 on the others."""
        return self._run(self.schedule.step, x, y)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._run(self.schedule.eval, x, y)

    def _run(self, run: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        run(*((x,) if self.stage.first else ()),
            **({"target": y, "losses": losses} if self.stage.last else {}))
        if not losses:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        return torch.stack([loss.detach().float() for loss in losses]).mean()
