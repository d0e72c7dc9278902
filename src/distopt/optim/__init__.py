"""The parts of ``DistributedOptimizer`` and ``BasicOptimizer`` (their public classes live in
``distopt.optim.optimizers``): the table of optimizer classes, param groups and the inner torch
optimizers, the fp32 main params of a rank's shard, the grad statistics and the step."""
