"""A DeepSpeed ZeRO checkpoint (``engine.save_checkpoint``, stage 1, 2 or 3) read as torch's
layout, without DeepSpeed ([Note: converted checkpoints] in convert.py).

[Note: DeepSpeed's ZeRO checkpoint layout]
``save_checkpoint(dir)`` writes ``dir/latest`` (the tag) and ``dir/<tag>/``, holding, per
data-parallel rank r of W, ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (ZeRO-3 also a
``..._model_states.pt`` per rank; ZeRO-1/2 one ``mp_rank_00_model_states.pt``). The model
states file names the trainable params in ``param_shapes``: one ordered {name: shape} per
flat group (ZeRO-1/2: one per param group; ZeRO-3: one per sub-group), the order in which
they lie in the group's flat buffer. Each rank's optimizer file holds its fp32 partition of
every flat group (``single_partition_of_fp32_groups``, ZeRO-3 ``fp32_flat_groups``) and the
client optimizer's ``state_dict()`` over those partitions: state entry k is flat group k's
(``exp_avg`` ... over its partition, ``step`` a scalar), and ``param_groups`` carry the
options, each listing the flat groups it holds.

How a flat group is cut:
- ZeRO-1/2: the params one after the other, each followed by its alignment padding
  (``param_alignment_paddings``), the whole padded to W equal partitions of P elements; rank r
  holds [r P, (r + 1) P). The saved fp32 partitions drop the last rank's tail padding
  (``group_paddings``), the optimizer state keeps it.
- ZeRO-3: every param cut on its own into W pieces of ceil(n / W) elements (the last padded);
  rank r's flat group is its piece of each param in turn.
So each param's elements are a few runs of the ranks' flat tensors, which ``_runs`` lists and
``Lazy`` values read when written: one param at a time, never a rank's whole file.
Refused by name: model- or pipeline-parallel checkpoints (``mp_rank_01``, ``layer_*``), the
bf16 optimizer without ZeRO (stage 0; its files, like those of every bf16 run, are named
``bf16_zero_*``), elastic checkpoints (no param groups saved), a checkpoint with no optimizer
state (saved before the first step).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from .converted import Converted, Lazy
from .files import CheckpointError
from .torch_layout import torch_fqn
from .torch_zip import Foreign, StoredTensor, TorchFile

# With bf16 on, DeepSpeed prefixes the optimizer files with "bf16_" at every ZeRO stage.
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def looks_like(path: Path) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint directory (or one tag of it)."""
    if (path / "latest").is_file():
        return True
    return any(path.glob("*_optim_states.pt")) or any(path.glob("*_model_states.pt"))


def tag_directory(path: Path) -> Path:
    """The directory of one saved tag: ``path`` itself, or the one ``path/latest`` names."""
    if any(path.glob("*_optim_states.pt")) or any(path.glob("*_model_states.pt")):
        return path
    latest = path / "latest"
    if not latest.is_file():
        raise CheckpointError(f"{path} has no 'latest' file and no *_optim_states.pt files: "
                              "give the directory DeepSpeed's save_checkpoint wrote, or a tag "
                              "directory inside it")
    tag = latest.read_text().strip()
    if not (path / tag).is_dir():
        raise CheckpointError(f"{latest} names tag '{tag}', but {path / tag} is missing")
    return path / tag


def _value(x: Any) -> Any:
    return x.value if isinstance(x, Foreign) else x


def _optim_files(tag: Path) -> list[Path]:
    for bad, why in (("layer_*", "a pipeline-parallel checkpoint (layer_* files)"),):
        if any(tag.glob(bad)):
            raise CheckpointError(f"{tag} holds {why}, which distopt convert does not cover: "
                                  "save it with ZeRO stage 1, 2 or 3 without pipeline stages")
    files: dict[int, Path] = {}
    prefixes = set()
    for path in tag.glob("*_optim_states.pt"):
        match = _OPTIM.match(path.name)
        if match is None:
            continue
        prefixes.add(match.group(1) or "")
        if int(match.group(3)) != 0:
            raise CheckpointError(f"{tag} is a model-parallel checkpoint ({path.name}): "
                                  "distopt convert covers data parallelism alone")
        files[int(match.group(2))] = path
    if len(prefixes) > 1:
        raise CheckpointError(f"{tag} holds both bf16_zero_pp_rank_* and zero_pp_rank_* "
                              "optimizer files: files of two runs are mixed")
    if not files:
        raise CheckpointError(f"{tag} holds no zero_pp_rank_<r>_mp_rank_00_optim_states.pt "
                              "files: not a ZeRO checkpoint, or its optimizer states are missing")
    prefix = prefixes.pop()
    return [files[r] if r in files else tag / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
            for r in range(max(files) + 1)]


