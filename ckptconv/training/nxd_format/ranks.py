"""One (tp, pp) rank of NxD's optimizer parsed: which parameter each optimizer index is, and where its state lies on
each dp rank, from the rank's files (torch AdamW, or NeuronZero1Optimizer's dp chunks) or from the DCP variant's keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ckptconv.core.layout import shard_file
from ckptconv.errors import ConversionError
from ckptconv.io.dcp import METADATA as DCP_METADATA
from ckptconv.io.dcp import DcpCheckpoint
from ckptconv.io.nxd_read import NxdCheckpoint
from ckptconv.training.nxd_format.checks import (
    adamw_state,
    checked_param_groups,
    chunk_error,
    chunk_shape,
    indexed,
    no_extra_indices,
    stored_shape,
    tensor_leaf,
    without_leaves,
)
from ckptconv.training.nxd_format.files import MASTERS_KEY, MOMENTS, ZERO1_KEYS, DcpLeaf, Leaf, OptimFile


class OptimFormat(str, Enum):
    ADAMW = "adamw"  # torch AdamW state_dict, the same on every dp rank (ZeRO-1 off)
    ZERO1 = "zero1"  # NeuronZero1Optimizer, one file per dp rank
    ZERO1_DCP = "zero1-dcp"  # NeuronZero1Optimizer through torch.distributed.checkpoint (use_zero1_dcp)


# --------------------------------------------------------------------------------------------
# Which parameter is optimizer index i


# How NxD's and NxDT's examples split parameters into (decay, no-decay) groups; each keeps model order.
# NxD's Llama example (the fixtures) tests names for "bias"/"norm"; other examples for "bias"/"LayerNorm".
# One table for both directions: the reader tries each, the writer (ckptconv.training.nxd_format.write) is told one.
PARAM_GROUP_RULES: dict[str, tuple[str, Callable[[str], bool]]] = {
    "bias-norm": ("names containing 'bias' or 'norm' in the no-decay group", lambda n: "bias" in n or "norm" in n),
    "bias-LayerNorm": ("names containing 'bias' or 'LayerNorm' in the no-decay group",
                       lambda n: "bias" in n or "LayerNorm" in n),
    # NxDT's hf models with do_layer_norm_weight_decay false: only biases undecayed (none in Llama: group 1 empty)
    "bias": ("names containing 'bias' in the no-decay group", lambda n: "bias" in n),
}
_GROUP_RULES = tuple(PARAM_GROUP_RULES.values())


def index_names(model_names: list[str], model_shapes: dict[str, tuple[int, ...]], group_sizes: list[int],
                index_shapes: list[tuple[int, ...]], where: str) -> tuple[list[str], str]:
    """(name of each optimizer index, how it was decided): the model's parameters in order, split into the
    param groups by the first rule whose group sizes and every stored shape agree; else an error."""
    if sum(group_sizes) != len(model_names) or len(index_shapes) != len(model_names):
        raise ConversionError(f"{where}: {sum(group_sizes)} optimizer indices ({len(index_shapes)} shapes) for "
                              f"{len(model_names)} parameters")
    candidates = [("one param group, model order", list(model_names))] if len(group_sizes) == 1 else []
    if len(group_sizes) == 2:
        for rule, no_decay in _GROUP_RULES:
            order = [n for n in model_names if not no_decay(n)] + [n for n in model_names if no_decay(n)]
            if len(order) - sum(map(no_decay, model_names)) == group_sizes[0]:
                candidates.append((rule, order))
    fits = [(rule, order) for rule, order in candidates
            if all(model_shapes[n] == s for n, s in zip(order, index_shapes, strict=True))]
    if not fits:
        raise ConversionError(
            f"{where}: cannot tell which parameter each optimizer index is: {len(group_sizes)} param groups of "
            f"sizes {group_sizes} fit none of the known param-group rules (one group; "
            + "; ".join(rule for rule, _ in _GROUP_RULES) + ") with the stored shapes")
    if any(order != fits[0][1] for _, order in fits[1:]):
        raise ConversionError(f"{where}: the param groups fit several rules that name the indices differently "
                              f"({'; '.join(rule for rule, _ in fits)}); refusing to guess")
    return fits[0][1], fits[0][0]


# --------------------------------------------------------------------------------------------
# Where each parameter's state lies


@dataclass
class Slot:
    """Where one parameter's state lies: per dp rank for ZeRO-1 files, one leaf otherwise."""

    name: str
    index: int
    group: int
    shape: tuple[int, ...]  # the full, unpadded parameter shape
    step: list[Leaf]
    moments: dict[str, list[Leaf]]
    master: list[Leaf] | None


