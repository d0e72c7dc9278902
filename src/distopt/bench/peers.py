"""Megatron-Core's DistributedOptimizer and DeepSpeed ZeRO-1/2 as benchmark systems, with the
shims that let them run on a CPU over gloo.

Both are installed by the ``peers`` extra (``make peers``; Megatron-Core needs a special install,
see the Makefile) and imported only when one of these configurations is built, in the
benchmark's and the tests' own processes; the library never imports them. They train the
benchmark's model with torch's ``AdamW`` and the same hyperparameters as the other systems
(``systems.ADAMW``), in fp32, grads averaged over the ranks.

[Note: peers on CPU]
Neither peer changes its arithmetic here; the shims only let code written for CUDA run on a CPU.

Megatron-Core 0.19.2:
- ``import megatron.core`` reaches one module (``transformer/moe/ops/paged_stash.py``) that
  imports ``triton`` unconditionally, for MoE kernels the benchmark never runs. A stand-in
  module with the same names (raising if called) is put in its place when triton is absent;
  a stub ``triton`` package instead would fool torch's own probes for triton.
- The grad and param buffers are allocated on ``torch.cuda.current_device()`` and
  ``start_grad_sync`` asks for ``torch.cuda.current_stream()`` (to wait on CUDA-graph events,
  of which there are none): ``_cuda_calls_on_cpu`` answers ``"cpu"`` and a stream that waits on
  nothing, while Megatron code runs.
- Its optimizer makes a few scalars with ``device="cuda"`` (a found-inf flag, the grad norm)
  and dispatches on ``param.type() == "torch.cuda.FloatTensor"``: while it is built,
  ``_CudaNamesOnCpu``, a torch function mode, makes those tensors on the CPU and names CPU
  tensors' types as their CUDA counterparts; in ``step()``, which only makes scalars, the
  factories ``torch.zeros`` and the like do (a mode there would cost every tensor operation
  of the step a Python call, about 2,000 per step on the benchmark's MLP).
- It is built with explicit process groups (a ``ProcessGroupCollection`` over the benchmark's
  group), not with its global ``parallel_state``; weight decay applies to every param (its
  ``wd_mult`` is applied only by its ``OptimizerParamScheduler``, which is not used), as for
  the other systems; gradient clipping is off (``clip_grad=0``; it still computes the grad
  norm every step, as it does for its users); its inner ``AdamW`` gets ``foreach=True`` like
  the others'.
- Without ``overlap_grad_reduce`` it puts every param in one bucket, whatever ``bucket_size``.

DeepSpeed 0.19.8:
- ``DS_ACCELERATOR=cpu`` selects its CPU accelerator; it is set before the import, and
  ``LOCAL_RANK`` (which its launcher sets) before ``initialize``, which asserts on it.
- ``init_distributed`` compiles a shared-memory all-reduce op (minutes of C++ build) that only
  its inference all-reduce uses; it is marked unavailable so that no op is built.
  ``TORCH_EXTENSIONS_DIR`` defaults to a cache directory of distopt's in case one is.
- The optimizer is a client ``torch.optim.AdamW`` (no fused or CPU Adam op to build).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from distopt._version import pip_install
from distopt.memory import storage_bytes

from .systems import ADAMW, PEER_SYSTEMS, System, _state_tensors

MEGATRON_SYSTEMS = ("megatron", "megatron-overlap")
DEEPSPEED_SYSTEMS = ("deepspeed-z1", "deepspeed-z2", "deepspeed-z2-overlap", "deepspeed-z3")

INSTALL_HINT = (
    f"install the peers with `{pip_install('peers')}`, then `pip install "
    "--ignore-requires-python --no-deps megatron-core==0.19.2` (in a clone: `make peers`)"
)




def missing_peers(systems: list[str]) -> list[str]:
    """The packages that configurations ``systems`` need and this environment lacks."""
    from .._extras import missing

    needs = {"megatron": MEGATRON_SYSTEMS, "deepspeed": DEEPSPEED_SYSTEMS}
    wanted = [package for package, names in needs.items() if set(systems) & set(names)]
    return missing(wanted)


# ------------------------------------------------------------------------------ Megatron-Core


def import_megatron() -> types.SimpleNamespace:
    """Megatron-Core's DDP and optimizer entry points (see [Note: peers on CPU])."""
    _stand_in_for_triton_kernels()
    try:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer import TransformerConfig
    except ImportError as e:
        raise ImportError(f"Megatron-Core is not installed ({e}); {INSTALL_HINT}") from e
    return types.SimpleNamespace(
        DistributedDataParallel=DistributedDataParallel,
        DistributedDataParallelConfig=DistributedDataParallelConfig,
        OptimizerConfig=OptimizerConfig,
        get_megatron_optimizer=get_megatron_optimizer,
        ProcessGroupCollection=ProcessGroupCollection,
        TransformerConfig=TransformerConfig,
    )


