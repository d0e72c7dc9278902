"""``requires_grad`` turned off and on after wrapping: what a frozen param gets, and the one
change that is refused.

[Note: params frozen after wrapping]
GAN loops freeze a network while another's loss goes back through it and unfreeze it for its
own update: pix2pix's and CycleGAN's ``set_requires_grad(netD, False)`` around the
generators' backward, then ``True`` again. torch DDP trains them: its reducer hooks the grad
accumulation of every param trainable when it was built, and a frozen param accumulates
nothing, so a backward with the whole net frozen reduces nothing for it. distopt does the
same. Its buffers hold every param trainable at wrapping, and their grads come through the
same kind of hooks: a param frozen for a backward gets nothing from that backward (no hook
fires; where its bucket reduces in it, the param's slot counts as zero, [Note: grads written,
not zeroed] in ddp/grads/grad_sync.py); a backward that reaches none of a DDP's trainable params
starts nothing of its grad sync. With sharded params the frozen net's units are still gathered
for the backward through them (the input's grad needs their weights), and a bucket whose
params are all frozen, which no grad will free, is freed when that backward ends
(``ParamUnsharder``).

A param frozen for a whole step that is stepped gets torch DDP's rule for a param without a
grad ([Note: params without a grad] in ddp/grads/unused_params.py): refused at the step without
``find_unused_parameters`` (torch refuses it at the next forward), left out of the step with
it (torch leaves its grad None). The one change refused is the other way: a param frozen when
the module was wrapped has no place in the buffers, so made trainable afterwards it would
never be reduced or stepped; every rank runs the same code and raises at the next forward,
before any collective, naming it (set ``requires_grad`` before wrapping, or wrap again). The
check reads the ``requires_grad`` of the params frozen at wrapping alone, in one C loop.
"""

from __future__ import annotations

import operator

from torch import nn

_requires_grad = operator.attrgetter("requires_grad")


class FrozenAtWrapping:
    """The params of a wrapped module that were frozen when it was wrapped; see
    [Note: params frozen after wrapping]."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        self._names = [name for name, _ in named]
        self._params = [param for _, param in named]

    def check(self) -> None:
        """Refuse a param frozen at wrapping that became trainable since."""
        if not any(map(_requires_grad, self._params)):
            return
        name = next(n for n, p in zip(self._names, self._params, strict=True)
                    if p.requires_grad)
        raise RuntimeError(
            f"parameter '{name}' became trainable after the module was wrapped: distopt laid "
            "its buffers out for the params trainable then, and this one has no place in "
            "them. Set requires_grad before distopt.DistributedDataParallel(...), or wrap the "
            "module again (ddp.release(), then a new DDP and optimizer). Freezing a trainable "
            "param and unfreezing it again (a GAN's discriminator) needs nothing"
        )