@dataclass
class Rank:
    groups: list[dict[str, Any]]  # hyper-parameters as saved, "params": names
    slots: list[Slot]  # in optimizer index order
    naming: str
    by_name: dict[str, Slot] = field(init=False, repr=False)  # every read looks a slot up by name

    def __post_init__(self) -> None:
        self.by_name = {}
        for slot in self.slots:
            self.by_name.setdefault(slot.name, slot)


# --------------------------------------------------------------------------------------------
# dp_rank_XX_tp_rank_YY_pp_rank_ZZ.pt files


def parse_rank(model: NxdCheckpoint, tp: int, pp: int, files: list[OptimFile], dp: int) -> tuple[OptimFormat, Rank]:
    """One (tp, pp) rank from its files (one per dp rank): the format they hold, and each index's parameter (named
    from the model shard's key order, :func:`index_names`) with its state on every dp rank, shapes checked."""
    first = files[0]
    top = first.top
    keys = set(top)
    if keys == {"state", "param_groups"}:
        fmt = OptimFormat.ADAMW
        if len(files) > 1:
            raise ConversionError(f"{files[1].path}: a second dp rank's file of an optimizer without ZeRO-1 "
                                  "(NxD writes only dp rank 00 then)")
    elif set(ZERO1_KEYS) <= keys <= {*ZERO1_KEYS, MASTERS_KEY}:
        fmt = OptimFormat.ZERO1
    else:
        extra = sorted(map(str, keys - {*ZERO1_KEYS, MASTERS_KEY}))
        what = f"unknown key {extra[0]!r}" if extra else f"keys {sorted(map(str, keys))}"
        raise ConversionError(f"{first.path}: {what}; expected torch AdamW's state dict (state, param_groups) or "
                              f"NeuronZero1Optimizer's ({', '.join(ZERO1_KEYS)}[, {MASTERS_KEY}])")
    for other in files[1:]:
        if set(other.top) != keys or without_leaves(other.top["param_groups"]) != without_leaves(top["param_groups"]):
            raise ConversionError(f"{other.path}: keys or param groups differ from {first.path}")
    groups = checked_param_groups(top["param_groups"], first.path)
    count = sum(len(g["params"]) for g in groups)
    declared = model.declared(shard_file(tp_rank=tp, pp_rank=pp))
    model_names = [k for k in declared if not k.endswith("inv_freq")]
    if count != len(model_names):
        raise ConversionError(f"{first.path}: the optimizer holds {count} parameters, the model shard "
                              f"{len(model_names)}; the optimizer belongs to another model or layout")
    per_dp = [_states(f, fmt, count) for f in files]
    index_shapes = _full_shapes(fmt, files, per_dp, count, dp)
    model_shapes = {k: declared[k][1] for k in model_names}
    names, naming = index_names(model_names, model_shapes, [len(g["params"]) for g in groups], index_shapes,
                                str(first.path))
    group_of = [g for g, group in enumerate(groups) for _ in group["params"]]
    slots = []
    for i, name in enumerate(names):
        states = [states[i] for states, _ in per_dp]
        masters = [masters[i] for _, masters in per_dp] if all(m for _, m in per_dp) else None
        slots.append(Slot(name, i, group_of[i], index_shapes[i], [s["step"] for s in states],
                          {m: [s[m] for s in states] for m in MOMENTS}, masters))
    named = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
             for g in groups]
    return fmt, Rank(named, slots, naming)


