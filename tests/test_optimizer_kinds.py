"""Which optimizer classes distopt shards and how, on one process: the kinds, the costs, the
"optimizer" key of a param group, and the errors for what cannot be sharded."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import distopt
from distopt.optim.kinds import (
    check_optimizer_cls,
    newton_schulz_shape_cost,
    numel_cost,
    whole_tensor_cost,
)


class WholeAdamW(torch.optim.AdamW):
    """A user's class that wants whole params (here AdamW, so its results can be checked)."""


distopt.register_whole_tensor_optimizer(WholeAdamW)


class NotAnOptimizer:
    pass


class HomeMade(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def test_kinds_follow_the_class_hierarchy():
    assert whole_tensor_cost(torch.optim.Muon) is newton_schulz_shape_cost
    assert whole_tensor_cost(torch.optim.Adafactor) is numel_cost
    assert whole_tensor_cost(WholeAdamW) is numel_cost
    assert whole_tensor_cost(type("MyMuon", (torch.optim.Muon,), {})) is newton_schulz_shape_cost
    assert whole_tensor_cost(torch.optim.AdamW) is None
    assert whole_tensor_cost(type("MyAdam", (torch.optim.Adam,), {})) is None
    # max(m, n) * min(m, n)**2, whichever way round.
    assert newton_schulz_shape_cost((7, 3)) == newton_schulz_shape_cost((3, 7)) == 63.0
    assert numel_cost((7, 3)) == 21.0


@pytest.mark.parametrize(
    "cls,message",
    [
        (torch.optim.LBFGS, "LBFGS cannot be stepped by distopt: its step re-evaluates"),
        (torch.optim.SparseAdam, "SparseAdam cannot be stepped by distopt: it steps sparse"),
        (type("MyLBFGS", (torch.optim.LBFGS,), {}), "MyLBFGS cannot be stepped"),
        (torch.optim.AdamW(nn.Linear(1, 1).parameters()), "the class, not an instance"),
        (NotAnOptimizer, "must be a torch.optim.Optimizer subclass"),
    ],
)
def test_refused_classes_say_why_and_what_to_do(cls, message):
    with pytest.raises(TypeError, match=message):
        check_optimizer_cls(cls)
    model = _model()
    ddp = distopt.DistributedDataParallel(model)
    with pytest.raises(TypeError, match=message):
        distopt.DistributedOptimizer(ddp, cls, lr=0.1)
    with pytest.raises(TypeError, match="param group 1's \"optimizer\""):
        distopt.DistributedOptimizer(ddp, torch.optim.AdamW, params=[
            {"params": [model[0].weight]}, {"params": [model[2].weight], "optimizer": cls}])


def test_a_class_no_one_declared_is_owned_whole_by_its_elements():
    assert whole_tensor_cost(HomeMade) is numel_cost
    check_optimizer_cls(HomeMade)
    ddp = distopt.DistributedDataParallel(_model())
    opt = distopt.DistributedOptimizer(ddp, HomeMade, lr=0.1)
    assert all(b.layout.whole_tensor for b in ddp.buckets)
    assert [m.shape for m in opt.main_params] == [p.shape for p in ddp.module.parameters()]


def test_register_takes_classes_only():
    with pytest.raises(TypeError, match="takes a torch.optim.Optimizer subclass"):
        distopt.register_whole_tensor_optimizer(NotAnOptimizer)  # type: ignore[arg-type]


def test_whole_tensor_mains_have_the_param_shape_and_state():
    model = _model()
    ddp = distopt.DistributedDataParallel(model, bucket_size=40)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.Muon, params=[
        {"params": [model[0].weight, model[2].weight], "lr": 0.02},
        {"params": [model[0].bias, model[2].bias], "optimizer": torch.optim.AdamW, "lr": 1e-3},
    ])
    assert [type(o) for o in opt.optimizers] == [torch.optim.Muon, torch.optim.AdamW]
    assert opt.optimizer is opt.optimizers[0]
    assert [tuple(m.shape) for m in opt.main_params] == [(7, 5), (3, 7), (7,), (3,)]
    # The groups are the inner optimizers' own dicts, in the order given.
    assert opt.param_groups[0] is opt.optimizers[0].param_groups[0]
    assert opt.param_groups[1] is opt.optimizers[1].param_groups[0]
    assert opt.param_groups[1]["optimizer"] is torch.optim.AdamW
    assert all(o.state is opt.state for o in opt.optimizers)
    assert {b.layout.whole_tensor for b in ddp.buckets} == {True, False}
    opt.zero_grad()
    ddp(torch.randn(2, 5)).square().sum().backward()
    opt.step()
    shapes = {k: tuple(v.shape) for main in opt.main_params for k, v in opt.state[main].items()}
    assert shapes["momentum_buffer"] in {(7, 5), (3, 7)} and shapes["exp_avg"] in {(7,), (3,)}


