"""Writing NxD's own optimizer format, so that NxD 2.28 (NxD's examples, NxDT) resumes a tag from here.

What is written per target (tp, pp) rank (docs/nxd-optimizer-format.md; the structures NxD 2.28 wrote in
``fixtures/nxdt-official/``):

* ZeRO-1 on: ``NeuronZero1Optimizer.state_dict()`` per dp rank, ``optim/dp_rank_DD_tp_rank_XX_pp_rank_YY.pt``:
  ``state`` {}, ``param_groups``, ``base_state`` {i: step, exp_avg, exp_avg_sq}, ``shape_info`` {i: full shape},
  ``sharded_master_weights`` {i: chunk}. A chunk is dim 0 zero-padded to a multiple of dp, cut in dp equal
  parts; moments and masters in the optimizer dtype (fp32, fp64 where the source's masters are).
* ZeRO-1 off: torch AdamW's ``state_dict()`` in ``optim/dp_rank_00_...``: moments in the parameter's dtype.

Optimizer index ``i`` is the i-th parameter of the param groups taken in order, each group in the shard's
key order; the groups come from a rule (:data:`PARAM_GROUP_RULES`, the same table
:func:`ckptconv.training.nxd_format.ranks.index_names` reads with). The files are planned like shards (every tensor a
list of row ranges of the source, :mod:`ckptconv.core.plan`) and written by the executor in bands, nested
structures through :class:`ckptconv.io.torchzip.TensorAt`.

    >>> nxd_groups(["w", "model.norm.weight", "b.bias"], "bias-norm")
    [['w'], ['model.norm.weight', 'b.bias']]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ckptconv.core.layout import ShardId
from ckptconv.core.plan import NESTED_TORCH, OutFile, OutTensor, Piece, Source
from ckptconv.engine.options import NXD_PARAM_GROUPS
from ckptconv.engine.slabs import slab_band, slab_pieces
from ckptconv.errors import ConversionError
from ckptconv.io.nxd_read import NxdCheckpoint
from ckptconv.io.torchzip import TensorAt, TensorMeta
from ckptconv.training.nxd_format.as_source import STEP
from ckptconv.training.nxd_format.files import MOMENTS
from ckptconv.training.nxd_format.ranks import PARAM_GROUP_RULES
from ckptconv.training.nxd_format.read import NxdOptimizer
from ckptconv.training.nxdtrain_format.state import (
    MASTER,
    OptimizerSource,
    component_source,
    is_matrix,
    optimizer_file,
    state_tensors,
)

DEFAULT_RULE = "bias-norm"
RULE_CHOICES = (*PARAM_GROUP_RULES, "one")
assert RULE_CHOICES == NXD_PARAM_GROUPS, "ckptconv.engine.options names the same rules for the CLI"
# The key order of a param group in NxD 2.28's files: torch AdamW's own (initial_lr added by the scheduler),
# and NeuronZero1Optimizer's (its wrapper groups take initial_lr before the base optimizer's defaults).
_ADAMW_GROUP = ("weight_decay", "lr", "betas", "eps", "amsgrad", "maximize", "foreach", "capturable",
                "differentiable", "fused", "decoupled_weight_decay", "initial_lr")
_ZERO1_GROUP = ("weight_decay", "lr", "betas", "initial_lr", "eps", "amsgrad", "maximize", "foreach", "capturable",
                "differentiable", "fused", "decoupled_weight_decay")
# torch AdamW's defaults, for a key a source's param groups do not hold (an older torch's nxdtrain tag)
_ADAMW_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                   "differentiable": False, "fused": None, "decoupled_weight_decay": True}
NXDTRAIN_KEY = "nxdtrain"  # user_content.pt: nxdtrain's own record beside NxD's example keys


def check_rule(rule: str) -> str:
    """``rule`` if it names a param-group rule (``--nxd-param-groups``), else the one-line refusal."""
    if rule not in RULE_CHOICES:
        raise ConversionError(f"--nxd-param-groups must be one of {', '.join(RULE_CHOICES)}, got {rule!r}")
    return rule


def nxd_groups(names: Sequence[str], rule: str) -> list[list[str]]:
    """The param groups NxD's example builds over ``names`` (a shard's parameters in key order)."""
    if check_rule(rule) == "one":
        return [list(names)]
    no_decay = PARAM_GROUP_RULES[rule][1]
    return [[n for n in names if not no_decay(n)], [n for n in names if no_decay(n)]]


def describe_rule(rule: str) -> str:
    return "one param group" if rule == "one" else PARAM_GROUP_RULES[rule][0]


def rule_of(optim: NxdOptimizer) -> str:
    """The param-group rule NxD's own tag was saved with (what its reader found), as a rule name: NxD's run
    that resumes it builds the same groups, so a rewrite keeps them unless told otherwise."""
    if len(optim.groups()) == (2 if optim.ep > 1 else 1):  # ep > 1: the non-expert groups, then the expert ones
        return "one"
    naming = optim.naming()
    return next(name for name, (description, _) in PARAM_GROUP_RULES.items() if description == naming)


# --------------------------------------------------------------------------------------------
# Row windows: a ZeRO-1 chunk of a planned tensor


@dataclasses.dataclass(frozen=True)
class RowWindow(Source):
    """Rows [start, start + count) of the tensor at (file, key); rows past its end read as zeros (ZeRO-1's
    padding), for a chunk of a tensor planned by columns (whose pieces cannot be cut by rows)."""

    start: int = 0
    count: int = 0

    @property
    def inner(self) -> Source:
        return Source(self.file, self.key, shard=self.shard)


@dataclasses.dataclass(frozen=True)
class SlabWindow(Source):
    """Experts [start, start + count) of the planned stacked tensor ``planned``, zero experts past its last: a
    ZeRO-1 chunk with padding, read as rows (the executor builds a stacked tensor from whole source experts only)."""

    planned: OutTensor | None = None
    start: int = 0
    count: int = 0


class WindowReader:
    """The executor's reader with :class:`RowWindow` and :class:`SlabWindow` sources answered from ``inner``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def info(self, source: Source) -> tuple[torch.dtype, tuple[int, ...], bool]:
        if isinstance(source, SlabWindow):
            assert source.planned is not None
            return source.planned.dtype, (source.count, *source.planned.shape[1:]), False
        if not isinstance(source, RowWindow):
            return self.inner.info(source)  # type: ignore[no-any-return]
        dtype, shape, column_major = self.inner.info(source.inner)
        return dtype, (source.count, *shape[1:]), column_major

    def read_rows(self, source: Source, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(source, SlabWindow):
            return self._slab_rows(source, start, stop, out)
        if not isinstance(source, RowWindow):
            return self.inner.read_rows(source, start, stop, out)  # type: ignore[no-any-return]
        dtype, shape, _ = self.inner.info(source.inner)
        lo, hi = min(source.start + start, shape[0]), min(source.start + stop, shape[0])
        target = out if out is not None else torch.empty((stop - start, *shape[1:]), dtype=dtype)
        target = target.view(stop - start, *shape[1:])
        if hi > lo:  # the source's rows straight into the target's (the executor's reused buffer), where the
            head = target[:hi - lo]  # reader honours ``out``; copied where it hands back a tensor of its own
            rows = self.inner.read_rows(source.inner, lo, hi, head)
            if rows.data_ptr() != head.data_ptr():
                head.copy_(rows)
        target[hi - lo:].zero_()
        return target

    def _slab_rows(self, source: SlabWindow, start: int, stop: int, out: torch.Tensor | None) -> torch.Tensor:
        planned = source.planned
        assert planned is not None
        lo, hi = source.start + start, min(source.start + stop, planned.slabs)
        shape = (stop - start, *planned.shape[1:])
        target = out.view(shape) if out is not None else torch.empty(shape, dtype=planned.dtype)
        if hi > lo:
            target[:hi - lo].copy_(slab_band(planned, lo, hi, self))
        target[max(hi - lo, 0):].zero_()
        return target

    def position(self, source: Source) -> int:
        position = getattr(self.inner, "position", None)
        if isinstance(source, SlabWindow):
            assert source.planned is not None
            source = source.planned.pieces[0].source
        inner = source.inner if isinstance(source, RowWindow) else source
        return position(inner) if position is not None else 0

    def finish_checks(self, *, workers: int = 8) -> int:
        return self.inner.finish_checks(workers=workers)  # type: ignore[no-any-return]


def row_chunk(tensor: OutTensor, start: int, count: int, key: str, dtype: torch.dtype) -> OutTensor:
    """Rows [start, start + count) of a planned tensor as a tensor of its own, zero rows past its end; of a stacked
    one (NxD's experts ``[E, in, out]``: torch-xla's ZeRO-1 chunks dim 0, so whole experts), its slabs."""
    if tensor.slabs:
        return _slab_chunk(tensor, start, count, key, dtype)
    rows = tensor.shape[0]
    if any(p.alternates for p in tensor.pieces):
        raise ConversionError(f"{tensor.key}: averaged K/V replicas cannot be cut into ZeRO-1 chunks")
    if tensor.dim != 0:  # pieces side by side: each source windowed by rows
        pieces = tuple(dataclasses.replace(p, source=RowWindow(p.source.file, p.source.key, start, count,
                                                               shard=p.source.shard))
                       for p in tensor.pieces)
        return OutTensor(key, dtype, (count, *tensor.shape[1:]), tensor.dim, pieces)
    out, offset = [], 0
    for piece in tensor.pieces:
        lo, hi = max(start, offset), min(start + count, offset + piece.length)
        if lo < hi:
            shift = lo - offset
            if piece.row_perm and (shift % len(piece.row_perm) or (hi - lo) % len(piece.row_perm)):
                raise ConversionError(f"{tensor.key}: a ZeRO-1 chunk boundary cuts a permuted head; use another dp")
            out.append(dataclasses.replace(piece, start=piece.start + shift, stop=piece.start + shift + hi - lo))
        offset += piece.length
    if start + count > rows:  # ZeRO-1's padding rows
        out.append(Piece(tensor.pieces[0].source, 0, start + count - max(start, rows), zeros=True))
    return OutTensor(key, dtype, (count, *tensor.shape[1:]), 0, tuple(out))


def _slab_chunk(tensor: OutTensor, start: int, count: int, key: str, dtype: torch.dtype) -> OutTensor:
    """Experts [start, start + count) of a stacked tensor; a chunk reaching past the last expert (ZeRO-1's padding)
    is read through a :class:`SlabWindow`, zero experts after the real ones."""
    if start + count > tensor.slabs:
        window = SlabWindow(tensor.pieces[0].source.file, tensor.key, tensor, start, count)
        return OutTensor(key, dtype, (count, *tensor.shape[1:]), 0, (Piece(window, 0, count),))
    pieces = [piece for slab in slab_pieces(tensor)[start:start + count] for piece in slab]
    return dataclasses.replace(tensor, key=key, dtype=dtype, shape=(count, *tensor.shape[1:]), pieces=tuple(pieces),
                               slabs=count, column_major=False)


def tensor_at(tensor: OutTensor) -> TensorAt:
    return TensorAt(tensor.key, TensorMeta.contiguous(tensor.dtype, tensor.shape))


# --------------------------------------------------------------------------------------------
# Param groups


def group_hyper(group: list[str], shapes: Mapping[str, Sequence[int]], ours: list[dict[str, Any]], g: int,
                 rule: str) -> dict[str, Any]:
    """The hyper-parameters of NxD group ``g``: those of nxdtrain's group (matrices, vectors) of its members,
    which must agree."""
    kinds = {0 if is_matrix(shapes[n]) else 1 for n in group}
    hypers = [{k: v for k, v in ours[k_].items() if k != "params"} for k_ in sorted(kinds)]
    if any(h != hypers[0] for h in hypers[1:]):
        differ = {k: (hypers[0].get(k), hypers[1].get(k)) for k in {*hypers[0], *hypers[1]}
                  if hypers[0].get(k) != hypers[1].get(k)}
        raise ConversionError(f"--nxd-param-groups {rule}: NxD's group {g} would hold matrices and vectors, which "
                              f"were stepped with different hyper-parameters (matrices, vectors: "
                              f"{dict(sorted(differ.items()))}); choose a rule that keeps them apart")
    return hypers[0] if hypers else dict(ours[0])


def nxd_param_group(hyper: Mapping[str, Any], *, zero1: bool, lr: float | None = None,
                    initial_lr: float | None = None) -> dict[str, Any]:
    """A param group's hyper-parameters with the keys, and in the order, NxD writes (``params`` added later);
    ``lr``/``initial_lr`` given: the schedule's next and peak lr (an nxdtrain source), else the source's."""
    values = {**_ADAMW_DEFAULTS, **hyper}
    if lr is not None:
        values["lr"] = lr
    if initial_lr is not None:
        values["initial_lr"] = initial_lr
    missing = [k for k in ("weight_decay", "lr", "betas", "eps", "initial_lr") if k not in values]
    if missing:
        raise ConversionError(f"the optimizer state's param groups lack {missing[0]!r}; NxD's files need it")
    values["betas"] = [float(b) for b in values["betas"]]  # NxD's files hold lists (its save rebuilds tuples)
    return {k: values[k] for k in (_ZERO1_GROUP if zero1 else _ADAMW_GROUP)}


def numbered_groups(hypers: Sequence[Mapping[str, Any]], groups: Sequence[Sequence[str]], *, zero1: bool,
                    lr: tuple[float, float] | None) -> list[dict[str, Any]]:
    """NxD's param groups: group ``g``'s hyper-parameters (``lr``: the schedule's next and peak lr, as
    :func:`nxd_param_group`) and its ``params``, the optimizer indices of ``groups[g]`` numbered from 0."""
    next_lr, peak = lr if lr is not None else (None, None)
    out, start = [], 0
    for hyper, group in zip(hypers, groups, strict=True):
        out.append({**nxd_param_group(hyper, zero1=zero1, lr=next_lr, initial_lr=peak),
                    "params": list(range(start, start + len(group)))})
        start += len(group)
    return out


def unwritten_fields(hypers: Sequence[Mapping[str, Any]]) -> set[str]:
    """The source's param-group fields NxD 2.28's AdamW has not (its files leave them out)."""
    return {k for h in hypers for k in h if k not in _ZERO1_GROUP}


def note_unwritten(fields: set[str], notes: list[str]) -> None:
    if fields:
        notes.append(f"param-group fields NxD 2.28's AdamW has not, not written: {', '.join(sorted(fields))}")


def checked_state(shard_path: str, weights: Mapping[str, OutTensor], order: Sequence[str],
                  optim: OptimizerSource) -> dict[str, dict[str, OutTensor]]:
    """Each parameter's planned optimizer tensors (:func:`state_tensors`), refused unless they are AdamW's step and
    moments (masters aside): what NxD's files hold."""
    state = {n: state_tensors(weights[n], optim) for n in order}
    for n in order:
        if set(state[n]) - {MASTER} != {STEP, *MOMENTS}:
            raise ConversionError(f"{shard_path}: {n!r} has optimizer state {sorted(state[n])}; NxD's files "
                                  "hold AdamW's step, exp_avg and exp_avg_sq")
    return state


@dataclasses.dataclass
class Zero1File:
    """A ZeRO-1 file's per-index content as it is planned (NeuronZero1Optimizer's at ep 1; at ep > 1 both of
    NeuronEPZero1Optimizer's, the expert indices at their offset)."""

    tensors: list[OutTensor] = dataclasses.field(default_factory=list)
    base_state: dict[int, dict[str, TensorAt]] = dataclasses.field(default_factory=dict)
    shape_info: dict[int, list[int]] = dataclasses.field(default_factory=dict)

    def add(self, i: int, name: str, weight: OutTensor, parts: Mapping[str, OutTensor], optim: OptimizerSource, *,
            world: int, rank: int, shard_path: str, dtypes: set[str]) -> tuple[torch.dtype, int]:
        """Index ``i`` (:func:`zero1_entry`); its optimizer dtype joins ``dtypes``. Returns (dtype, chunk rows)."""
        entry, dtype, rows = zero1_entry("base_state", i, weight, parts, optim, world=world, rank=rank,
                                         shard_path=shard_path, name=name)
        dtypes.add(str(dtype).removeprefix("torch."))
        self.tensors += entry.values()
        self.base_state[i] = {k: tensor_at(t) for k, t in entry.items()}
        self.shape_info[i] = list(weight.shape)
        return dtype, rows


def note_drop_masters(notes: list[str], *, dropped: bool, kept: str) -> None:
    """What ``--drop-masters`` did, at every ep: the masters ``dropped``, or nothing (``kept``: why)."""
    notes.append("--drop-masters: the source's master weights are not written (NxD's expert-parallel ZeRO-1 files "
                 "hold none; NxD's resume takes them from the weights)" if dropped else
                 f"--drop-masters: nothing dropped ({kept})")


def zero1_entry(where: str, i: int, weight: OutTensor, parts: Mapping[str, OutTensor], optim: OptimizerSource, *,
                world: int, rank: int, shard_path: str, name: str) -> tuple[dict[str, OutTensor], torch.dtype, int]:
    """Optimizer index ``i`` of a ZeRO-1 file: its step, and rank ``rank``'s dim-0 chunk (of ``world``) of each
    moment in the optimizer dtype; with that dtype and the chunk's rows (the chunk starts at ``rank * rows``)."""
    if not weight.shape:
        raise ConversionError(f"{shard_path}: {name!r} is a scalar; NxD's ZeRO-1 partitions dim 0")
    dtype = optimizer_dtype(optim, weight)
    rows = math.ceil(weight.shape[0] / world)
    entry = {STEP: dataclasses.replace(parts[STEP], key=f"{where}.{i}.step", dtype=torch.float32)}
    for m in MOMENTS:
        entry[m] = row_chunk(parts[m], rank * rows, rows, f"{where}.{i}.{m}", dtype)
    return entry, dtype, rows


# --------------------------------------------------------------------------------------------
# The plan


NXD_OPTIMIZER_KEY = "nxd_optimizer"  # ckptconv.json extra: the tag's optim/ was written here in NxD's format


@dataclasses.dataclass(frozen=True)
class NxdOptimizerPlan:
    """How the target's optimizer files are written, recorded in ckptconv.json (``extra.nxd_optimizer``)."""

    rule: str
    zero1: bool
    dp: int
    masters: str          # "saved" (the source's), "weights" (the weights widened), "none" (ZeRO-1 off)
    dtype: str            # the optimizer dtype (ZeRO-1), or "parameter" (moments in the parameter's dtype)
    names: dict[ShardId, list[str]] = dataclasses.field(default_factory=dict)  # model shard -> name per index

    def to_json(self) -> dict[str, Any]:
        return {"format": "nxd", "param_groups": self.rule, "param_groups_rule": describe_rule(self.rule),
                "zero1": self.zero1, "dp": self.dp, "masters": self.masters, "dtype": self.dtype}


def optimizer_dtype(optim: OptimizerSource, weight: OutTensor) -> torch.dtype:
    """ZeRO-1's optimizer dtype: the source's masters' (fp32, fp64 under XLA_DOWNCAST_BF16), else its moments'
    where they are fp32/fp64, else fp32."""
    first = weight.pieces[0].source
    components = optim.components_of(first)
    for component in (MASTER, MOMENTS[0]):
        if component in components:
            dtype = optim.info(component_source(first, component))[0]
            if dtype in (torch.float32, torch.float64):
                return dtype
    return torch.float32


def index_order(shard: OutFile, rule: str) -> list[str]:
    """A target shard's parameters in NxD's optimizer index order: the param groups of ``rule`` one after another,
    each in the shard's order."""
    return [n for g in nxd_groups([t.key for t in shard.tensors if not t.key.endswith("inv_freq")], rule) for n in g]


@dataclasses.dataclass
class _Written:
    """What the planned files hold, for the notes and the :class:`NxdOptimizerPlan`."""

    masters_kind: str = "none"  # "saved", "weights" (ZeRO-1 masters made from the weights) or "none"
    dtypes: set[str] = dataclasses.field(default_factory=set)  # the optimizer dtypes of ZeRO-1 files
    narrowed: list[str] = dataclasses.field(default_factory=list)  # fp32 state rounded (files without ZeRO-1)
    dropped: set[str] = dataclasses.field(default_factory=set)  # param-group fields NxD's AdamW has not


def plan_nxd_optimizer_files(shards: Sequence[OutFile], optim: OptimizerSource, *, dp: int, zero1: bool, rule: str,
                             drop_masters: bool, lr: tuple[float, float] | None,
                             notes: list[str]) -> tuple[list[OutFile], NxdOptimizerPlan]:
    """NxD-format optimizer files for the target shards ``shards`` (a reshard plan's files).

    ``lr``: (next lr, peak lr) of the schedule for the param groups (an nxdtrain source); None: the source's
    own (NxD's param groups). A bf16 model's fp32 state (masters, fp32 moments) fits NxD's files only with
    ZeRO-1: without it the state is refused unless ``drop_masters`` (masters dropped, moments rounded).
    """
    out: list[OutFile] = []
    ours = optim.hyper.param_groups
    written, names_of = _Written(), {}
    for shard in shards:
        tp, pp = shard.shard_id.tp, shard.shard_id.pp
        weights = {t.key: t for t in shard.tensors if not t.key.endswith("inv_freq")}
        shapes = {k: t.shape for k, t in weights.items()}
        groups = nxd_groups(list(weights), rule)
        order = index_order(shard, rule)
        hypers = [group_hyper(g, shapes, ours, i, rule) for i, g in enumerate(groups)]
        written.dropped.update(unwritten_fields(hypers))
        param_groups = numbered_groups(hypers, groups, zero1=zero1, lr=lr)
        names_of[shard.shard_id] = order
        state = checked_state(shard.path, weights, order, optim)
        for dp_rank in range(dp if zero1 else 1):
            out.append(_optimizer_file(shard.path, optimizer_file(tp_rank=tp, pp_rank=pp, dp_rank=dp_rank), order,
                                       weights, state, param_groups, optim, dp=dp, dp_rank=dp_rank, zero1=zero1,
                                       written=written))
    _refuse_or_note(written, shards, drop_masters=drop_masters, zero1=zero1, notes=notes)
    plan = NxdOptimizerPlan(rule, zero1, dp if zero1 else 1, written.masters_kind,
                            "/".join(sorted(written.dtypes)) if zero1 else "parameter", names_of)
    return out, plan


def _optimizer_file(shard_path: str, path: str, order: list[str], weights: dict[str, OutTensor],
                    state: dict[str, dict[str, OutTensor]], param_groups: list[dict[str, Any]], optim: OptimizerSource,
                    *, dp: int, dp_rank: int, zero1: bool, written: _Written) -> OutFile:
    """One dp rank's optimizer file of one (tp, pp) rank: torch AdamW's state dict, or with ``zero1``
    NeuronZero1Optimizer's (this dp rank's dim-0 chunk of every tensor, and its masters)."""
    z = Zero1File()
    by_index: dict[int, dict[str, TensorAt]] = {}  # without ZeRO-1: torch AdamW's state
    masters: dict[int, TensorAt] = {}
    for i, name in enumerate(order):
        weight, parts = weights[name], state[name]
        if zero1:
            dtype, rows = z.add(i, name, weight, parts, optim, world=dp, rank=dp_rank, shard_path=shard_path,
                                dtypes=written.dtypes)
            master = parts.get(MASTER, weight)
            written.masters_kind = "saved" if MASTER in parts else "weights"
            chunk = row_chunk(master, dp_rank * rows, rows, f"sharded_master_weights.{i}", dtype)
            masters[i] = tensor_at(chunk)
            z.tensors.append(chunk)
        else:
            entry = {STEP: dataclasses.replace(parts[STEP], key=f"state.{i}.step", dtype=torch.float32)}
            for m in MOMENTS:
                if parts[m].dtype.itemsize > weight.dtype.itemsize:
                    written.narrowed.append(name)
                entry[m] = dataclasses.replace(parts[m], key=f"state.{i}.{m}", dtype=weight.dtype)
            if MASTER in parts:
                written.narrowed.append(name)
            z.tensors += entry.values()
            by_index[i] = {k: tensor_at(t) for k, t in entry.items()}
    plain: tuple[tuple[str, Any], ...]
    if zero1:
        plain = (("state", {}), ("param_groups", param_groups), ("base_state", z.base_state),
                 ("shape_info", z.shape_info), ("sharded_master_weights", masters))
    else:
        plain = (("state", by_index), ("param_groups", param_groups))
    return OutFile(path, NESTED_TORCH, tuple(z.tensors), plain)


def _refuse_or_note(written: _Written, shards: Sequence[OutFile], *, drop_masters: bool, zero1: bool,
                    notes: list[str]) -> None:
    """Refuse fp32 state that NxD's files without ZeRO-1 cannot hold (unless ``drop_masters``); else say what
    was dropped, rounded or made."""
    if written.narrowed and not drop_masters:
        raise ConversionError(f"{written.narrowed[0]!r}: a bf16 model's fp32 optimizer state (masters, moments) fits "
                              "NxD's files only with ZeRO-1 (NxD keeps no fp32 copy without it): pass --zero1, or "
                              "--drop-masters to drop the masters and round the moments to the parameter dtype")
    if drop_masters and zero1:
        note_drop_masters(notes, dropped=False, kept="NxD's ZeRO-1 files keep the masters and fp32 moments")
    if written.narrowed:
        notes.append("--drop-masters: NxD's format without ZeRO-1 keeps no fp32 state: the fp32 masters were "
                     "dropped and the moments rounded to the parameters' dtype (a resume continues from the "
                     "bf16 weights)")
    note_unwritten(written.dropped, notes)
    if written.masters_kind == "weights":
        notes.append("sharded_master_weights written from the weights (the source saved no masters)"
                     + ("; a bf16 model's masters are its weights widened, as NxD's own resume rebuilds them"
                        if any(t.dtype == torch.bfloat16 for f in shards for t in f.tensors) else ""))


# --------------------------------------------------------------------------------------------
# The check after writing


def check_written(out: Path, plan: NxdOptimizerPlan) -> None:
    """Read what was written back with NxD's reader (:class:`ckptconv.training.nxd_format.read.NxdOptimizer`): every
    optimizer index must be named as intended (the rule recorded must be the one the reader finds)."""
    with NxdOptimizer(NxdCheckpoint(out, io="read"), io="read") as optim:
        for ranks, names in plan.names.items():
            found = optim.names(ranks.tp, ranks.pp, ranks.ep)
            if found != names:
                first = next((i for i, (a, b) in enumerate(zip(found, names, strict=False)) if a != b), len(found))
                at = f"tp rank {ranks.tp} pp rank {ranks.pp}" + (f" ep rank {ranks.ep}" if optim.ep > 1 else "")
                raise ConversionError(f"{out}: read back, {at}'s optimizer index {first} names "
                                      f"{found[first] if first < len(found) else None!r}, written for "
                                      f"{names[first] if first < len(names) else None!r}")
        if optim.dp != plan.dp and plan.zero1:
            raise ConversionError(f"{out}: read back with dp {optim.dp}, written for {plan.dp}")
