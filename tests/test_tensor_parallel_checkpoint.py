"""Checkpoints of tensor-parallel models reshard along DP and along TP.

One 4-rank group trains a block parallelized over a (dp=2, tp=2) mesh for 5 steps, saves, and
trains 5 more: the reference. In the same group the checkpoint is loaded at dp=4 into a plain
(non-DTensor) model and at dp=4 over a tp=1 mesh, and at dp=2, tp=2 again; a 2-rank group loads
it at dp=1, tp=2. Each resumed run trains the same 5 steps and must match the reference's full
params after every step. The block's row-wise weights (Shard(1)) make ZeRO pieces that are
row segments of the global tensor, so the flat-offset mapping is exercised, not just Shard(0).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import distopt
from distopt.checkpoint.dcp import read_metadata
from distopt.checkpoint.tp_runs import piece_runs

from checkpoint_index import untiled_keys
from dist_harness import case_result, run_cases
from helpers import FP32_TOL, full
from models import TP_BATCH, Block, batch, tp_plan

# Every case runs on four ranks: the quick loop (-m "not slow") keeps to two.
pytestmark = pytest.mark.slow

STEPS = 5  # AdamW: within helpers.FP32_TOL, the drift of its fp32 roundoff
LR, WD = 1e-2, 0.1


def build(dp: int, tp: int | None, seed: int) -> tuple[nn.Module, distopt.DistributedDataParallel,
                                                       distopt.DistributedOptimizer, int]:
    """A block at (dp, tp) on the first dp * tp ranks; tp=None: a plain module over DP only.

    ``seed`` differs between the saving and the loading runs, so a load that missed an element
    leaves a visibly different value there.
    """
    torch.manual_seed(seed)
    model = Block()
    if tp is None:
        ddp = distopt.DistributedDataParallel(model, bucket_size=100)
        dp_rank = dist.get_rank()
    else:
        mesh = DeviceMesh("cpu", torch.arange(dp * tp).reshape(dp, tp),
                          mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan())
        ddp = distopt.DistributedDataParallel(model, device_mesh=mesh, bucket_size=100)
        dp_rank = mesh.get_coordinate()[0]
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=LR, weight_decay=WD,
                                       overlap_param_gather=True)
    return model, ddp, opt, dp_rank


def train(model, ddp, opt, dp: int, dp_rank: int, steps: range) -> list[list[torch.Tensor]]:
    """Train ``steps`` on this rank's DP slice; the full params after each step."""
    out = []
    per = TP_BATCH // dp
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        mine = slice(dp_rank * per, (dp_rank + 1) * per)
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        if isinstance(ddp, distopt.DistributedDataParallel):  # torch's DDP: in place already
            ddp.finish_param_sync()
        out.append([full(p).clone() for p in model.parameters()])
    return out


def worst(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    return max((x - y).abs().max().item() for xs, ys in zip(a, b, strict=True)
               for x, y in zip(xs, ys, strict=True))


def save_and_reference(path: str) -> dict:
    """dp=2, tp=2: 5 steps, save, 5 more steps (the reference)."""
    model, ddp, opt, dp_rank = build(2, 2, seed=0)
    train(model, ddp, opt, 2, dp_rank, range(STEPS))
    saved = [full(p).clone() for p in model.parameters()]
    distopt.save_checkpoint(path, ddp, opt, extra={"step": STEPS})
    reference = train(model, ddp, opt, 2, dp_rank, range(STEPS, 2 * STEPS))
    return {"saved": saved, "reference": reference}


def resume(path: str, dp: int, tp: int | None, saved: list, reference: list) -> dict:
    """Load the checkpoint at (dp, tp), then train the reference's last 5 steps."""
    model, ddp, opt, dp_rank = build(dp, tp, seed=1)
    before = worst([[full(p).clone() for p in model.parameters()]], [saved])
    extra = distopt.load_checkpoint(path, ddp, opt)
    loaded = worst([[full(p).clone() for p in model.parameters()]], [saved])
    resumed = train(model, ddp, opt, dp, dp_rank, range(STEPS, 2 * STEPS))
    return {"extra": extra, "before": before, "loaded": loaded,
            "max_diff": worst(resumed, reference),
            "dtensors": sum(isinstance(p, DTensor) for p in model.parameters())}


def resume_all(path: str) -> dict:
    ref = save_and_reference(path)
    out = {"ref": ref}
    for name, dp, tp in [("dp4_plain", 4, None), ("dp4_tp1", 4, 1), ("dp2_tp2", 2, 2)]:
        out[name] = resume(path, dp, tp, ref["saved"], ref["reference"])
    return out


def refuses_a_mesh_short_of_the_world(path: str) -> str:
    """dp=1, tp=2 on ranks {0, 1} and on {2, 3}: a TP checkpoint spans every rank, so both
    pairs would write one checkpoint; refused on every rank before any collective."""
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    torch.manual_seed(0)
    model = Block()
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("pair", "tp"))
    parallelize_module(model, mesh["tp"], tp_plan())
    ddp = distopt.DistributedDataParallel(model, process_group=singles[dist.get_rank()])
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=LR)
    messages = []
    for call in (distopt.save_checkpoint, distopt.load_checkpoint):
        with pytest.raises(ValueError, match="is not the world") as info:
            call(path, ddp, opt)
        messages.append(str(info.value))
    return messages[0]


