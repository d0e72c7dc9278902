"""The params a pipeline stage shares with another stage: checked when the DDP is built.

See [Note: tied stage params] in optim/tied.py: the DDP lays each of them out in a buffer of its
own and knows it by the name of the tie; the optimizer sums their grads across the stages.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from ..parallel.process_groups import ParallelGroups


def resolve_tied_params(
    tied_params: Mapping[str, nn.Parameter] | None,
    param_names: dict[nn.Parameter, str],
    parallel: ParallelGroups,
) -> dict[nn.Parameter, str]:
    """``{param: name of the tie}`` from the DDP's ``tied_params`` argument (``{name: param}``),
    checked on every rank alike before any collective."""
    if not tied_params:
        return {}
    if not isinstance(tied_params, Mapping):
        raise TypeError(
            "tied_params must map the name of each tie to this stage's parameter, e.g. "
            "{'wte.weight': stage.lm_head.weight}, got "
            f"{type(tied_params).__name__}"
        )
    if parallel.pp_group is None:
        raise ValueError(
            "tied_params ties parameters across pipeline stages, but the model is not a "
            "pipeline stage: build the DDP on a mesh with a 'pp' dimension (init_device_mesh("
            "device, (pp, dp), mesh_dim_names=('pp', 'dp'))); params tied within one module are "
            "one nn.Parameter and need nothing"
        )
    tied: dict[nn.Parameter, str] = {}
    for name, param in tied_params.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"tied_params keys are the names of the ties, got {name!r}")
        if param not in param_names:
            raise ValueError(
                f"tied_params['{name}'] is not a trainable parameter of the stage module: pass "
                "one of its own parameters (module.named_parameters())"
            )
        if param in tied:
            raise ValueError(
                f"parameter '{param_names[param]}' is tied twice in tied_params (as "
                f"'{tied[param]}' and '{name}'): tie each parameter once"
            )
        tied[param] = name
    taken = {n for p, n in param_names.items() if p not in tied}
    for name in tied.values():
        if name in taken:
            raise ValueError(
                f"tied_params names a tie '{name}', which is the name of another parameter of "
                "the stage: name the tie after the tied weight (the name it has in the whole "
                "model)"
            )
    return tied
