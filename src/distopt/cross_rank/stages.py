"""One verdict for every pipeline stage: what one stage refuses, all of them refuse.

[Note: refusals across stages]
The data-parallel path refuses on every rank of its groups at once ([Note: one model on every
rank] in cross_rank/model.py): a model that differs across the DP ranks, bad options, a second
backward. Pipeline stages build and step different modules, so a stage can refuse where the
others do not; they would then wait for it in their next collective or point-to-point receive,
for ever. So wherever a stage may refuse alone, the stages agree first, over the pipeline group
(the "pp" dimension of the mesh): a 4-byte flag all-reduced, the message gathered only when
some stage raised it. The stage that found the problem raises its own error; every other rank
raises a ``ValueError`` naming that stage and quoting it. The points are the DDP's construction
(its tied params and model check), the optimizer's construction, and the start of every
pipeline step (``distopt.pipelining.PipelineStage``: grads not zeroed since the last step).
Each is reached by every stage alike, so the agreement itself cannot hang. Without a pipeline
group none of this communicates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..comm import collectives as comm


def agree_over_stages(problem: str | None, pp_group: dist.ProcessGroup | None) -> None:
    """Raise on every rank of ``pp_group`` when ``problem`` is set on any of them: this rank's
    problem as is, another stage's named by its pipeline rank."""
    if comm.group_size(pp_group) <= 1:
        if problem is not None:
            raise ValueError(problem)
        return
    flag = torch.tensor([problem is not None], dtype=torch.int32)
    if dist.get_backend(pp_group) != "gloo":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pp_group)
    if not flag.item():
        return
    problems = comm.all_gather_object(problem, pp_group)
    if problem is not None:
        raise ValueError(problem)
    stage, found = next((r, p) for r, p in enumerate(problems) if p is not None)
    raise ValueError(
        f"another pipeline stage (rank {stage} of the pipeline group) refused, so this one "
        f"stops too: {found}"
    )


@contextlib.contextmanager
def stages_agree(pp_group: dist.ProcessGroup | None) -> Iterator[None]:
    """Run the block; then agree over the pipeline stages on whether any of them raised a
    ``ValueError`` or ``TypeError`` in it (see [Note: refusals across stages]). The rank that
    raised re-raises its own error after the agreement."""
    if comm.group_size(pp_group) <= 1:
        yield
        return
    try:
        yield
    except (ValueError, TypeError) as exc:
        with contextlib.suppress(ValueError):
            agree_over_stages(f"{type(exc).__name__}: {exc}", pp_group)
        raise
    agree_over_stages(None, pp_group)
