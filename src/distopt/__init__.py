"""distopt: a Megatron-style distributed optimizer (ZeRO-1/2) for PyTorch."""

from .ddp import DistributedDataParallel
from .memory import MemoryReport, measure_state_bytes, theoretical_bytes_per_param
from .optimizer import BasicOptimizer, DistributedOptimizer, StepResult
from .scaler import ConstantLossScaler, DynamicLossScaler

__all__ = [
    "BasicOptimizer",
    "ConstantLossScaler",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "MemoryReport",
    "StepResult",
    "measure_state_bytes",
    "theoretical_bytes_per_param",
]
