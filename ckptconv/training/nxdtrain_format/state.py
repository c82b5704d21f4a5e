"""A training tag's optimizer state in a layout-neutral form, and how it moves with a conversion plan.

An optimizer tensor of a parameter (AdamW's ``exp_avg``/``exp_avg_sq``, the fp32 ``master`` of a bf16
run) has exactly its parameter's layout, so it is one more record of the same plan: wherever a plan
reads weight rows ``Source(file, key)[a:b]``, the moment reads ``Source(file, "exp_avg:" + key)[a:b]``
(:func:`component_source`). A 0-dim tensor (AdamW's per-parameter ``step``) is carried as it is.

The neutral form of one optimizer file (``FORMAT`` 2, a flat torch zip that is read lazily and written
in bands like a shard)::

    format: 2, names: [stage parameter names], zero1: bool, zero_size: int, dp_rank: int,
    owned: [names whose state this file holds],
    param_groups: [hyper-parameters of group 0 (matrices, decayed), of group 1 (vectors)],
    ep: int, ep_rank: int,   (expert parallelism only: which ep rank's experts the file holds state of)
    "state.<name>.<component>": tensor, ...

Which dp rank's file holds which parameter: :mod:`ckptconv.training.nxdtrain_format.placement`.

Format 1 files (nxdtrain before this format: a torch optimizer ``state_dict`` indexed by position) are read
as lazily, by mapping positions back to names (:func:`neutral_from_format1`); what cannot be mapped is refused.
TorchTitan's export builds on the same per-name view (:class:`TagOptimizer`).

    >>> state_key("model.norm.weight", "exp_avg")
    'state.model.norm.weight.exp_avg'
    >>> zero1_partition([[("a", 6), ("b", 4), ("c", 4)], [("n", 1)]], 2)
    [[['a'], ['n']], [['b', 'c'], []]]
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from ckptconv.core.layout import ParallelLayout, layout_shard_file, parse_rank_file, shard_name
from ckptconv.core.mapping import all_ep_shard_records, expert_keys, hf_record_shape, hf_shapes, stores_lm_head
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import OutFile, OutTensor, Piece, ReplicaGroup, Source
from ckptconv.errors import ConversionError
from ckptconv.io import tags
from ckptconv.io.checked import CheckedFiles
from ckptconv.io.metadata import METADATA_FILE
from ckptconv.io.safe_load import PickledTensor
from ckptconv.io.tags import OPTIM_DIR
from ckptconv.io.torchzip_read import StoredTensor, TorchZipReader, is_row_major
from ckptconv.training.ep import optimizer_ep_rank
from ckptconv.training.nxdtrain_format.placement import (
    FORMAT,
    optimizer_file,
    optimizer_files,
    stage_groups,
    zero1_partition,
)
from ckptconv.training.nxdtrain_format.placement import is_matrix as is_matrix  # where ckptconv.titan reads it

MASTER = "master"
_SEP = ":"  # "<component>:<nxd key>" names an optimizer tensor in a plan's Source
def state_key(name: str, component: str) -> str:
    """The key of a parameter's optimizer tensor in a format-2 file."""
    return f"state.{name}.{component}"


def component_source(source: Source, component: str) -> Source:
    """Where ``component`` of the parameter stored at ``source`` lies (the plan's key for it)."""
    return Source(source.file, f"{component}{_SEP}{source.key}", shard=source.shard)


def split_key(key: str) -> tuple[str | None, str]:
    """``(component, nxd key)`` of a plan Source key; component None for a weight."""
    component, sep, name = key.partition(_SEP)
    return (component, name) if sep else (None, key)


