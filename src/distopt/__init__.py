"""distopt: a Megatron-style distributed optimizer (ZeRO-1/2) for PyTorch."""

from . import _torch_import  # noqa: F401  (first: torch without a warning about numpy)
from ._version import __version__
from .checkpoint import (
    CheckpointError,
    export_checkpoint,
    has_checkpoint,
    load_checkpoint,
    load_plain_checkpoint,
    save_checkpoint,
)
from .ddp.wrapper import DistributedDataParallel
from .memory import (
    MemoryReport,
    TransientBound,
    measure_state_bytes,
    theoretical_bytes_per_param,
    transient_bound,
)
from .optim.kinds import register_elementwise_optimizer, register_whole_tensor_optimizer
from .optim.loss_scalers import ConstantLossScaler, DynamicLossScaler
from .optim.optimizers import BasicOptimizer, DistributedOptimizer, StepResult
from .parallel.experts import ExpertParallel

__all__ = [
    "BasicOptimizer",
    "CheckpointError",
    "ConstantLossScaler",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "ExpertParallel",
    "MemoryReport",
    "StepResult",
    "export_checkpoint",
    "has_checkpoint",
    "load_checkpoint",
    "load_plain_checkpoint",
    "measure_state_bytes",
    "transient_bound",
    "TransientBound",
    "register_elementwise_optimizer",
    "register_whole_tensor_optimizer",
    "save_checkpoint",
    "theoretical_bytes_per_param",
    "__version__",
]