def _open_ranks(tag: Path) -> tuple[list[TorchFile], int, int]:
    """Every rank's optimizer file, the ZeRO stage and the data-parallel size W."""
    paths = _optim_files(tag)
    first = TorchFile(paths[0]) if paths[0].exists() else None
    if first is None:
        raise CheckpointError(f"{paths[0]} is missing")
    osd = first.tree.get("optimizer_state_dict") if isinstance(first.tree, dict) else None
    if not isinstance(osd, dict) or "zero_stage" not in osd:
        if paths[0].name.startswith("bf16_"):
            raise CheckpointError(f"{paths[0]} holds DeepSpeed's bf16 optimizer without ZeRO "
                                  "(stage 0), which distopt convert does not cover: save it "
                                  "with ZeRO stage 1, 2 or 3")
        raise CheckpointError(f"{paths[0]} is not a ZeRO optimizer state file (no zero_stage)")
    stage = int(_value(osd["zero_stage"]))
    count = osd.get("partition_count")
    world = max(count) if isinstance(count, list) else int(count)
    missing = [p.name for p in paths[:world] if not p.exists()]
    if len(paths) < world or missing:
        prefix = "bf16_" if paths[0].name.startswith("bf16_") else ""
        names = missing or [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                            for r in range(len(paths), world)]
        raise CheckpointError(f"{tag} is partial: the run had {world} data-parallel ranks, and "
                              f"the optimizer states of {', '.join(names)} are missing")
    if len(paths) > world:
        raise CheckpointError(f"{tag} holds optimizer states of {len(paths)} ranks, but its "
                              f"files say the run had {world}: files of two runs are mixed")
    return [first] + [TorchFile(p) for p in paths[1:]], stage, world


def _model_states(tag: Path, stage: int, world: int) -> list[Any]:
    names = (["mp_rank_00_model_states.pt"] if stage <= 2 else
             [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)])
    for name in names:
        if not (tag / name).exists():
            raise CheckpointError(f"{tag} is partial: {name} (the model states: param names "
                                  "and shapes, buffers) is missing")
    trees = [TorchFile(tag / name).tree for name in names]
    for name, tree in zip(names, trees, strict=True):
        if not isinstance(tree, dict) or "param_shapes" not in tree or "module" not in tree:
            raise CheckpointError(f"{tag / name} is not a DeepSpeed model states file "
                                  "(no param_shapes)")
    return trees


def _zero_state(tree: Any, stage: int, path: Path) -> tuple[dict[str, Any], list[Any]]:
    """A rank's client optimizer state dict and its fp32 flat partitions."""
    osd = tree["optimizer_state_dict"]
    inner_key, flats_key = (("base_optimizer_state", "single_partition_of_fp32_groups")
                            if stage <= 2 else ("optimizer_state_dict", "fp32_flat_groups"))
    inner = osd.get(inner_key)
    if isinstance(inner, list):
        raise CheckpointError(f"{path} is an elastic checkpoint (zero_optimization."
                              "elastic_checkpoint), which saves no param groups: save with "
                              "elastic_checkpoint off")
    if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
        raise CheckpointError(f"{path} holds no optimizer state dict ({inner_key})")
    if flats_key not in osd:
        raise CheckpointError(f"{path} holds no fp32 master partitions ({flats_key})")
    return inner, list(osd[flats_key])