def plain_group(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters (no parameter list) as fresh plain values with interned keys, so that
    the same values pickle to the same bytes whether they were just set or loaded from a file."""
    return {sys.intern(str(k)): tuple(v) if isinstance(v, (list, tuple)) else v
            for k, v in group.items() if k != "params"}


# --------------------------------------------------------------------------------------------
# Reading: format 1 mapped to names


def _tensor_like(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, PickledTensor))


def neutral_from_format1(state: Mapping[str, Any], shapes: Mapping[str, Sequence[int]], *, dp_rank: int,
                         where: str) -> dict[str, Any]:
    """A format-1 file's content as format 2 (same keys as :func:`FORMAT` files), positions mapped to names.
    Its tensors may be tensors or, read lazily, :class:`~ckptconv.io.safe_load.PickledTensor` stand-ins.

    Format 1 indexes a torch optimizer's state by position: group 0's parameters, then group 1's, each
    in the stage's parameter order (or, with ZeRO-1, in the order ZeroRedundancyOptimizer gave this dp
    rank). Every tensor's shape is checked against its parameter's: a file that does not map exactly is
    refused, never misread.
    """
    names = list(state["names"])
    zero1, zero_size = bool(state.get("zero1")), int(state.get("zero_size", 1))
    missing = [n for n in names if n not in shapes]
    if missing:
        raise ConversionError(f"{where}: optimizer state names parameter {missing[0]!r}, which this layout does not have")
    groups = stage_groups(names, shapes)
    local = (zero1_partition(groups, zero_size)[dp_rank] if zero1 else [[n for n, _ in g] for g in groups])
    optimizer = state["optimizer"]
    saved_groups = optimizer.get("param_groups", [])
    if len(saved_groups) != len(local):
        raise ConversionError(f"{where}: {len(saved_groups)} param groups, expected {len(local)}")
    out: dict[str, Any] = {"format": FORMAT, "names": names, "zero1": zero1, "zero_size": zero_size,
                           "dp_rank": dp_rank, "owned": [n for g in local for n in g],
                           "param_groups": [plain_group(g) for g in saved_groups]}
    for group, group_names in zip(saved_groups, local, strict=True):
        if len(group["params"]) != len(group_names):
            raise ConversionError(f"{where}: a param group holds {len(group['params'])} parameters, the layout "
                                  f"implies {len(group_names)}; not nxdtrain state of this layout")
        for index, name in zip(group["params"], group_names, strict=True):
            for component, value in optimizer.get("state", {}).get(index, {}).items():
                if not _tensor_like(value):
                    continue
                if len(value.shape) and tuple(value.shape) != tuple(shapes[name]):
                    raise ConversionError(f"{where}: state {index} ({component}) has shape {list(value.shape)}, "
                                          f"parameter {name!r} has {list(shapes[name])}")
                out[state_key(name, component)] = value
    for name, value in (state.get("master") or {}).items():
        out[state_key(name, MASTER)] = value
    return out


# --------------------------------------------------------------------------------------------
# A tag's optimizer files, indexed by parameter


class _OptimFile:
    """One optimizer file, read lazily: format 2 as it is, format 1 with its positions mapped to names."""

    def __init__(self, path: Path, dp_rank: int, shapes: Mapping[str, Sequence[int]], checks: CheckedFiles | None,
                 io: str) -> None:
        self.path = path
        try:
            self._zip = TorchZipReader(path, io=io, checks=checks)
        except ConversionError:  # a damaged file (its checks): said as for shards
            raise
        except ValueError as exc:
            reason = "empty file" if path.stat().st_size == 0 else str(exc).removeprefix(f"{path}: ")
            raise ConversionError(f"{path}: not an optimizer file ({reason}); use another tag, or "
                                  "--weights-only for the weights alone") from None
        try:
            entries = {k: self._zip.entry(k) for k in self._zip.keys()}
            version = entries.get("format")
            if version == 1:
                entries = neutral_from_format1(entries, shapes, dp_rank=dp_rank, where=str(path))
                for key, value in entries.items():
                    if isinstance(value, PickledTensor):
                        self._zip.adopt(key, value)
            elif version != FORMAT:
                raise ConversionError(f"{path}: optimizer state format {version!r}; this ckptconv reads formats 1 "
                                      f"and {FORMAT} (nxdtrain's)")
        except BaseException:
            self._zip.close()
            raise
        self.format = FORMAT if version == FORMAT else 1
        self.plain: dict[str, Any] = {k: v for k, v in entries.items() if not _stored_or_pickled(v)}
        self.tensors = [k for k, v in entries.items() if _stored_or_pickled(v)]

    def tensor_keys(self) -> list[str]:
        return self.tensors

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...], bool]:
        entry = self._zip.entry(key)
        return entry.dtype, tuple(entry.shape), not is_row_major(tuple(entry.shape), tuple(entry.stride))

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._zip.read_rows(key, start, stop, out)

    def read_slab_rows(self, key: str, slab: int, start: int, stop: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return self._zip.read_slab_rows(key, slab, start, stop, out)

    def position(self, key: str) -> int:
        """File offset of the tensor's first byte."""
        entry = self._zip.entry(key)
        return entry.data_offset + entry.storage_offset * entry.dtype.itemsize

    def close(self) -> None:
        self._zip.close()


