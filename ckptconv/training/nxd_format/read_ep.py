"""One (tp, pp) rank of NxD's expert-parallel ZeRO-1 optimizer files parsed, per ep rank.

``NeuronEPZero1Optimizer.state_dict()`` (neuronx-distributed ``optimizer/zero_redundancy_optimizer.py``;
docs/nxd-optimizer-format.md) is a non-expert ``NeuronZero1Optimizer`` state with an expert one merged in:
``param_groups`` = the non-expert groups then ``ep_param_group_offset`` on the expert groups (each numbering its
own parameters from 0), ``base_state``/``shape_info`` the expert indices shifted by ``ep_base_state_offset``/
``ep_shape_info_offset``, ``state`` empty (``ep_param_id_offset`` 1), no masters. dp rank ``d``'s file holds its
chunk of the non-expert state (ZeRO-1 over all dp) and, for ep rank ``d % ep``, chunk ``d // ep`` of that ep
rank's experts (ZeRO-1 over its dp / ep expert-data-parallel ranks).

Each ep rank's :class:`Rank` holds what its model shard holds: ep rank 0 the non-expert parameters and its experts,
an ep rank > 0 its experts only (the same names, its own experts' state).
"""

from __future__ import annotations

from typing import Any

from ckptconv.core.layout import shard_file
from ckptconv.errors import ConversionError
from ckptconv.io.nxd_read import NxdCheckpoint
from ckptconv.training.ep import ep_fits, expert_dp_groups
from ckptconv.training.nxd_format.checks import (
    adamw_state,
    checked_param_groups,
    chunk_error,
    chunk_shape,
    indexed,
    stored_shape,
    without_leaves,
)
from ckptconv.training.nxd_format.files import MOMENTS, OFFSET_KEYS, ZERO1_KEYS, OptimFile, ep_offset
from ckptconv.training.nxd_format.ranks import Rank, Slot, index_names


