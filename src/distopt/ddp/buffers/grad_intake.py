"""Grads in the forms autograd hands the grad hook besides a plain dense tensor, written into
a bucket as torch DDP reduces them.

[Note: grads as torch DDP takes them]
The grad hook (ddp/grads/grad_sync.py) moves each grad into its bucket's slot, ``param.main_grad``,
a dense view of the grad buffer (or of a pool buffer, with sharded grads). Two forms of grad
need more than ``copy_``/``add_``, and torch DDP reduces both:

* ``loss.backward(create_graph=True)``: the grad carries a graph of its own (it requires
  grad). torch DDP reduces it detached (its reducer copies ``grad.detach()`` into the bucket,
  and the higher-order grad is not synchronized); distopt does the same. Writing it as it is
  into a view made under ``no_grad`` would be an in-place op that autograd forbids ("A view was
  created in no_grad mode..."). The grad's graph is dropped with ``p.grad`` once the grad is in
  the bucket, which also breaks the reference cycle torch warns about for
  ``backward(create_graph=True)``.
* sparse grads (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``): the bucket
  holds every grad dense, so a sparse grad is added into its slot (zeroed first where it is the
  step's first grad of the param). The slot is a dense grad of the param's size, which the
  buffer holds for every param anyway; the write costs a pass over the slot to zero it and a
  scatter-add of the grad's rows, and the reduction then moves the whole dense slot, where
  torch DDP all-reduces the sparse rows alone (far fewer bytes for a large table of which a
  batch reaches few rows). The step sees the same averaged grad as torch DDP's, dense: an
  optimizer that refuses sparse grads (AdamW) takes it too.

Plain dense grads, the hot path, never come here (``Bucket.add_grad`` checks two flags).
"""

from __future__ import annotations

import torch


def write_grad(slot: torch.Tensor, grad: torch.Tensor, *, add: bool) -> None:
    """Write (or with ``add`` add) ``grad``, which requires grad or is sparse, into ``slot``,
    the param's dense view of its bucket; see [Note: grads as torch DDP takes them]."""
    grad = grad.detach()
    if grad.layout is torch.strided:
        slot.add_(grad) if add else slot.copy_(grad)
        return
    if not add:
        slot.zero_()
    slot.add_(grad.to(slot.dtype))  # a scatter-add of the rows: duplicates sum, as torch's