def _states(f: OptimFile, fmt: OptimFormat, count: int) -> tuple[list[dict[str, Leaf]], list[Leaf]]:
    """(AdamW state of every index, the masters of every index or [])."""
    top = f.top
    if fmt is OptimFormat.ZERO1 and top["state"] != {}:
        raise ConversionError(f"{f.path}: 'state' of a NeuronZero1Optimizer file is not empty")
    state = top["state"] if fmt is OptimFormat.ADAMW else top["base_state"]
    where = "state" if fmt is OptimFormat.ADAMW else "base_state"
    states = [adamw_state(indexed(state, i, f.path, where), f.path, f"{where}[{i}]") for i in range(count)]
    no_extra_indices(state, count, f.path, where)
    masters: list[Leaf] = []
    if MASTERS_KEY in top:
        masters = [tensor_leaf(indexed(top[MASTERS_KEY], i, f.path, MASTERS_KEY), f.path, f"{MASTERS_KEY}[{i}]")
                   for i in range(count)]
        no_extra_indices(top[MASTERS_KEY], count, f.path, MASTERS_KEY)
    return states, masters


def _full_shapes(fmt: OptimFormat, files: list[OptimFile], per_dp: list[Any], count: int,
                 dp_size: int) -> list[tuple[int, ...]]:
    """Each index's full parameter shape, every dp chunk checked against NxD's partition of it."""
    if fmt is OptimFormat.ADAMW:
        shapes = [per_dp[0][0][i]["exp_avg"].shape for i in range(count)]
    else:
        info = files[0].top["shape_info"]
        shapes = [stored_shape(indexed(info, i, files[0].path, "shape_info"), files[0].path, f"shape_info[{i}]")
                  for i in range(count)]
        no_extra_indices(info, count, files[0].path, "shape_info")
    for dp, (states, masters) in enumerate(per_dp):
        for i, shape in enumerate(shapes):
            chunk = shape if fmt is OptimFormat.ADAMW else chunk_shape(shape, dp_size, files[dp].path, i)
            leaves = [("step", states[i]["step"])] + [(m, states[i][m]) for m in MOMENTS]
            leaves += [(MASTERS_KEY, masters[i])] if masters else []
            for what, leaf in leaves:
                want = () if what == "step" else chunk
                if tuple(leaf.shape) != want and not (what == "step" and tuple(leaf.shape) == (1,)):
                    raise ConversionError(chunk_error(files[dp].path, what, i, leaf.shape, want, shape, dp_size))
    return shapes


# --------------------------------------------------------------------------------------------
# The DCP variant


@dataclass(frozen=True)
class DcpRanks:
    """The DCP variant's keys sorted by rank (each rank matched with its model shard when first asked for)."""

    dcp: DcpCheckpoint
    where: Path  # the metadata file, as errors name it
    group: dict[str, Any]  # the one param group's hyper-parameters
    leaves: dict[tuple[int, int], dict[str, dict[str, Leaf]]]  # (tp, pp) -> name -> exp_avg/exp_avg_sq
    steps: dict[str, Leaf]  # name -> step
    dp: int  # each dp rank saved its chunk of every tensor: the most chunks any tensor has


def open_dcp(directory: Path, model: NxdCheckpoint, io: str, check: bool) -> DcpRanks:
    """The DCP optimizer in ``directory`` (``use_zero1_dcp``), its keys checked and sorted by (tp, pp) rank."""
    dcp = DcpCheckpoint(directory, io=io, check=check)
    try:
        return _dcp_ranks(dcp, directory / DCP_METADATA, model)
    except BaseException:
        dcp.close()
        raise