def parse_ep_ranks(model: NxdCheckpoint, tp: int, pp: int, files: list[OptimFile], ep: int) -> dict[int, Rank]:
    """Every ep rank's state on rank (tp, pp) from its files (one per global dp rank), each index named from the
    model shards' key order (:func:`index_names`), every chunk's shape checked against NxD's partition."""
    dp = len(files)
    if not ep_fits(dp, ep):
        raise ConversionError(f"{files[0].path.parent}: {dp} dp ranks' optimizer files at ep {ep}; NxD's "
                              "expert-data-parallel groups need dp to be a multiple of ep")
    declared = model.declared(shard_file(tp_rank=tp, pp_rank=pp, ep_rank=0))
    experts = {k for k in model.declared(shard_file(tp_rank=tp, pp_rank=pp, ep_rank=1)) if not k.endswith("inv_freq")}
    live = [k for k in declared if not k.endswith("inv_freq")]
    dense_names, expert_names = [k for k in live if k not in experts], [k for k in live if k in experts]
    split = [_split(f, len(dense_names), len(expert_names)) for f in files]
    for f, (dense, _) in zip(files[1:], split[1:], strict=True):
        if without_leaves(dense) != without_leaves(split[0][0]):
            raise ConversionError(f"{f.path}: the non-expert param groups differ from {files[0].path}'s")
    where = str(files[0].path)
    names, naming = _named(split[0][0], files[0], 0, dense_names, {k: declared[k][1] for k in dense_names}, dp, where)
    ranks: dict[int, Rank] = {}
    edp_groups = expert_dp_groups(dp, ep)[1]
    for e in range(ep):
        mine = [files[d] for d in edp_groups[e]]  # dp ranks e, e + ep, ...: expert-data-parallel ranks 0, 1, ...
        shard = model.declared(shard_file(tp_rank=tp, pp_rank=pp, ep_rank=e))
        offset = ep_offset(len(dense_names))
        expert_order, _ = _named(split[e][1], mine[0], offset, expert_names, {k: shard[k][1] for k in expert_names},
                                 dp // ep, str(mine[0].path))
        slots = [_slot(mine, n, offset + j, len(split[0][0]) + _group_of(split[e][1], j), dp // ep)
                 for j, n in enumerate(expert_order)]
        groups = _with_names(split[e][1], expert_order)
        if e == 0:
            slots = [_slot(files, n, i, _group_of(split[0][0], i), dp) for i, n in enumerate(names)] + slots
            groups = _with_names(split[0][0], names) + groups
        ranks[e] = Rank(groups, slots, naming)
    return ranks


def _split(f: OptimFile, dense: int, experts: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(non-expert groups, expert groups) of one file, its offsets checked against the model's counts."""
    top = f.top
    if set(top) != {*ZERO1_KEYS, *OFFSET_KEYS}:
        extra = sorted(map(str, set(top) - {*ZERO1_KEYS, *OFFSET_KEYS}))
        missing = [k for k in (*OFFSET_KEYS, *ZERO1_KEYS) if k not in top]
        what = f"unknown key {extra[0]!r}" if extra else f"no {missing[0]!r}"
        raise ConversionError(f"{f.path}: {what}; the shards are expert-parallel, so NxD's files are "
                              f"NeuronEPZero1Optimizer's ({', '.join(OFFSET_KEYS + ZERO1_KEYS)})")
    values = {k: top[k] for k in OFFSET_KEYS}
    if any(type(v) is not int for v in values.values()) or top["state"] != {}:
        raise ConversionError(f"{f.path}: offsets {values} and state {'{}' if top['state'] == {} else '...'}; "
                              "expected integer offsets and an empty 'state'")
    groups = top["param_groups"]
    cut = values["ep_param_group_offset"]
    if not isinstance(groups, list) or not 0 < cut < len(groups):
        raise ConversionError(f"{f.path}: ep_param_group_offset {cut} does not split the "
                              f"{len(groups) if isinstance(groups, list) else 0} param groups in two")
    dense_groups = checked_param_groups(groups[:cut], f.path)
    expert_groups = checked_param_groups(groups[cut:], f.path)
    counts = (sum(len(g["params"]) for g in dense_groups), sum(len(g["params"]) for g in expert_groups))
    if counts != (dense, experts):
        raise ConversionError(f"{f.path}: the optimizer holds {counts[0]} non-expert and {counts[1]} expert parameters, "
                              f"the model shards {dense} and {experts}; it belongs to another model or layout")
    want = {"ep_param_id_offset": 1, "ep_base_state_offset": ep_offset(dense), "ep_shape_info_offset": ep_offset(dense)}
    wrong = [k for k, v in want.items() if values[k] != v]
    if wrong:
        raise ConversionError(f"{f.path}: {wrong[0]} is {values[wrong[0]]}, NxD's merge of {dense} non-expert "
                              f"parameters gives {want[wrong[0]]}")
    extra = [k for table in ("base_state", "shape_info") for k in top[table]
             if not (isinstance(k, int) and (0 <= k < dense or ep_offset(dense) <= k < ep_offset(dense) + experts))]
    if extra:
        raise ConversionError(f"{f.path}: 'base_state' or 'shape_info' has key {extra[0]!r}; the param groups number "
                              f"{dense} non-expert and {experts} expert parameters")
    return dense_groups, expert_groups


def _named(groups: list[dict[str, Any]], f: OptimFile, offset: int, names: list[str],
           shapes: dict[str, tuple[int, ...]], world: int, where: str) -> tuple[list[str], str]:
    """The names of one optimizer's indices (:func:`index_names`, by the group sizes and the shapes in ``f``)."""
    info = f.top["shape_info"]
    stored = [stored_shape(indexed(info, offset + i, f.path, "shape_info"), f.path, f"shape_info[{offset + i}]")
              for i in range(len(names))]
    for i, shape in enumerate(stored):
        chunk_shape(shape, world, f.path, offset + i)  # a scalar refused
    return index_names(names, shapes, [len(g["params"]) for g in groups], stored, where)


def _group_of(groups: list[dict[str, Any]], index: int) -> int:
    return next(g for g, group in enumerate(groups) if index in group["params"])


def _with_names(groups: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
            for g in groups]


def _slot(files: list[OptimFile], name: str, index: int, group: int, world: int) -> Slot:
    """Index ``index``'s state in ``files`` (its ZeRO-1 group's files, in group-rank order), every chunk checked."""
    first = files[0]
    shape = stored_shape(first.top["shape_info"][index], first.path, f"shape_info[{index}]")
    chunk = chunk_shape(shape, world, first.path, index)
    states = []
    for f in files:
        if f.top["shape_info"].get(index) != list(shape):
            raise ConversionError(f"{f.path}: shape_info[{index}] is {f.top['shape_info'].get(index)}, "
                                  f"{first.path} has {list(shape)}")
        state = adamw_state(indexed(f.top["base_state"], index, f.path, "base_state"), f.path, f"base_state[{index}]")
        for what, leaf in state.items():
            want = () if what == "step" else chunk
            if tuple(leaf.shape) != want and not (what == "step" and tuple(leaf.shape) == (1,)):
                raise ConversionError(chunk_error(f.path, what, index, leaf.shape, want, shape, world))
        states.append(state)
    return Slot(name, index, group, shape, [s["step"] for s in states], {m: [s[m] for s in states] for m in MOMENTS},
                None)
