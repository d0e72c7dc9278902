"""distopt: a Megatron-style distributed optimizer (ZeRO-1/2) for PyTorch."""

__all__: list[str] = []