def test_an_lr_scheduler_drives_every_class():
    model = _model()
    ddp = distopt.DistributedDataParallel(model)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.Muon, params=[
        {"params": [model[0].weight], "lr": 0.02},
        {"params": [model[0].bias], "optimizer": torch.optim.AdamW, "lr": 1e-3},
    ])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(2, 5)).square().sum().backward()
        opt.step()
        sched.step()
    assert opt.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.02 / 8)
    assert opt.optimizers[1].param_groups[0]["lr"] == pytest.approx(1e-3 / 8)


def test_user_declared_class_owns_whole_params_and_steps_like_the_plain_class():
    model = _model()
    twin = copy.deepcopy(model)
    runs = []
    for module, cls in ((model, WholeAdamW), (twin, torch.optim.AdamW)):
        ddp = distopt.DistributedDataParallel(module, bucket_size=40)
        runs.append((ddp, distopt.DistributedOptimizer(ddp, cls, lr=1e-2)))
    (whole_ddp, whole_opt), (_, plain_opt) = runs
    assert all(b.layout.whole_tensor for b in whole_ddp.buckets)
    assert [m.shape for m in whole_opt.main_params] == [p.shape for p in model.parameters()]
    for _ in range(3):
        x = torch.randn(2, 5)
        for ddp, opt in runs:
            opt.zero_grad()
            ddp(x).square().sum().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_buffers_are_laid_out_once_for_the_optimizer_and_never_again():
    """See [Note: layout planned once]: a forward leaves the layout open, the optimizer fixes
    it with its owners, and anything that needs other owners afterwards is refused."""
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    ddp = distopt.DistributedDataParallel(model, bucket_size=40)
    ddp(torch.randn(2, 5))  # a forward alone lays nothing out
    opt = distopt.DistributedOptimizer(ddp, torch.optim.Muon, params=[
        {"params": [model[0].weight], "lr": 0.02}])
    assert ddp.whole_tensor_costs == {model[0].weight: 7 * 5 * 5}
    for p, value in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, value)
        # A view into the buffer, which the gathers write.
        buffer = ddp.buffer_of[p].param_data
        assert p.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    # An optimizer that needs other owners is refused: the layout is never redone.
    del opt
    with pytest.raises(ValueError, match="laid out once"):
        distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-3)
    assert ddp.whole_tensor_costs == {model[0].weight: 7 * 5 * 5}

    # A backward before any optimizer lays the buffers out element-wise, so a whole-tensor
    # optimizer built after it is refused, with the fix named.
    model = _model()
    ddp = distopt.DistributedDataParallel(model, bucket_size=40)
    ddp(torch.randn(2, 5)).square().sum().backward()
    assert not any(b.layout.whole_tensor for b in ddp.buckets)
    with pytest.raises(ValueError, match="build the optimizer right after"):
        distopt.DistributedOptimizer(ddp, torch.optim.Muon, params=[
            {"params": [model[0].weight], "lr": 0.02}])
    # An element-wise optimizer agrees with that layout and trains on the grads already there.
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-3)
    assert opt.step().updated


def test_whole_tensor_params_are_costed_by_the_table_of_classes():
    """``DistributedDataParallel(whole_tensor_params=...)`` lays the buffers out before any
    optimizer, with the costs of the table of classes (a user's declared class too); the
    optimizer then finds its owners laid out. An element-wise class or a tensor that is not a
    trainable param is refused, by name."""
    model = _model()
    ddp = distopt.DistributedDataParallel(model, bucket_size=40, whole_tensor_params={
        model[0].weight: torch.optim.Muon, model[2].weight: WholeAdamW})
    assert ddp.whole_tensor_costs == {model[0].weight: 7 * 5 * 5, model[2].weight: 3 * 7}
    distopt.DistributedOptimizer(ddp, torch.optim.AdamW, params=[
        {"params": [model[0].weight], "optimizer": torch.optim.Muon, "lr": 0.02},
        {"params": [model[2].weight], "optimizer": WholeAdamW},
        {"params": [model[0].bias, model[2].bias]}], lr=1e-3)
    model = _model()
    with pytest.raises(ValueError, match="gives parameter '0.bias' AdamW, which shards element"):
        distopt.DistributedDataParallel(model, whole_tensor_params={
            model[0].bias: torch.optim.AdamW})
    with pytest.raises(ValueError, match="not a trainable parameter of this model"):
        distopt.DistributedDataParallel(model, whole_tensor_params={
            nn.Parameter(torch.zeros(2)): torch.optim.Muon})