def runs_map_every_piece() -> int:
    """piece_runs against the truth for every range [a, b) of the local shard, over 2-D meshes
    that shard one dim twice, two dims, or replicate, for 1-, 2- and 3-D tensors."""
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    checked = 0
    for shape in [(7,), (6, 10), (8, 5), (4, 6, 2)]:
        for placements in [(Shard(0), Shard(1)), (Shard(1), Shard(0)), (Replicate(), Shard(0)),
                           (Shard(0), Shard(0)), (Replicate(), Replicate()),
                           (Shard(len(shape) - 1), Replicate())]:
            if any(isinstance(p, Shard) and p.dim >= len(shape) for p in placements):
                continue
            whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float32)
            param = nn.Parameter(distribute_tensor(whole.reshape(shape), mesh, placements))
            local = param.to_local().reshape(-1)
            for a in range(local.numel() + 1):
                for b in range(a, local.numel() + 1):
                    got = torch.full((b - a,), -1.0)
                    for i, g, n in piece_runs(param, a, b):
                        got[i : i + n] = whole[g : g + n]
                    assert torch.equal(got, local[a:b]), (shape, placements, a, b)
                    checked += 1
    return checked


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> tuple[str, list[dict]]:
    path = str(tmp_path_factory.mktemp("tp_ckpt") / "run")
    results = run_cases(4, [("resume_all", resume_all, (path,)),
                            ("refuses", refuses_a_mesh_short_of_the_world, (path,)),
                            ("runs", runs_map_every_piece, ())])
    return path, case_result(results, "resume_all"), results


@pytest.mark.parametrize(
    ("name", "dtensors"), [("dp4_plain", 0), ("dp4_tp1", 11), ("dp2_tp2", 11)]
)
def test_resumes_at_another_layout_like_the_uninterrupted_run(four, name, dtensors):
    _, values, _ = four
    for rank, value in enumerate(values):
        result = value[name]
        assert result["dtensors"] == dtensors
        assert result["extra"] == {"step": STEPS}
        assert result["before"] > 1e-2, rank  # another init: the load has something to do
        assert result["loaded"] == 0.0, rank
        assert result["max_diff"] <= FP32_TOL, (rank, result["max_diff"])


def test_resumes_at_dp1_tp2(four):
    path, values, _ = four
    ref = values[0]["ref"]
    results = run_cases(2, [("resume", resume, (path, 1, 2, ref["saved"], ref["reference"]))])
    for rank, result in enumerate(case_result(results, "resume")):
        assert result["dtensors"] == 11
        assert result["before"] > 1e-2, rank
        assert result["loaded"] == 0.0, rank
        assert result["max_diff"] <= FP32_TOL, (rank, result["max_diff"])


def test_export_holds_the_global_tensors(four, tmp_path):
    path, values, _ = four
    out = distopt.export_checkpoint(path, tmp_path / "plain.pt")
    model = torch.load(out, weights_only=True)["model"]
    names = [n for n, _ in Block().named_parameters()]
    assert list(model) == [n for n in Block().state_dict()]
    for name, saved in zip(names, values[0]["ref"]["saved"], strict=True):
        assert torch.equal(model[name], saved), name


def test_refuses_a_tp_mesh_short_of_the_world(four):
    messages = case_result(four[2], "refuses")
    assert all("(1 ranks) times the tensor-parallel mesh (2 ranks)" in m for m in messages)


def test_piece_runs_map_local_pieces_to_global_offsets(four):
    assert all(n > 1000 for n in case_result(four[2], "runs"))


def test_every_element_is_written_exactly_once(four):
    """In torch's layout each param's entry (its fp32 master under ``model``, AdamW's moments
    under ``optimizer``) has the param's global shape, and its chunks cover it exactly once;
    replicated params (LayerNorms, row-wise biases) come from the files of TP coordinate 0
    (ranks 0 and 2)."""
    path, _, _ = four
    checkpoint = distopt.checkpoint.files.resolve(path)
    metadata = read_metadata(checkpoint)
    index = metadata.state_dict_metadata
    shapes = {n: p.shape for n, p in Block().named_parameters()}
    keys = {f"model.{n}": n for n in shapes} | {
        f"optimizer.state.{n}.{moment}": n
        for n in shapes for moment in ("exp_avg", "exp_avg_sq")}
    assert set(keys) <= set(index)
    for key, name in keys.items():
        assert index[key].size == shapes[name], key
    assert not set(untiled_keys(checkpoint)) & set(keys)
    replicated = {"ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "o.bias", "fc2.bias"}
    writers = {metadata.storage_data[i].relative_path[:4] for i in metadata.storage_data
               if i.fqn in keys and keys[i.fqn] in replicated}
    assert writers == {"__0_", "__2_"}
