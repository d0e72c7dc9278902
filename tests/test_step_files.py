"""A training step runs only the step's own modules (docs/design.md, "Who calls whom").

The hot path of a step is meant to stay in five places: the DDP wrapper that schedules buckets,
the buckets that reduce and gather, the stateless collectives, the optimizer's step pipeline,
and the grad statistics and loss scaler. Anything else that shows up there (layout arithmetic,
tensor-parallel helpers, checkpoint code) is work a step should not be doing. World size 1 runs
the same code as d ranks with communication skipped, so one process sees every function.
"""

from __future__ import annotations

import torch
from torch import nn

import distopt

from helpers import STEP_FILES, files_run_by


def test_a_step_touches_only_the_step_modules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(torch.bfloat16)
    ddp = distopt.DistributedDataParallel(model, bucket_size=100, check_for_nan_in_grad=True)
    opt = distopt.DistributedOptimizer(
        ddp, torch.optim.AdamW, clip_grad=1.0, overlap_param_gather=True, log_num_zeros=True,
        state_dtype=torch.bfloat16, lr=1e-2,
    )
    fp16 = distopt.DistributedDataParallel(nn.Linear(8, 4).to(torch.float16))
    fp16_opt = distopt.DistributedOptimizer(
        fp16, torch.optim.SGD, loss_scaler=distopt.DynamicLossScaler(initial_scale=4.0), lr=0.1
    )
    x = torch.randn(5, 8)

    def train_step() -> None:
        for module, optimizer in ((ddp, opt), (fp16, fp16_opt)):
            optimizer.zero_grad()
            with module.no_sync():
                optimizer.scale_loss(module(x.to(module.params[0].dtype)).float().sum()).backward()
            optimizer.scale_loss(module(x.to(module.params[0].dtype)).float().sum()).backward()
            result = optimizer.step()
            assert result.updated

    train_step()  # the first step also builds the inner optimizers' state
    touched = files_run_by(train_step)
    assert {"ddp/wrapper.py", "ddp/buffers/bucket.py", "optim/base.py", "optim/step.py",
            "optim/grad_stats.py", "optim/loss_scalers.py"} <= touched
    assert touched <= STEP_FILES, f"a step ran code of {sorted(touched - STEP_FILES)}"
