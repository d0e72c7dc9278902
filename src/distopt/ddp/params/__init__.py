"""Sharded params gathered around their use: which modules' params are gathered together, the
hooks that gather and free them in forward and backward, and the module made whole again.

``gather_units.py`` plans the units; ``param_unshard.py`` gathers a unit around its forward
and backward, prefetching the next; ``forward_check.py`` checks that every rank starts the same
forward and backward; ``param_gather.py`` is the forward pre-hooks that wait for whole params'
gathers; ``whole_module.py`` is ``gathered_params()`` and ``full_state_dict()``;
``materialize.py`` gives a meta-device model memory shard by shard; ``module_hooks.py`` the
hook wrapper these install on the user's modules.

Imports, inside ``ddp/``: ``buffers/``, ``state.py``, ``agreements.py`` and ``param_owners.py``;
never ``grads/``, ``torch_compat/`` or the wrapper.
"""