def _stand_in_for_triton_kernels() -> None:
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if importlib.util.find_spec("triton") is not None or name in sys.modules:
        return

    def needs_triton(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Megatron-Core's MoE paged stash needs triton")

    stand_in = types.ModuleType(name)
    stand_in.GLOBAL_BLOCK_SIZE = 1024
    stand_in.paged_stash_copy_kernel = stand_in.paged_stash_pop_kernel = needs_triton
    sys.modules[name] = stand_in


class _NoStream:
    """The current "CUDA stream" on a CPU: there is nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass


@contextlib.contextmanager
def _cuda_calls_on_cpu() -> Iterator[None]:
    saved = torch.cuda.current_device, torch.cuda.current_stream
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda device=None: _NoStream()
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.current_stream = saved


class _CudaNamesOnCpu(TorchFunctionMode):
    """Makes ``device="cuda"`` tensors on the CPU and names CPU tensors' types as CUDA's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            on_cpu = args[0].device.type == "cpu"
            return name.replace("torch.", "torch.cuda.", 1) if on_cpu else name
        return func(*args, **kwargs)


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")


@contextlib.contextmanager
def _cuda_factories_on_cpu() -> Iterator[None]:
    # Only the factories pay, not every tensor operation as under a torch function mode.
    saved = {name: getattr(torch, name) for name in _FACTORIES}

    def on_cpu(factory):
        def make(*args: Any, **kwargs: Any) -> torch.Tensor:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    for name, factory in saved.items():
        setattr(torch, name, on_cpu(factory))
    try:
        yield
    finally:
        for name, factory in saved.items():
            setattr(torch, name, factory)


@contextlib.contextmanager
def megatron_built_on_cpu() -> Iterator[None]:
    """Every shim Megatron-Core's constructors need on a CPU, for the duration of the block."""
    with _cuda_calls_on_cpu(), _CudaNamesOnCpu():
        yield


@contextlib.contextmanager
def megatron_stepping_on_cpu() -> Iterator[None]:
    """The shims its ``step()`` needs: no torch function mode, whose Python call on every
    tensor operation (about 2,000 per step here) would be timed as Megatron-Core's."""
    with _cuda_calls_on_cpu(), _cuda_factories_on_cpu():
        yield


class MegatronSystem(System):
    """Megatron-Core's ``DistributedDataParallel`` with its ``DistributedOptimizer``."""

    def __init__(
        self, module: nn.Module, *, name: str, overlap: bool, bucket_size: int | None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        mc = import_megatron()
        self.name = name
        group = group or dist.group.WORLD
        # Each rank alone in every model-parallel dimension: plain data parallelism.
        alone = [dist.new_group([r]) for r in range(dist.get_world_size())]
        me = alone[dist.get_rank()]
        groups = mc.ProcessGroupCollection(
            dp=group, dp_cp=group, intra_dist_opt=group, tp=me, pp=me, ep=me, expt_dp=me,
            mp=me, tp_ep_pp=me,
        )
        first = next(module.parameters())
        config = mc.TransformerConfig(
            num_layers=1, hidden_size=8, num_attention_heads=1, params_dtype=first.dtype
        )
        ddp_config = mc.DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=overlap,
            overlap_param_gather=overlap, bucket_size=bucket_size,
        )
        betas = ADAMW["betas"]
        optimizer_config = mc.OptimizerConfig(
            optimizer="adam", lr=ADAMW["lr"], weight_decay=ADAMW["weight_decay"],
            adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=1e-8, clip_grad=0.0,
            use_distributed_optimizer=True, overlap_param_gather=overlap,
        )
        with megatron_built_on_cpu():
            self.model = mc.DistributedDataParallel(
                config, ddp_config, module, pg_collection=groups
            )
            self.optimizer = mc.get_megatron_optimizer(
                optimizer_config, [self.model], use_gloo_process_groups=False,
                pg_collection=groups,
            )
        for inner in self._inner_optimizers():
            for param_group in inner.param_groups:
                param_group["foreach"] = ADAMW["foreach"]

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [o.optimizer for o in chained]

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def backward(self, loss: torch.Tensor) -> None:
        with _cuda_calls_on_cpu():
            loss.backward()

    def sync(self) -> None:
        with _cuda_calls_on_cpu():
            self.model.finish_grad_sync()

    def step(self) -> None:
        with megatron_stepping_on_cpu():
            self.optimizer.step()

    def finish_param_sync(self) -> None:
        with _cuda_calls_on_cpu():
            self.model.start_param_sync(force_sync=True)

    def state_bytes(self) -> dict[str, int]:
        seen: set[int] = set()
        buffers = [b for b in self.model.buffers if b is not None]
        return {
            # Params are views of the param buffers, grads live in the grad buffers.
            "params": storage_bytes(
                [b.param_data for b in buffers] + list(self.model.parameters()), seen),
            "grads": storage_bytes(
                [b.grad_data for b in buffers]
                + [getattr(p, "main_grad", None) for p in self.model.parameters()], seen),
            "optimizer_state": storage_bytes(
                [t for o in self._inner_optimizers() for t in _state_tensors(o)], seen),
        }


# -------------------------------------------------------------------------------- DeepSpeed


def import_deepspeed() -> types.ModuleType:
    """DeepSpeed on its CPU accelerator, with no C++ op to build (see [Note: peers on CPU])."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(
        os.path.expanduser("~"), ".cache", "distopt", "torch_extensions"))
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(f"DeepSpeed is not installed ({e}); {INSTALL_HINT}") from e
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


class DeepSpeedSystem(System):
    """A DeepSpeed engine with ZeRO stage 1, 2 or 3 and a client ``torch.optim.AdamW``."""

    def __init__(
        self, module: nn.Module, *, name: str, stage: int, overlap: bool,
        bucket_size: int | None, micro_batch: int = 1,
    ) -> None:
        deepspeed = import_deepspeed()
        self.name = name
        # What its launcher would set; the process group itself already exists.
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        deepspeed.init_distributed("gloo")
        zero: dict[str, Any] = {"stage": stage, "overlap_comm": overlap}
        if bucket_size is not None:
            zero.update(reduce_bucket_size=bucket_size, allgather_bucket_size=bucket_size)
        config = {
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "gradient_clipping": 0.0,
            "steps_per_print": 2**31,
            "wall_clock_breakdown": False,
        }
        optimizer = torch.optim.AdamW(module.parameters(), **ADAMW)
        self.model, self.optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=config
        )

    def zero_grad(self) -> None:
        """The engine's ``step`` clears the grads."""

    def full_params(self) -> list[torch.Tensor]:
        params = list(self.model.module.parameters())
        if not hasattr(self.optimizer, "fp32_partitioned_groups_flat"):
            return [p.detach().clone() for p in params]
        # ZeRO-3 keeps a partition of each param: gathered for the copy.
        with import_deepspeed().zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss)

    def step(self) -> None:
        self.model.step()

    def state_bytes(self) -> dict[str, int]:
        seen: set[int] = set()
        zero = self.optimizer
        params = list(self.model.module.parameters())
        if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3: params partitioned too
            return {
                "params": storage_bytes(list(zero.fp16_partitioned_groups_flat)
                                        + [p.ds_tensor for p in params], seen),
                "main_params": storage_bytes(list(zero.fp32_partitioned_groups_flat), seen),
                "grads": storage_bytes(
                    [zero.grad_partitions_flat_buffer]
                    + [m.grad for m in zero.fp32_partitioned_groups_flat]
                    + _tensors_in(getattr(zero, "averaged_gradients", {})), seen),
                "optimizer_state": storage_bytes(_state_tensors(zero.optimizer), seen),
            }
        master = list(zero.single_partition_of_fp32_groups)
        grads = [p.grad for p in params] + [m.grad for m in master]
        grads += _tensors_in(getattr(zero, "averaged_gradients", {}))
        grads += _tensors_in(getattr(zero, "ipg_buffer", None))
        grads += _tensors_in(getattr(zero, "grads_in_partition", None))
        return {
            "params": storage_bytes(list(zero.bit16_groups_flat) + params, seen),
            "main_params": storage_bytes(master, seen),
            "grads": storage_bytes(grads, seen),
            "optimizer_state": storage_bytes(_state_tensors(zero.optimizer), seen),
        }


def _tensors_in(value: Any) -> list[torch.Tensor]:
    # The tensors in a tensor, or in a list or dict of (lists of) tensors.
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def build_peer_system(
    name: str, module: nn.Module, device: torch.device, *, bucket_size: int | None = None
) -> System:
    """Wrap ``module`` as peer configuration ``name`` (one of ``PEER_SYSTEMS``)."""
    if device.type != "cpu":
        raise ValueError(f"{name} runs here on the CPU only (see [Note: peers on CPU])")
    if name in MEGATRON_SYSTEMS:
        return MegatronSystem(module, name=name, overlap=name == "megatron-overlap",
                              bucket_size=bucket_size)
    if name in DEEPSPEED_SYSTEMS:
        stage = {"deepspeed-z1": 1, "deepspeed-z3": 3}.get(name, 2)
        return DeepSpeedSystem(module, name=name, stage=stage,
                               overlap=name.endswith("overlap"), bucket_size=bucket_size)
    raise ValueError(f"unknown peer system {name!r}; choose from {', '.join(PEER_SYSTEMS)}")