def _runs(stage: int, world: int, shapes: list[tuple[str, tuple[int, ...]]],
          paddings: list[int] | None, part: int | None) -> dict[str, list[tuple[int, int, int]]]:
    """Each param's elements, in order, as (rank, start in the rank's flat tensor, count)."""
    out = {}
    offset = 0
    for i, (name, shape) in enumerate(shapes):
        n = math.prod(shape)
        runs = []
        if stage <= 2:  # [offset, offset + n) of the group's flat buffer, cut every `part`
            at = offset
            while at < offset + n:
                rank, start = divmod(at, part)
                count = min(offset + n - at, part - start)
                runs.append((rank, start, count))
                at += count
            offset += n + (paddings[i] if paddings else 0)
        else:  # each rank holds ceil(n / W) elements of it at `offset` in its flat tensor
            piece = math.ceil(n / world)
            for rank in range(world):
                count = max(0, min(piece, n - rank * piece))
                if count:
                    runs.append((rank, offset, count))
            offset += piece
        out[name] = runs
    return out


def _gather(tensors: list[StoredTensor], runs: list[tuple[int, int, int]], n: int, what: str
            ) -> torch.Tensor:
    out = torch.empty(n, dtype=tensors[0].dtype)
    at = 0
    for rank, start, count in runs:
        source = tensors[rank]
        if start + count > source.numel:
            raise CheckpointError(f"{what}: rank {rank}'s flat tensor holds {source.numel} "
                                  f"elements, {start + count} needed: the checkpoint is damaged "
                                  "or its files come from different runs")
        out[at : at + count] = source.read(start, start + count)
        at += count
    return out


def _lazy(tensors: list[StoredTensor], runs: list[tuple[int, int, int]],
          shape: tuple[int, ...], dtype: torch.dtype, what: str) -> Lazy:
    n = math.prod(shape)
    return Lazy(shape, dtype, lambda: _gather(tensors, runs, n, what))


def _not_carried(model: dict[str, Any], zero: dict[str, Any]) -> list[str]:
    notes = []
    scaler = zero.get("loss_scaler")
    if isinstance(scaler, Foreign) and isinstance(scaler.state, dict):
        scale = scaler.state.get("cur_scale")
        dynamic = scaler.state.get("dynamic")
        if dynamic or (scale not in (None, 1, 1.0)):
            notes.append(f"the fp16 loss scaler (scale {scale}, dynamic {dynamic})")
    for key, what in (("lr_scheduler", "the LR scheduler's state"),
                      ("data_sampler", "the data sampler's state"),
                      ("random_ltd", "random-LTD's state")):
        if model.get(key) is not None:
            notes.append(what)
    known = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
             "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler",
             "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
             "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
             "checkpoint_parallel_dimensions", "universal_checkpoint_info"}
    client = sorted(k for k in model if k not in known)
    if client:
        notes.append(f"the client state saved beside the engine's ({', '.join(client)})")
    notes.append(f"the engine's counters (global_steps {model.get('global_steps')}, "
                 f"global_samples {model.get('global_samples')})")
    return notes


