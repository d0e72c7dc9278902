"""What happens to a grad after autograd made it: the grad sync of one step, and what ``p.grad``
answers afterwards.

``grad_sync.py`` runs a step's grads: the hooks' work, the launch order of the buckets'
reductions, the end of backward, ``finish_grad_sync``; ``nan_check.py`` checks for non-finite
grads and ``unused_params.py`` handles the params that got none. ``grad_marker.py`` and
``grad_markers.py`` are ``p.grad`` of a trained param (a tensor without storage answered from
the reduced grads), ``grad_reads.py`` its statistics agreed over the ranks and its writes on
each rank's piece, ``grad_reductions.py`` the reductions the statistics do not answer,
``grad_messages.py`` the refusals' words ([Note: p.grad under distopt]).

Imports, inside ``ddp/``: ``buffers/``, ``state.py`` and ``agreements.py``; never ``params/``,
``torch_compat/`` or the wrapper.
"""
