"""Views of a gathered bucket kept past its gather: their bytes stay theirs, never freed under them.

[Note: views that outlive a gather]
With sharded params a bucket's full params live in a buffer whose storage is resized to nothing
when the bucket is freed and back when it is gathered again ([Note: sharded params] in
ddp/buffers/param_storage.py). Every tensor that views that storage sees the resize: a state dict
taken inside ``with ddp.gathered_params():`` (its entries are ``param.detach()``, views of the
buffer), ``p.detach()`` or ``p.data`` kept from inside the block, from a forward or from a
hook. Read after the free, such a view points at no bytes: torch reads freed memory (a
segfault, or garbage), and ``torch.save`` writes a storage that ``torch.load`` refuses to
rebuild ("Trying to resize storage that is not resizable"). torch's DDP has no such tensor:
its params always hold their bytes, and so do their views.

So when a bucket is freed, the params are first made placeholders (they no longer view the buffer),
and then the buffer's storage is asked who else holds it (its use count, one C call). Nobody: it is
resized to nothing, as before. Somebody: the storage is left to them, whole, with the values it
holds, and the bucket takes a fresh, empty storage for its next gather. The views stay readable and
saveable, and free their bytes when the last of them goes, as any torch tensor does; nothing is
copied, and a step that keeps no view pays only the count. The pool counts the storages it left so
(``ParamPool.left_to_views``); a training step leaves none.

The one holder that must not be given the storage is autograd: a forward that frees its units
(``reshard_after_forward=True``) leaves its saved ``weight.t()`` views pointing into the buffer,
and its backward gathers the bucket again into the same storage for them to read. So:

* the free at the end of a forward with grad enabled always resizes (autograd holds views then,
  and they must see the gather of the backward);
* a free inside a backward that keeps its graph (``retain_graph=True``, ``create_graph=True``)
  resizes too: the kept graph's saved views will read the next gather, as after a forward;
* every other free (once a bucket's grads are in, at the end of a backward or a step, at the
  end of ``gathered_params()``, in a forward under ``no_grad``, at ``release()``) leaves the
  storage to whatever still views it: a backward that does not keep its graph has let go of
  the saved views of every node it ran.

What is left uncovered is a view kept from a forward that frees its units and read before that
forward's backward gathers them again (or after a backward that keeps its graph): its bytes are
freed then, as autograd's are. ``p.detach().clone()`` there holds its own bytes.
"""

from __future__ import annotations

import torch


def viewed_elsewhere(full: torch.Tensor) -> bool:
    """Whether a tensor other than ``full`` still views ``full``'s storage (the params no
    longer do: they are placeholders or hold storage of their own by then)."""
    storage = full.untyped_storage()
    # ``full`` holds one reference, the storage object read here another.
    return torch._C._storage_Use_Count(storage._cdata) > 2


def backward_keeps_graph() -> bool:
    """Whether a backward runs now that keeps its graph (its saved views will be read again)."""
    return (torch._C._current_graph_task_id() != -1
            and torch._C._autograd._get_current_graph_task_keep_graph())