def _stored_or_pickled(value: Any) -> bool:
    return isinstance(value, (StoredTensor, PickledTensor))


def stage_shapes(spec: ModelSpec, layout: ParallelLayout, *, lm_head_copy: bool = True) -> dict[tuple[int, int, int], dict[str, tuple[int, ...]]]:
    """Per shard (ep, tp, pp): every parameter's shape in the shards of ``layout`` (buffers such as inv_freq left
    out); ep rank 0 alone without expert parallelism."""
    shapes = hf_shapes(spec, with_inv_freq=layout.with_inv_freq)
    return {
        ranks: {r.key: hf_record_shape(r, shapes[r.segments[0].hf_key]) for r in records
                if not r.key.endswith("inv_freq")}
        for ranks, records in all_ep_shard_records(spec, layout, lm_head_copy=lm_head_copy).items()
    }


@dataclass(frozen=True)
class Hyper:
    """What a tag's optimizer files say about the whole optimizer."""

    param_groups: list[dict[str, Any]]  # hyper-parameters per group (no parameter lists)
    zero1: bool
    zero_size: int
    components: tuple[str, ...]         # e.g. ("step", "exp_avg", "exp_avg_sq", "master")
    formats: tuple[int, ...]            # the file formats found


class OptimizerSource(Protocol):
    """What a plan reads optimizer tensors through: :class:`TagOptimizer` (nxdtrain's files) or
    :class:`ckptconv.training.nxd_format.as_source.NxdTagOptimizer` (NxD's own)."""

    hyper: Hyper

    def components_of(self, source: Source) -> list[str]: ...

    def info(self, source: Source) -> tuple[torch.dtype, tuple[int, ...], bool]: ...

    def read_rows(self, source: Source, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def finish_checks(self, *, workers: int = 8) -> int: ...

    def close(self) -> None: ...


class TagOptimizer:
    """The optimizer files of a training tag (``optim/``), indexed by (shard, parameter).

    A ``TensorReader`` for Sources ``Source(model shard file, "<component>:<key>")`` (see :func:`component_source`):
    the tensor ``component`` of parameter ``key`` of that shard, from whichever dp rank's file holds it. With expert
    parallelism a file of dp rank ``d`` holds state of the non-expert parameters (of ep rank 0's shard) and of the
    experts of ep rank ``d % ep`` (:func:`optimizer_ep_rank`, docs/nxd-optimizer-format.md).
    """

    def __init__(self, root: Path, spec: ModelSpec, layout: ParallelLayout, *, lm_head_copy: bool = True, checks: CheckedFiles | None = None, io: str = "mmap",
                 only: Iterable[tuple[int, ...]] | None = None) -> None:
        """``only``: open just the files these shards' state lies in (what one training rank reads): ``(tp, pp)``
        every ep rank's, ``(ep, tp, pp)`` that ep rank's (see :meth:`widen`)."""
        self.root, self.layout = root, layout
        self._experts = expert_keys(spec) if layout.ep > 1 else frozenset()
        shapes = stage_shapes(spec, layout, lm_head_copy=lm_head_copy)
        directory = root / OPTIM_DIR
        found: dict[tuple[int, int, int], Path] = {}
        for path in sorted(directory.iterdir()) if directory.is_dir() else []:
            ranks = parse_rank_file(path.name)
            if ranks:
                dp, tp, pp = ranks
                found[(tp, pp, dp)] = path
        # dp rank e holds (the first part of) ep rank e's expert state, dp rank 0 the rest's
        missing = [(ep, tp, pp) for ep, tp, pp in shapes if (tp, pp, ep) not in found]
        if missing:
            ep, tp, pp = missing[0]
            of = f" (ep rank {ep})" if layout.ep > 1 else ""
            raise ConversionError(f"{directory}: no optimizer file {shard_name(tp_rank=tp, pp_rank=pp, dp_rank=ep)}"
                                  f"{of} for tp rank {tp} pp rank {pp} (expected a tag of layout tp {layout.tp} "
                                  f"pp {layout.pp}" + (f" ep {layout.ep})" if layout.ep > 1 else ")"))
        self._files: list[_OptimFile] = []
        self._where: dict[tuple[str, str], tuple[_OptimFile, str]] = {}  # (shard file, component:key) -> file, key
        self._found, self._shapes, self._checks, self._io = found, shapes, checks, io
        self._opened: set[tuple[int, int, int]] = set()  # (tp, pp, dp) of the files opened
        self._components: dict[str, None] = {}
        self._formats: set[int] = set()
        for (tp, pp, _), path in sorted(found.items()):
            if (0, tp, pp) not in shapes:
                raise ConversionError(f"{path}: tp rank {tp} pp rank {pp} is outside layout tp {layout.tp} pp {layout.pp}")
        try:
            self._open(None if only is None else set(only))
        except BaseException:
            self.close()
            raise
        first = self._files[0]
        self.hyper = Hyper(list(first.plain.get("param_groups", [])), bool(first.plain.get("zero1")),
                           int(first.plain.get("zero_size", 1)), tuple(sorted(self._components, key=_component_order)),
                           tuple(sorted(self._formats)))

    def _wanted(self, ranks: set[tuple[int, ...]] | None, tp: int, pp: int, ep: int) -> bool:
        """Whether file (tp, pp, dp) of ep rank ``ep`` (:func:`optimizer_ep_rank` of its dp) may hold state of a
        shard of ``ranks`` (None: every shard): any file of a (tp, pp) the non-expert state of its ep rank 0 shard,
        the files of ep rank e's dp ranks its experts'."""
        if ranks is None:
            return True
        return any(r == (tp, pp) or r in ((0, tp, pp), (ep, tp, pp)) for r in ranks)

    def _stage(self, tp: int, pp: int, ep: int) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
        """The parameters whose state the file of (tp, pp, dp) of ep rank ``ep`` may hold, each with its shard file,
        and their shapes."""
        shapes = self._shapes[(0, tp, pp)]
        where = {name: layout_shard_file(self.layout, ep_rank=0, tp_rank=tp, pp_rank=pp)
                 for name in shapes if name not in self._experts}
        if self._experts:
            shard = layout_shard_file(self.layout, ep_rank=ep, tp_rank=tp, pp_rank=pp)
            where.update({name: shard for name in self._shapes[(ep, tp, pp)] if name in self._experts})
            shapes = {**shapes, **self._shapes[(ep, tp, pp)]}
        return where, {n: shapes[n] for n in where}

    def _open(self, ranks: set[tuple[int, ...]] | None) -> None:
        """Open the files (every dp rank's) that may hold state of these shards, dp rank 0's first."""
        for (tp, pp, dp), path in sorted(self._found.items(), key=lambda item: (item[0][2], item[0][1], item[0][0])):
            ep = optimizer_ep_rank(dp, self.layout.ep)
            if (tp, pp, dp) in self._opened or not self._wanted(ranks, tp, pp, ep):
                continue
            stage, shapes = self._stage(tp, pp, ep)
            optim = _OptimFile(path, dp, shapes, self._checks, self._io)
            self._files.append(optim)
            self._opened.add((tp, pp, dp))
            self._formats.add(optim.format)
            self._check_ep(optim, dp, ep)
            for key in optim.tensor_keys():
                name, component = _parse_state_key(key, stage, str(path))
                self._components.setdefault(component)
                self._where.setdefault((stage[name], f"{component}{_SEP}{name}"), (optim, key))

    def _check_ep(self, optim: _OptimFile, dp: int, ep_rank: int) -> None:
        """A file's own ep record (format 2 at ep > 1) must be the layout's (``ep_rank``: :func:`optimizer_ep_rank`
        of ``dp``): a tag's files are never misread."""
        ep, rank = int(optim.plain.get("ep", 1)), int(optim.plain.get("ep_rank", 0))
        if (ep, rank) != (self.layout.ep, ep_rank):
            raise ConversionError(f"{optim.path}: optimizer state of ep {ep} (ep rank {rank}), but the shards are of "
                                  f"ep {self.layout.ep} (dp rank {dp}: ep rank {ep_rank})")

    def widen(self, ranks: Iterable[tuple[int, ...]]) -> None:
        """Open the files of these shards too (a reshard's part: the ranks its files read; as ``only``).
        They must hold the components the first files opened said the optimizer has, and no other."""
        self._open(set(ranks))
        if tuple(sorted(self._components, key=_component_order)) != self.hyper.components:
            raise ConversionError(f"{self.root / OPTIM_DIR}: optimizer files hold different components: "
                                  f"{sorted(self._components)}, the first ones {list(self.hyper.components)}")

    @property
    def files(self) -> list[_OptimFile]:
        return list(self._files)

    def names_with(self, shard: str, component: str) -> list[str]:
        """The parameters of ``shard`` that have ``component`` (e.g. fp32 masters)."""
        prefix = f"{component}{_SEP}"
        return [key[len(prefix):] for file, key in self._where if file == shard and key.startswith(prefix)]

    def components_of(self, source: Source) -> list[str]:
        """The optimizer tensors the parameter stored at ``source`` has (none: plain SGD)."""
        return [c for c in self.hyper.components if (source.file, f"{c}{_SEP}{source.key}") in self._where]

    def _lookup(self, source: Source) -> tuple[_OptimFile, str]:
        try:
            return self._where[(str(source.file), source.key)]
        except KeyError:
            component, name = split_key(source.key)
            raise ConversionError(f"{self.root / OPTIM_DIR}: no {component} state for {name!r} of {source.file}") from None

    def info(self, source: Source) -> tuple[torch.dtype, tuple[int, ...], bool]:
        optim, key = self._lookup(source)
        return optim.info(key)

    def read_rows(self, source: Source, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        optim, key = self._lookup(source)
        return optim.read_rows(key, start, stop, out)

    def read_slab_rows(self, source: Source, slab: int, start: int, stop: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of one expert's state (``slab`` of a stacked tensor), reading only their bytes."""
        optim, key = self._lookup(source)
        return optim.read_slab_rows(key, slab, start, stop, out)

    def position(self, source: Source) -> int:
        """Where the tensor's bytes start in its optimizer file (the executor reads each file front to back, so its
        check hashes what the workers read instead of reading the file a second time)."""
        optim, key = self._lookup(source)
        return optim.position(key)

    def finish_checks(self, *, workers: int = 8) -> int:
        """Nothing of its own: its files are checked with the shards' checks it was given."""
        return 0

    def close(self) -> None:
        for optim in self._files:
            optim.close()


def lm_head_copy_of(ckpt: Any, spec: ModelSpec, layout: ParallelLayout) -> bool:
    """Whether ``ckpt``'s shards carry ``lm_head.weight`` (a tied model's copy, or untied): the last stage's tp-0
    file says it for every file (one header read, not every file's)."""
    return stores_lm_head(spec, ckpt.keys(layout_shard_file(layout, ep_rank=0, tp_rank=0, pp_rank=layout.pp - 1)))


# torch's AdamW creates its state in this order (and nxdtrain saves it so); masters come last
_COMPONENTS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", MASTER)


def _component_order(component: str) -> tuple[int, str]:
    """Components in one order whatever file order the source had (equal inputs give equal bytes)."""
    return (_COMPONENTS.index(component) if component in _COMPONENTS else len(_COMPONENTS), component)


def _parse_state_key(key: str, shapes: Mapping[str, Any], where: str) -> tuple[str, str]:
    if key.startswith("state."):
        name, _, component = key[len("state."):].rpartition(".")
        if name in shapes and component:
            return name, component
    raise ConversionError(f"{where}: unexpected key {key!r} (expected state.<parameter>.<component>)")


class TagReader:
    """The executor's reader over a tag: weights from its shards, optimizer tensors from :class:`TagOptimizer`."""

    def __init__(self, shards: Any, optim: OptimizerSource) -> None:
        self.shards, self.optim = shards, optim
        # Rows of one expert read alone where both sides can (the executor asks ``hasattr``): else an expert's state
        # is read a whole slab at a time, and its band can be several times a worker's share of --max-memory.
        if hasattr(shards, "read_slab_rows") and hasattr(optim, "read_slab_rows"):
            self.read_slab_rows = self._read_slab_rows

    def _read_slab_rows(self, source: Source, slab: int, start: int, stop: int,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        return self._of(source).read_slab_rows(source, slab, start, stop, out)  # type: ignore[no-any-return]

    def _of(self, source: Source) -> Any:
        return self.optim if split_key(source.key)[0] is not None else self.shards

    def info(self, source: Source) -> tuple[torch.dtype, tuple[int, ...], bool]:
        return self._of(source).info(source)  # type: ignore[no-any-return]

    def read_rows(self, source: Source, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._of(source).read_rows(source, start, stop, out)  # type: ignore[no-any-return]

    def position(self, source: Source) -> int:
        position = getattr(self._of(source), "position", None)
        return position(source) if position is not None else 0

    def finish_checks(self, *, workers: int = 8) -> int:
        return self.shards.finish_checks(workers=workers)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# Planning: the optimizer files of a target layout


def state_tensors(weight: OutTensor, optim: OptimizerSource) -> dict[str, OutTensor]:
    """The optimizer tensors of the parameter ``weight`` (a planned shard tensor) by component, read like it."""
    out = {}
    first = weight.pieces[0].source
    for component in optim.components_of(first):
        dtype, shape, _ = optim.info(component_source(first, component))
        if not shape:  # a scalar (AdamW's step): carried as it is
            out[component] = OutTensor(state_key(weight.key, component), dtype, (), 0,
                                       (Piece(component_source(first, component), 0, 1),))
            continue
        # the same rows of the same slab (an expert), transposed as the weight is; padding rows: zero moments
        pieces = tuple(replace(p, source=component_source(p.source, component), alternates=()) for p in weight.pieces)
        # stacked as the weight is (experts: slabs, transposed); moments always row-major (they split into bands)
        out[component] = replace(weight, key=state_key(weight.key, component), dtype=dtype, pieces=pieces,
                                 column_major=False)
    return out


def state_replicas(replicas: Sequence[ReplicaGroup], optim: OptimizerSource) -> list[ReplicaGroup]:
    """The weights' replica groups (K/V heads, norms, a tied head) for every optimizer tensor: copies must agree."""
    out = []
    for group in replicas:
        for component in optim.components_of(group.copies[0].source):
            _, shape, _ = optim.info(component_source(group.copies[0].source, component))
            if shape:
                copies = tuple(replace(p, source=component_source(p.source, component), alternates=())
                               for p in group.copies)
                out.append(ReplicaGroup(f"{group.hf_key} ({component})", group.dim, group.start, group.stop, copies))
    return out


def describe_zero1(on: bool, size: int, *, off: str = "no ZeRO-1") -> str:
    """How a tag's (or a run's) optimizer state is placed, for the notes of a reshard or a resume."""
    return f"ZeRO-1 over {size} dp rank{'s' if size != 1 else ''}" if on else off


def plan_optimizer_files(shards: Sequence[OutFile], optim: OptimizerSource, *, dp: int, zero1: bool) -> list[OutFile]:
    """Format-2 optimizer files for the target shards ``shards`` (a reshard plan's files), over ``dp``
    ranks with ZeRO-1 (the partition recomputed, :func:`zero1_partition`) or one file per shard without."""
    return optimizer_files(shards, lambda _, weight: state_tensors(weight, optim), optim.hyper.param_groups,
                           dp=dp, zero1=zero1)


# --------------------------------------------------------------------------------------------
# A training tag's side files (nxdtrain writes them; ckptconv reshard carries them)

SCHEDULER_FILE, USER_CONTENT_FILE = tags.SCHEDULER_FILE, tags.USER_CONTENT_FILE  # the names: ckptconv.io.tags


def is_training_tag(root: Path) -> bool:
    """A tag nxdtrain saved: its optimizer state (format 1 or 2) and side files beside the shards (not a
    converted directory, nor a tag of NxD's own, whose optimizer files ckptconv.training.nxd_format.read reads)."""
    first = root / optimizer_file(tp_rank=0, pp_rank=0, dp_rank=0)
    if not (first.is_file() and (root / USER_CONTENT_FILE).is_file()):
        return False
    try:
        with TorchZipReader(first, io="read") as reader:  # data.pkl only; the conversion checks what it reads
            return "format" in reader.keys() and reader.entry("format") in (1, FORMAT)
    except (ValueError, OSError):
        # A damaged file: a tag ckptconv or nxdtrain wrote (NxD writes no ckptconv.json) is still ours, so that
        # its reader reports the damage in its words instead of NxD's reader failing on it.
        return (root / METADATA_FILE).is_file()


def resharded_user_content(content: Mapping[str, Any], new: ParallelLayout, *, zero1: bool) -> dict[str, Any]:
    """``user_content.pt`` of a tag moved to layout ``new``: step, consumed samples and the run's options
    carried; the layout and the layout options say the new one; the per-rank RNG states are dropped (they
    belong to the old world's ranks; nxdtrain's training draws no random numbers and says so on resume)."""
    options = dict(content.get("options", {}))
    options.update({k: v for k, v in (("tp", new.tp), ("pp", new.pp), ("ep", new.ep), ("zero1", zero1))
                    if k in options})
    return {**content, "rng": [], "options": options, "layout": new.to_json()}