def read(path: Path) -> Converted:
    """The DeepSpeed checkpoint at ``path`` (its directory, or one tag of it) as torch's
    layout; see [Note: DeepSpeed's ZeRO checkpoint layout]."""
    tag = tag_directory(path)
    ranks, stage, world = _open_ranks(tag)
    if stage not in (1, 2, 3):
        raise CheckpointError(f"{tag} was saved at ZeRO stage {stage}; distopt convert covers "
                              "stages 1, 2 and 3")
    trees = _model_states(tag, stage, world)
    model_tree = trees[0]
    zero = [_zero_state(f.tree, stage, f.path) for f in ranks]
    flat_shapes = [[(name, tuple(shape)) for name, shape in group.items()]
                   for group in model_tree["param_shapes"]]
    inner0, flats0 = zero[0]
    if len(flat_shapes) != len(flats0):
        raise CheckpointError(f"{tag}: the model states name {len(flat_shapes)} flat groups, "
                              f"the optimizer states hold {len(flats0)}: files of two runs?")
    order = {torch_fqn(k): i for i, k in enumerate(model_tree["module"])}
    osd0 = ranks[0].tree["optimizer_state_dict"]
    model: dict[str, Lazy | torch.Tensor] = {}
    state: dict[str, dict[str, Lazy | torch.Tensor]] = {}
    group_of_flat = {}
    for g, group in enumerate(inner0["param_groups"]):
        for k in group["params"]:
            group_of_flat[k] = g
    group_params: list[list[str]] = [[] for _ in inner0["param_groups"]]
    for k, shapes in enumerate(flat_shapes):
        part = None
        if stage <= 2:
            pads = [r_osd["optimizer_state_dict"]["group_paddings"][k] for r_osd in
                    (f.tree for f in ranks)]
            part = flats0[k].numel + pads[0]
            for r, (_, flats) in enumerate(zero):
                if flats[k].numel + pads[r] != part:
                    raise CheckpointError(f"{ranks[r].path}: flat group {k} holds "
                                          f"{flats[k].numel} + {pads[r]} padding elements, rank "
                                          f"0's {part}: files of two runs?")
        paddings = osd0.get("param_alignment_paddings")
        runs = _runs(stage, world, shapes, paddings[k] if paddings else None, part)
        entries = [inner.get("state", {}).get(k) for inner, _ in zero]
        if any(not e for e in entries):
            raise CheckpointError(f"{tag} holds no optimizer state for flat group {k} (saved "
                                  "before the first step?): nothing to convert beyond the "
                                  "weights, which DeepSpeed's zero_to_fp32.py recovers")
        if k not in group_of_flat:
            raise CheckpointError(f"{tag}: no param group holds flat group {k}")
        for name, shape in shapes:
            fqn = torch_fqn(name)
            what = f"{tag}: '{name}'"
            model[fqn] = _lazy([flats[k] for _, flats in zero], runs[name], shape,
                               torch.float32, what)
            state[fqn] = {}
            for key, value in entries[0].items():
                if isinstance(value, StoredTensor) and len(value.shape) > 0:
                    pieces = [e.get(key) for e in entries]
                    if not all(isinstance(p, StoredTensor) for p in pieces):
                        raise CheckpointError(f"{tag}: a rank's optimizer state of flat group "
                                              f"{k} lacks '{key}': files of two runs?")
                    state[fqn][key] = _lazy(pieces, runs[name], shape,
                                            value.dtype, f"{what} {key}")
                else:
                    state[fqn][key] = (value.load().clone() if isinstance(value, StoredTensor)
                                       else value)
            group_params[group_of_flat[k]].append(fqn)
    _add_unpartitioned(model, trees, stage, world, tag)
    param_groups = []
    for g, group in enumerate(inner0["param_groups"]):
        options = {k: v for k, v in group.items() if k != "params"}
        param_groups.append({**options, "params": sorted(group_params[g],
                                                         key=lambda f: order.get(f, len(order)))})
    return Converted(f"DeepSpeed ZeRO-{stage} checkpoint {tag}, {world} ranks", model, state,
                     param_groups, _not_carried(model_tree, osd0))


def _add_unpartitioned(model: dict[str, Lazy | torch.Tensor], trees: list[Any], stage: int,
                       world: int, tag: Path) -> None:
    """Buffers, frozen params and tied names, beside the trainable params."""
    first = trees[0]
    module = first["module"]
    for name in first.get("buffer_names") or []:
        value = module.get(name)
        if isinstance(value, StoredTensor):
            model[torch_fqn(name)] = Lazy(value.shape, value.dtype, value.load)
    for name, shape in (first.get("frozen_param_shapes") or {}).items():
        shape = tuple(shape)
        n = math.prod(shape)
        pieces = [t.get("frozen_param_fragments", {}).get(name) for t in trees]
        if stage <= 2:
            value = pieces[0] if isinstance(pieces[0], StoredTensor) else module.get(name)
            if not isinstance(value, StoredTensor) or value.numel != n:
                raise CheckpointError(f"{tag}: frozen param '{name}' is not saved whole")
            model[torch_fqn(name)] = Lazy(shape, value.dtype, value.load)
        else:
            if any(not isinstance(p, StoredTensor) for p in pieces):
                raise CheckpointError(f"{tag}: a rank's piece of frozen param '{name}' is "
                                      "missing")
            runs = [(r, 0, max(0, min(pieces[r].numel, n - r * pieces[0].numel)))
                    for r in range(world)]
            model[torch_fqn(name)] = _lazy(pieces, [r for r in runs if r[2]], shape,
                                           pieces[0].dtype, f"{tag}: frozen '{name}'")
    for alias, name in (first.get("shared_params") or {}).items():
        if torch_fqn(name) in model:
            model[torch_fqn(alias)] = model[torch_fqn(name)]
