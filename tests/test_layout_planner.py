"""The DDP and every prediction lay buffers out with one planner ([Note: layout planned once]).

``predict_plan`` (what ``distopt memory`` prints) and a DDP built for real must give the same
buffers, bucket for bucket, and the same bytes per rank: with several dtypes, with whole-tensor
owners, and with DTensor params, whose local shard is what the buffers hold.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import distopt
from distopt.layout.elementwise import TARGET_BUCKETS_GLOO
from distopt.layout.model_layout import ParamSpec, plan_model_layout
from distopt.plan.ownership import plan_of, predict_plan

from dist_harness import case_result, run_cases


class _Cast(nn.Module):
    def __init__(self, layer: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = layer.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.to(self.layer.weight.dtype)).float()


def _mixed_model() -> nn.Module:
    """fp32 and bf16 params: two buffers."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), _Cast(nn.Linear(12, 8), torch.bfloat16),
                         nn.Linear(8, 3))


def _muon_groups(model: nn.Module) -> list[dict]:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [{"params": matrices, "lr": 0.02},
            {"params": rest, "optimizer": torch.optim.AdamW, "lr": 1e-3}]


@pytest.mark.parametrize("whole", [False, True], ids=["element-wise", "muon"])
def test_prediction_is_the_ddps_layout_on_one_process(whole):
    model = _mixed_model()
    ddp = distopt.DistributedDataParallel(model, bucket_size=64, grad_dtype=None)
    groups = _muon_groups(model) if whole else None
    cls = torch.optim.Muon if whole else torch.optim.AdamW
    opt = distopt.DistributedOptimizer(ddp, cls, params=groups, lr=1e-3)
    predicted = predict_plan(model, cls, groups, dp_size=1, grad_dtype=None, bucket_size=64,
                             optimizer_kwargs={"lr": 1e-3})
    assert [b.layout for b in predicted.buffers] == [b.layout for b in ddp.flat_buffers]
    assert [b.grad_dtype for b in predicted.buffers] == [torch.float32, torch.bfloat16]
    assert any(b.layout.whole_tensor for b in ddp.buckets) == whole
    x = torch.randn(4, 6)
    ddp(x).float().square().sum().backward()
    opt.step()  # torch makes the state on the first step; the plan counts it
    assert plan_of(opt).ranks == predicted.ranks
    assert predicted.ranks[0].total == distopt.measure_state_bytes(opt).total


def test_launch_order_follows_backward_across_dtypes():
    # Registration order a(fp32) b(bf16) c(fp32) d(bf16); backward meets d, c, b, a.
    specs = [ParamSpec((8,), torch.float32), ParamSpec((8,), torch.bfloat16),
             ParamSpec((8,), torch.float32), ParamSpec((8,), torch.bfloat16)]
    planned = plan_model_layout(specs, grad_dtype=torch.float32, bucket_size=8, dp_size=1)
    assert [b.param_dtype for b in planned.buffers] == [torch.bfloat16, torch.float32]
    assert [b.param_indices for b in planned.buffers] == [(3, 1), (2, 0)]
    launched = [planned.buffers[b].param_indices[planned.buffers[b].layout.buckets[k]
                                                 .param_indices[0]]
                for b, k in planned.launch_order]
    assert launched == [3, 2, 1, 0]


WORLD = 4


def _tp_prediction_case() -> dict:
    """(dp, tp) = (2, 2): DTensor params hold half their elements on each TP rank."""
    mesh = DeviceMesh("cpu", torch.arange(WORLD).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.LayerNorm(8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    predicted = predict_plan(model, torch.optim.AdamW, dp_size=2,
                             target_buckets=TARGET_BUCKETS_GLOO, optimizer_kwargs={"lr": 1e-3})
    ddp = distopt.DistributedDataParallel(model, device_mesh=mesh)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-3)
    x = torch.randn(4, 8)
    ddp(x).square().sum().backward()
    opt.step()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for p in model.parameters())
    return {
        "same_layout": [b.layout for b in predicted.buffers]
        == [b.layout for b in ddp.flat_buffers],
        "same_bytes": plan_of(opt).ranks == predicted.ranks,
        "measured_total": distopt.measure_state_bytes(opt).total,
        "predicted_total": predicted.ranks[ddp.dp_rank].total,
        "local_numel": local,
        "predicted_numel": predicted.num_params,
    }


@pytest.mark.slow  # four ranks
def test_prediction_counts_dtensor_local_shards():
    results = run_cases(WORLD, [("tp", _tp_prediction_case, ())])
    for r in case_result(results, "tp"):
        assert r["same_layout"] and r["same_bytes"]
        assert r["measured_total"] == r["predicted_total"]
        assert r["predicted_numel"] == r["local_numel"] < 8 * 32 + 32 + 32 * 8 + 8 + 16
