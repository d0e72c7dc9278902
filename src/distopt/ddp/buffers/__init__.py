"""Where a DDP's params and grads live: the contiguous buffers of one dtype, their buckets, and
what each bucket holds between steps.

``buffer.py`` holds a dtype's ``param_data`` and ``grad_data``; ``bucket.py`` a range of both
and its step (its reduction and its gather in flight); ``grad_storage.py`` and ``grad_pool.py``
where a bucket's grads live (the full buffer, or a kept shard and the few buffers its grads
borrow while reduced); ``param_storage.py`` where its params live (the whole buffer, or a shard
gathered around each use), with ``param_placeholder.py`` (a sharded param between uses),
``gathered_views.py`` (views of a gathered buffer that outlive it) and ``rebound_params.py``
(params whose ``.data`` a script rebound); ``grad_intake.py`` how a grad enters its bucket.

Imports, inside ``ddp/``: ``state.py`` and ``agreements.py`` only. The grad path (``grads/``),
the param gathers (``params/``) and the wrapper build on these rooms, never the reverse.
"""
