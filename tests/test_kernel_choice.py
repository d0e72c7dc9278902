"""The inner optimizer's kernel: fused on CUDA where torch has one, foreach otherwise, and the
user's own choice whenever given; loads keep the loading optimizer's kernel. Runs on the CPU:
the choice reads only the device's type."""

from __future__ import annotations

import copy

import pytest
import torch

import distopt
from distopt.optim.kinds import ELEMENTWISE_OPTIMIZERS
from distopt.optim.param_groups import default_kernel_kwargs

from models import AwkwardLM, batches

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
NOT_FUSED = tuple(c for c in ELEMENTWISE_OPTIMIZERS if c not in FUSED)


class NoKernelOptions(torch.optim.Adam):
    """A subclass whose constructor takes neither keyword."""

    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, lr=lr)


@pytest.fixture(autouse=True)
def no_cuda_calls(monkeypatch):
    """The choice must not ask CUDA anything (it runs at construction, on any machine)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the kernel choice touched torch.cuda")

    for name in ("is_available", "device_count", "current_device", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, refuse)


def test_fused_kernels_exist_for_exactly_these_classes():
    # The classes whose constructor takes `fused` in this torch; the choice below relies on it.
    import inspect

    has_fused = {c for c in ELEMENTWISE_OPTIMIZERS
                 if "fused" in inspect.signature(c.__init__).parameters}
    assert has_fused == set(FUSED)


@pytest.mark.parametrize("cls", ELEMENTWISE_OPTIMIZERS, ids=lambda c: c.__name__)
def test_cpu_default_is_foreach(cls):
    assert default_kernel_kwargs(cls, CPU, {}) == {"foreach": True}
    assert default_kernel_kwargs(cls, CPU, {"lr": 0.1}) == {"foreach": True}


@pytest.mark.parametrize("cls", FUSED, ids=lambda c: c.__name__)
def test_cuda_default_is_fused(cls):
    assert default_kernel_kwargs(cls, CUDA, {}) == {"fused": True}
    assert default_kernel_kwargs(cls, torch.device("cuda", 1), {"lr": 0.1}) == {"fused": True}


@pytest.mark.parametrize("cls", NOT_FUSED, ids=lambda c: c.__name__)
def test_cuda_default_without_a_fused_kernel_is_foreach(cls):
    assert default_kernel_kwargs(cls, CUDA, {}) == {"foreach": True}


@pytest.mark.parametrize("device", [CPU, CUDA], ids=["cpu", "cuda"])
@pytest.mark.parametrize("user", [{"foreach": True}, {"foreach": False}, {"foreach": None},
                                  {"fused": True}, {"foreach": True, "fused": True},
                                  {"foreach": False, "fused": False}])
def test_a_choice_given_is_left_alone(device, user):
    assert default_kernel_kwargs(torch.optim.AdamW, device, user) == {}


@pytest.mark.parametrize("device", [CPU, CUDA], ids=["cpu", "cuda"])
@pytest.mark.parametrize("fused", [False, None])
def test_not_fused_still_gets_foreach(device, fused):
    assert default_kernel_kwargs(torch.optim.AdamW, device, {"fused": fused}) == {"foreach": True}


@pytest.mark.parametrize("device", [CPU, CUDA], ids=["cpu", "cuda"])
def test_classes_without_the_keywords_get_nothing(device):
    assert default_kernel_kwargs(NoKernelOptions, device, {}) == {}


def _opt(**kwargs) -> distopt.DistributedOptimizer:
    torch.manual_seed(0)
    ddp = distopt.DistributedDataParallel(AwkwardLM(), bucket_size=40,
                                          find_unused_parameters=True)
    return distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2, **kwargs)


def _step(opt: distopt.DistributedOptimizer, step: int = 0) -> None:
    tokens, targets = batches(step)
    opt.zero_grad()
    logits = opt.models[0](tokens, use_sometimes=True)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    opt.step()


def _kernel(opt: distopt.DistributedOptimizer) -> tuple:
    return tuple((g["foreach"], g["fused"]) for g in opt.param_groups)


@pytest.mark.parametrize("kwargs,kernel", [
    ({}, (True, None)),
    ({"foreach": False}, (False, None)),
    ({"fused": True}, (None, True)),
    ({"fused": False}, (True, False)),
])
def test_optimizers_on_the_cpu(kwargs, kernel):
    opt = _opt(**kwargs)
    assert _kernel(opt) == (kernel,)
    _step(opt)  # and the kernel runs


def test_both_kernels_at_once_is_torchs_error():
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        _opt(foreach=True, fused=True)


def test_state_dict_loads_keep_the_loaders_kernel():
    fused = _opt(fused=True)
    _step(fused)
    state = copy.deepcopy(fused.state_dict())
    plain = _opt()
    plain.load_state_dict(state)
    assert _kernel(plain) == ((True, None),)
    _step(plain, 1)  # the step counts are where the foreach kernel wants them
    fused.load_state_dict(copy.deepcopy(plain.state_dict()))
    assert _kernel(fused) == ((None, True),)
    _step(fused, 2)