def _dcp_ranks(dcp: DcpCheckpoint, where: Path, model: NxdCheckpoint) -> DcpRanks:
    groups_raw: dict[int, dict[str, Any]] = {}
    leaves: dict[tuple[int, int], dict[str, dict[str, Leaf]]] = {}
    steps: dict[str, Leaf] = {}
    for key in dcp.keys():
        if key.startswith("param_groups."):
            m = re.fullmatch(r"param_groups\.(\d+)\.(\w+)", key)
            if m is None:
                raise ConversionError(f"{where}: unexpected key {key!r}")
            groups_raw.setdefault(int(m.group(1)), {})[m.group(2)] = dcp.read_value(key)
        elif key.startswith("base_state."):
            m = re.fullmatch(r"base_state\.(.+)\.(step|exp_avg|exp_avg_sq)((?:\|pp-\d{4})?)((?:\|tp-\d{4})?)", key)
            if m is None:
                raise ConversionError(f"{where}: unexpected key {key!r}")
            name, what = m.group(1), m.group(2)
            if what == "step":
                steps[name] = DcpLeaf(dcp, key)
                continue
            rank = (int(m.group(4)[4:]) if m.group(4) else 0, int(m.group(3)[4:]) if m.group(3) else 0)
            leaves.setdefault(rank, {}).setdefault(name, {})[what] = DcpLeaf(dcp, key)
        elif not re.fullmatch(r"shape_info\.\d+", key):
            raise ConversionError(f"{where}: unexpected key {key!r}; expected NxD's ZeRO-1 DCP "
                                  "keys (param_groups.*, base_state.*, shape_info.*)")
    if sorted(groups_raw) != list(range(len(groups_raw))) or len(groups_raw) != 1:
        raise ConversionError(f"{where}: {len(groups_raw)} param groups; NxD's DCP optimizer "
                              "save works with one only, and only one is read")
    expected = {(tp, pp) for tp in range(model.tp) for pp in range(model.pp)}
    if set(leaves) != expected:
        raise ConversionError(f"{where}: holds tp x pp ranks {sorted(leaves)}; the model has "
                              f"tp {model.tp} x pp {model.pp}")
    dp = max(len(dcp.entry(k).chunks) for k in dcp.keys() if dcp.entry(k).is_tensor)
    return DcpRanks(dcp, where, groups_raw[0], leaves, steps, dp)


def parse_dcp_rank(ranks: DcpRanks, model: NxdCheckpoint, tp: int, pp: int) -> Rank:
    """One (tp, pp) rank of the DCP variant: its keys' tensors matched with its model shard's parameters."""
    group, steps, where = ranks.group, ranks.steps, ranks.where
    by_name = ranks.leaves[(tp, pp)]
    declared = model.declared(shard_file(tp_rank=tp, pp_rank=pp))
    names = [k for k in declared if not k.endswith("inv_freq")]
    if set(by_name) != set(names) or len(group.get("params", [])) != len(names):
        odd = sorted(set(by_name) ^ set(names)) or ["(param_groups.0.params)"]
        raise ConversionError(f"{where}: optimizer state of tp rank {tp} pp rank {pp} does "
                              f"not match the model shard's parameters (first difference {odd[0]!r})")
    slots = []
    for i, name in enumerate(names):
        state = by_name[name]
        if set(state) != set(MOMENTS) or name not in steps:
            raise ConversionError(f"{where}: {name!r} lacks one of step, exp_avg, exp_avg_sq")
        shape = declared[name][1]
        for moment in MOMENTS:
            if tuple(state[moment].shape) != shape:
                raise ConversionError(f"{where}: {name!r} {moment} has shape "
                                      f"{list(state[moment].shape)}, the parameter {list(shape)}")
        slots.append(Slot(name, i, 0, shape, [steps[name]], {k: [state[k]] for k in MOMENTS}, None))
    named = {**{k: v for k, v in group.items() if k != "params"}, "params": names}
    return Rank([named], slots, "names in the DCP keys")
