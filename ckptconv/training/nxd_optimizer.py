"""NxD's own optimizer files (``optim/`` of a tag written by NxD's ``save_checkpoint``), read per parameter.

What NxD writes (fixtures/nxdt-official/README.md describes each shape, made by NxD 2.28 itself):

* ZeRO-1 off: torch AdamW's ``state_dict()`` per (tp, pp) rank, ``optim/dp_rank_00_tp_rank_XX_pp_rank_YY.pt``;
  moments in the parameter's dtype, no master copy.
* ZeRO-1 on: ``NeuronZero1Optimizer.state_dict()``, one file per dp rank: ``base_state`` holds AdamW's state of
  this dp rank's dim-0 chunk, ``shape_info`` the full shape, ``sharded_master_weights`` (only with
  ``use_master_weights_in_ckpt``) the chunk's master. Chunks: dim 0 padded with zero rows to a multiple of dp,
  cut in dp equal parts; nothing is flattened.
* Either of them xser-split (a file of ``TensorReference``, ``.info.pt``, ``.tensors/tensor_<tid>.pt``).
* ``use_zero1_dcp``: a DCP directory (``optim/.metadata``) whose keys name the parameters
  (``base_state.<name>.exp_avg[|pp-NNNN][|tp-NNNN]``), each tensor whole and unpadded.

Only DCP names the parameters. In the others optimizer index i is the i-th parameter of the param groups
taken in order; the names come from the model shard's key order split by the rule that made the groups
(:func:`index_names`, checked against every stored shape).

    >>> with NxdOptimizer.open("ckpt/step_2") as optim:             # doctest: +SKIP
    ...     for p in optim.params():
    ...         p.name, p.tp_rank, p.pp_rank, p.step, p.exp_avg.shape, p.master is not None
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from ckptconv.core.layout import parse_rank_file, shard_file
from ckptconv.core.plan import Source
from ckptconv.errors import ConversionError
from ckptconv.io.checked import CheckedFiles, check_whole_file
from ckptconv.io.dcp import METADATA as DCP_METADATA
from ckptconv.io.dcp import DcpCheckpoint
from ckptconv.io.nxd import INFO_SUFFIX, OPTIM_DIR, TENSORS_SUFFIX
from ckptconv.io.nxd_read import NxdCheckpoint
from ckptconv.io.safe_load import PickledTensor, TensorReference, is_torch_zip, load_small
from ckptconv.io.torchzip import StoredTensor, TorchZipReader

MOMENTS = ("exp_avg", "exp_avg_sq")
_ADAMW_KEYS = ("step", *MOMENTS)
_ZERO1_KEYS = ("state", "param_groups", "base_state", "shape_info")
_MASTERS = "sharded_master_weights"


class OptimFormat(str, Enum):
    ADAMW = "adamw"  # torch AdamW state_dict, the same on every dp rank (ZeRO-1 off)
    ZERO1 = "zero1"  # NeuronZero1Optimizer, one file per dp rank
    ZERO1_DCP = "zero1-dcp"  # NeuronZero1Optimizer through torch.distributed.checkpoint (use_zero1_dcp)


@dataclass(frozen=True)
class ParamState:
    """One parameter's optimizer state on one (tp, pp) rank, the dp chunks put back together."""

    name: str
    tp_rank: int
    pp_rank: int
    index: int  # optimizer index on that rank
    group: int
    step: float
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    master: torch.Tensor | None  # the fp32 (or fp64) master; None when the tag holds none


# --------------------------------------------------------------------------------------------
# Tensors inside an optimizer file, read when asked


class _Leaf:
    """One stored tensor of an optimizer file: dtype and shape known, bytes read on demand."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    def open(self) -> None:
        """Open its file now (so that a check of every opened file covers it); reads nothing."""

    def read(self) -> torch.Tensor:
        rows = self.shape[0] if self.shape else 1
        return self.read_rows(0, rows).reshape(self.shape)


class _ZipLeaf(_Leaf):
    def __init__(self, reader: TorchZipReader, stored: StoredTensor) -> None:
        self.reader, self.stored = reader, stored
        self.dtype, self.shape = stored.dtype, tuple(stored.shape)

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.reader.read_stored_rows(self.stored, start, stop)


class _SplitLeaf(_Leaf):
    """``<file>.tensors/tensor_<tid>.pt``, opened at the first read."""

    def __init__(self, path: Path, dtype: torch.dtype, shape: tuple[int, ...], io: str, checks: CheckedFiles) -> None:
        self.path, self.dtype, self.shape, self.io, self.checks = path, dtype, shape, io, checks
        self._reader: TorchZipReader | None = None
        self._lock = threading.Lock()  # the executor's workers may ask for the same master at once

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        self.open()
        assert self._reader is not None
        return self._reader.read_rows("", start, stop)

    def open(self) -> None:
        with self._lock:
            self._open()

    def _open(self) -> None:
        if self._reader is None:
            if not self.path.is_file():
                raise ConversionError(f"{self.path}: missing; its .info.pt lists it")
            reader = TorchZipReader(self.path, io=self.io, checks=self.checks)
            stored = reader.entry(reader.keys()[0]) if reader.keys() == [""] else None
            if not isinstance(stored, StoredTensor) or (stored.dtype, tuple(stored.shape)) != (self.dtype, self.shape):
                reader.close()
                raise ConversionError(f"{self.path}: expected one {self.dtype} tensor of shape {list(self.shape)} "
                                      "as its .info.pt records")
            self._reader = reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


class _NumberLeaf(_Leaf):
    """A ``step`` saved as a plain number (torch before 1.12), read as a 0-d float32 tensor."""

    def __init__(self, value: float) -> None:
        self.value, self.dtype, self.shape = value, torch.float32, ()

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        return torch.tensor([float(self.value)], dtype=self.dtype)[start:stop]


class _DcpLeaf(_Leaf):
    def __init__(self, dcp: DcpCheckpoint, key: str) -> None:
        self.dcp, self.key = dcp, key
        self.dtype, self.shape = dcp.info(Source(None, key))[:2]

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.dcp.read_rows(Source(None, self.key), start, stop)


# --------------------------------------------------------------------------------------------
# One optimizer file: its structure with the tensors as leaves


def _walk(obj: Any, where: str, leaf: Callable[[Any, str], _Leaf | None]) -> Any:
    """The structure with each tensor replaced by its leaf; only plain containers and values allowed."""
    made = leaf(obj, where)
    if made is not None:
        return made
    if isinstance(obj, dict):
        return {k: _walk(v, f"{where}[{k!r}]", leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_walk(v, f"{where}[{i}]", leaf) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype)):
        return obj
    raise ConversionError(f"{where}: unexpected {type(obj).__name__} in an optimizer file")


class _OptimFile:
    """A ``dp_rank_XX_tp_rank_YY_pp_rank_ZZ.pt`` of ``optim/``, plain torch zip or xser-split."""

    def __init__(self, path: Path, io: str, checks: CheckedFiles) -> None:
        self.path = path
        self._zip: TorchZipReader | None = None
        self._split: list[_SplitLeaf] = []
        info_path = Path(str(path) + INFO_SUFFIX)
        if info_path.is_file():
            for small in (path, info_path):  # small files loaded whole: checked whole first
                check_whole_file(small, checks.record(small) if checks.enabled else None)
            info = load_small(info_path)
            tensors = Path(str(path) + TENSORS_SUFFIX)

            def split_leaf(obj: Any, where: str) -> _Leaf | None:
                if not isinstance(obj, TensorReference):
                    return None
                tid = getattr(obj, "tid", None)
                entry = info.get(tid) if isinstance(info, dict) and isinstance(tid, int) else None
                if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), torch.dtype):
                    raise ConversionError(f"{info_path}: no dtype and shape for tid {tid} ({where})")
                made = _SplitLeaf(tensors / f"tensor_{tid}.pt", entry["dtype"],
                                  tuple(int(d) for d in entry["shape"]), io, checks)
                self._split.append(made)
                return made

            self.top = _walk(load_small(path), str(path), split_leaf)
        elif is_torch_zip(path):
            reader = self._zip = TorchZipReader(path, io=io, checks=checks)

            def zip_leaf(obj: Any, where: str) -> _Leaf | None:
                if isinstance(obj, StoredTensor):
                    return _ZipLeaf(reader, obj)
                if isinstance(obj, PickledTensor):
                    return _ZipLeaf(reader, reader.locate(where, obj))
                return None

            self.top = _walk({k: reader.entry(k) for k in reader.keys()}, str(path), zip_leaf)
        else:
            raise ConversionError(f"{path}: not a torch zip file (torch.save of torch >= 1.6) nor xser-split")
        if not isinstance(self.top, dict):
            raise ConversionError(f"{path}: expected an optimizer state dict, got {type(self.top).__name__}")

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()
        for leaf in self._split:
            leaf.close()


# --------------------------------------------------------------------------------------------
# Which parameter is optimizer index i


# How NxD's and NxDT's examples split parameters into (decay, no-decay) groups; each keeps model order.
# NxD's Llama example (the fixtures) tests names for "bias"/"norm"; other examples for "bias"/"LayerNorm".
# One table for both directions: the reader tries each, the writer (ckptconv.training.nxd_optimizer_write) is told one.
PARAM_GROUP_RULES: dict[str, tuple[str, Callable[[str], bool]]] = {
    "bias-norm": ("names containing 'bias' or 'norm' in the no-decay group", lambda n: "bias" in n or "norm" in n),
    "bias-LayerNorm": ("names containing 'bias' or 'LayerNorm' in the no-decay group",
                       lambda n: "bias" in n or "LayerNorm" in n),
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
# The optimizer of a tag


@dataclass
class _Slot:
    """Where one parameter's state lies: per dp rank for ZeRO-1 files, one leaf otherwise."""

    name: str
    index: int
    group: int
    shape: tuple[int, ...]  # the full, unpadded parameter shape
    step: list[_Leaf]
    moments: dict[str, list[_Leaf]]
    master: list[_Leaf] | None


@dataclass
class _Rank:
    groups: list[dict[str, Any]]  # hyper-parameters as saved, "params": names
    slots: list[_Slot]  # in optimizer index order
    naming: str
    by_name: dict[str, _Slot] = field(init=False, repr=False)  # every read looks a slot up by name

    def __post_init__(self) -> None:
        self.by_name = {}
        for slot in self.slots:
            self.by_name.setdefault(slot.name, slot)


class NxdOptimizer:
    """The optimizer state of an NxD training tag, by parameter name and (tp, pp) rank.

    ``model`` is the tag's model shards (they give the parameter names and order); reads are checked
    (zip CRC-32s; small files whole) unless ``check`` is False.

    A (tp, pp) rank's files (one per dp rank) are opened and parsed when that rank's state is first asked for,
    not before: a training rank of a 1024-rank world reads its own files, not the world's. What the whole
    optimizer is (format, masters, naming) is said by the first rank parsed (tp 0 pp 0 unless another was asked
    for first); every rank parsed after it must agree, else an error naming its file. :meth:`load_all` parses
    every rank (inspect's summary, a check of every master).
    """

    def __init__(self, model: NxdCheckpoint, *, io: str = "mmap", check: bool = True, owns_model: bool = False,
                 first: tuple[int, int] | None = None) -> None:
        """``first``: the (tp, pp) rank that speaks for the whole optimizer when nothing was read yet (one the
        caller reads anyway; default the lowest)."""
        self.model = model
        self._first_rank = first
        self._owns_model = owns_model
        self.dir = model.root / OPTIM_DIR
        records = None if model.metadata is None else model.metadata.files  # a tag that ckptconv.json describes
        self.checks = CheckedFiles(model.root, records, enabled=check)
        self._files: list[_OptimFile] = []
        self._dcp: DcpCheckpoint | None = None
        self._found: dict[tuple[int, int], dict[int, Path]] = {}  # (tp, pp) -> dp rank -> file, none opened yet
        self._ranks: dict[tuple[int, int], _Rank] = {}  # the ranks parsed so far
        self._first: tuple[OptimFormat, bool] | None = None  # format and masters of the first rank parsed
        self._io = io
        self._parse_lock = threading.RLock()  # the executor's workers may ask for an unparsed rank at once
        self._closed = False  # reads after close() fail: its leaves would otherwise reopen their files unseen
        if not self.dir.is_dir():
            raise ConversionError(f"{self.dir}: no optimizer state in this tag")
        try:
            if (self.dir / DCP_METADATA).is_file():  # one metadata file names every rank's tensors
                self.dp = 1
                self._open_dcp(io, check)
                self._first = (OptimFormat.ZERO1_DCP, False)
            else:
                self._find_files()
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, tag: str | Path, *, io: str = "mmap", check: bool = True, lazy: bool = False) -> NxdOptimizer:
        """The optimizer of the tag (or newest completed tag of a root) at ``tag``, every rank's files parsed
        (a bad file refused here); ``lazy``: each rank's when first asked for."""
        optim = cls(NxdCheckpoint(tag, io=io, check=check), io=io, check=check, owns_model=True)
        if not lazy:
            try:
                optim.load_all()
            except BaseException:
                optim.close()
                raise
        return optim

    # -- what it holds --------------------------------------------------------------------

    @property
    def format(self) -> OptimFormat:
        return self._reference()[0]

    @property
    def has_masters(self) -> bool:
        """Whether every parameter has its master (the first rank parsed says; every rank parsed must agree)."""
        return self._reference()[1]

    def rank_ids(self) -> list[tuple[int, int]]:
        """Every (tp, pp) rank with optimizer state, from the file names (nothing is opened)."""
        return sorted(self._found or self._ranks)

    def parsed_ranks(self) -> list[tuple[int, int]]:
        """The (tp, pp) ranks whose files were opened and parsed so far."""
        with self._parse_lock:
            return sorted(self._ranks)

    def load_all(self) -> NxdOptimizer:
        """Open and parse every rank's files now (what ``inspect`` describes and checks)."""
        for tp, pp in self.rank_ids():
            self._rank(tp, pp)
        return self

    def _reference(self) -> tuple[OptimFormat, bool]:
        if self._first is None or not self._ranks:  # the first rank parsed speaks (DCP: its keys said the format)
            ids = self.rank_ids()
            self._rank(*(self._first_rank if self._first_rank in ids else ids[0]))
        assert self._first is not None
        return self._first

    def dtype_of_masters(self) -> str:
        """The masters' dtype name (the optimizer dtype: float32, or float64 under XLA_DOWNCAST_BF16)."""
        self._reference()
        with self._parse_lock:
            first = next(iter(self._ranks.values())).slots[0]
        leaves = first.master if first.master is not None else first.moments["exp_avg"]
        return str(leaves[0].dtype).removeprefix("torch.")

    def groups(self, tp_rank: int = 0, pp_rank: int = 0) -> list[dict[str, Any]]:
        """The param groups of a rank as saved, ``params`` given as parameter names."""
        return self._rank(tp_rank, pp_rank).groups

    def names(self, tp_rank: int = 0, pp_rank: int = 0) -> list[str]:
        """Parameter names in optimizer index order."""
        return [slot.name for slot in self._rank(tp_rank, pp_rank).slots]

    def naming(self) -> str:
        """How the indices were named, as the first rank parsed was."""
        self._reference()
        with self._parse_lock:
            return next(iter(self._ranks.values())).naming

    def params(self, tp_rank: int | None = None, pp_rank: int | None = None) -> Iterator[ParamState]:
        """Every parameter's state (of one rank when given), read one parameter at a time."""
        self._check_open()
        for tp, pp in self.rank_ids():
            if tp_rank not in (None, tp) or pp_rank not in (None, pp):
                continue
            for slot in self._rank(tp, pp).slots:
                yield ParamState(slot.name, tp, pp, slot.index, slot.group, self._step(slot),
                                 self._whole(slot, slot.moments["exp_avg"]),
                                 self._whole(slot, slot.moments["exp_avg_sq"]),
                                 None if slot.master is None else self._whole(slot, slot.master))

    def rows(self, tp_rank: int, pp_rank: int, name: str, what: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 of a parameter's ``master``, ``exp_avg`` or ``exp_avg_sq``, read from
        the dp chunks that hold them and nothing else (a resume at another layout reads only its slice)."""
        slot = self._slot(tp_rank, pp_rank, name)
        if what == "master":
            if slot.master is None:
                raise ConversionError(f"{self.dir}: no master weights for {name!r} (saved without "
                                      "use_master_weights_in_ckpt)")
            return self._rows(slot, slot.master, start, stop)
        if what not in MOMENTS:
            raise ValueError(f"what must be master, exp_avg or exp_avg_sq; got {what!r}")
        return self._rows(slot, slot.moments[what], start, stop)

    def slot_info(self, tp_rank: int, pp_rank: int, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """The optimizer dtype (of the master, else of the moments) and the parameter's full shape."""
        slot = self._slot(tp_rank, pp_rank, name)
        leaves = slot.master if slot.master is not None else slot.moments["exp_avg"]
        return leaves[0].dtype, slot.shape

    def dtype_of(self, tp_rank: int, pp_rank: int, name: str, what: str) -> torch.dtype:
        """The stored dtype of a parameter's ``master``, ``exp_avg`` or ``exp_avg_sq``."""
        slot = self._slot(tp_rank, pp_rank, name)
        leaves = slot.master if what == "master" else slot.moments.get(what)
        if not leaves:
            raise ConversionError(f"{self.dir}: no {what} for {name!r} on tp rank {tp_rank} pp rank {pp_rank}")
        return leaves[0].dtype

    def param_step(self, tp_rank: int, pp_rank: int, name: str) -> float:
        """AdamW's step count of one parameter (the same on every dp rank, else an error)."""
        return self._step(self._slot(tp_rank, pp_rank, name))

    def open_masters(self) -> None:
        """Open the file of every master (xser: one per tensor) without reading it; then
        ``finish_checks(only_read=False)`` checks every byte of them (every rank parsed for it)."""
        self._check_open()
        for tp, pp in self.rank_ids():
            for slot in self._rank(tp, pp).slots:
                for leaf in slot.master or []:
                    leaf.open()

    def step(self) -> float:
        """The step of the first parameter of tp rank 0 pp rank 0 (the optimizer's step count)."""
        return self._step(self._rank(0, 0).slots[0])

    def finish_checks(self, *, workers: int = 8, only_read: bool = True) -> int:
        """Complete the checks of the files read (``only_read=False``: of every file opened)."""
        checked = self.checks.finish(workers=workers, only_read=only_read)
        if self._dcp is not None:
            checked += self._dcp.checks.finish(workers=workers, only_read=only_read)
        return checked

    def close(self) -> None:
        self._closed = True
        for f in self._files:
            f.close()
        self._files.clear()
        if self._dcp is not None:
            self._dcp.close()
        if self._owns_model:
            self.model.close()

    def __enter__(self) -> NxdOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading --------------------------------------------------------------------------

    def _rank(self, tp_rank: int, pp_rank: int) -> _Rank:
        """A rank's parsed state; its files are opened and parsed at the first ask."""
        self._check_open()
        key = (tp_rank, pp_rank)
        with self._parse_lock:
            if key not in self._ranks:
                if key not in self._found:
                    raise ConversionError(f"{self.dir}: no optimizer state for tp rank {tp_rank} pp rank {pp_rank}")
                self._ranks[key] = (self._parse_files(tp_rank, pp_rank) if self._dcp is None
                                    else self._parse_dcp_rank(tp_rank, pp_rank))
            return self._ranks[key]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.dir}: read after close() (closed with the checkpoint that kept it?)")

    def _slot(self, tp_rank: int, pp_rank: int, name: str) -> _Slot:
        slot = self._rank(tp_rank, pp_rank).by_name.get(name)
        if slot is not None:
            return slot
        raise ConversionError(f"{self.dir}: no optimizer state for {name!r} on tp rank {tp_rank} pp rank {pp_rank}")

    def _step(self, slot: _Slot) -> float:
        values = {float(leaf.read().reshape(())) for leaf in slot.step}
        if len(values) != 1:
            raise ConversionError(f"{self.dir}: dp ranks hold different steps for {slot.name!r}: {sorted(values)}")
        return values.pop()

    def _rows(self, slot: _Slot, chunks: list[_Leaf], start: int, stop: int) -> torch.Tensor:
        if len(chunks) == 1:
            return chunks[0].read_rows(start, stop)
        per = chunks[0].shape[0]  # every dp rank holds ceil(d0 / dp) rows; the pad rows sit at the end
        parts = []
        for dp, leaf in enumerate(chunks):
            lo, hi = max(start, dp * per), min(stop, (dp + 1) * per)
            if lo < hi:
                parts.append(leaf.read_rows(lo - dp * per, hi - dp * per))
        return torch.cat(parts) if parts else torch.empty((0, *slot.shape[1:]), dtype=chunks[0].dtype)

    def _whole(self, slot: _Slot, chunks: list[_Leaf]) -> torch.Tensor:
        if not slot.shape:
            return chunks[0].read()
        return self._rows(slot, chunks, 0, slot.shape[0]).reshape(slot.shape)

    # -- opening: dp_rank_XX_tp_rank_YY_pp_rank_ZZ.pt files ---------------------------------

    def _find_files(self) -> None:
        """Which file holds which (dp, tp, pp) rank, from the names in ``optim/``; none is opened."""
        found: dict[tuple[int, int], dict[int, Path]] = {}
        for entry in sorted(self.dir.iterdir()):
            ranks = parse_rank_file(entry.name)
            if ranks is not None and entry.is_file():
                found.setdefault(ranks[1:], {})[ranks[0]] = entry
        if not found:
            raise ConversionError(f"{self.dir}: no dp_rank_XX_tp_rank_YY_pp_rank_ZZ.pt files and no DCP {DCP_METADATA}")
        expected = {(tp, pp) for tp in range(self.model.tp) for pp in range(self.model.pp)}
        if set(found) != expected:
            odd = sorted(set(found) ^ expected)[0]
            raise ConversionError(f"{self.dir}: optimizer files for tp x pp ranks {sorted(found)}; the model has "
                                  f"tp {self.model.tp} x pp {self.model.pp} (first difference: tp rank {odd[0]} pp rank {odd[1]})")
        dps = {tuple(sorted(by_dp)) for by_dp in found.values()}
        if len(dps) != 1 or next(iter(dps)) != tuple(range(len(next(iter(dps))))):
            raise ConversionError(f"{self.dir}: dp ranks of the optimizer files differ between tp/pp ranks or have gaps: "
                                  f"{sorted(dps)}")
        self.dp = len(next(iter(dps)))
        self._found = found

    def _parse_files(self, tp: int, pp: int) -> _Rank:
        """Open and parse one (tp, pp) rank's files (one per dp rank); it must agree with the first rank parsed."""
        files = []
        for dp in range(self.dp):
            self._files.append(_OptimFile(self._found[(tp, pp)][dp], self._io, self.checks))
            files.append(self._files[-1])
        fmt, rank = self._parse_rank(tp, pp, files)
        masters = all(slot.master is not None for slot in rank.slots)
        if self._first is None:
            self._first = (fmt, masters)
        elif self._first != (fmt, masters):
            first = sorted(self._ranks)[0]
            said = lambda f, m: f"{f.value} {'with' if m else 'without'} masters"  # noqa: E731
            raise ConversionError(f"{files[0].path}: {said(fmt, masters)}; tp rank {first[0]} pp rank {first[1]} "
                                  f"holds {said(*self._first)}: the ranks hold different optimizer formats")
        return rank

    def _parse_rank(self, tp: int, pp: int, files: list[_OptimFile]) -> tuple[OptimFormat, _Rank]:
        first = files[0]
        top = first.top
        keys = set(top)
        if keys == {"state", "param_groups"}:
            fmt = OptimFormat.ADAMW
            if len(files) > 1:
                raise ConversionError(f"{files[1].path}: a second dp rank's file of an optimizer without ZeRO-1 "
                                      "(NxD writes only dp rank 00 then)")
        elif set(_ZERO1_KEYS) <= keys <= {*_ZERO1_KEYS, _MASTERS}:
            fmt = OptimFormat.ZERO1
        else:
            extra = sorted(map(str, keys - {*_ZERO1_KEYS, _MASTERS}))
            what = f"unknown key {extra[0]!r}" if extra else f"keys {sorted(map(str, keys))}"
            raise ConversionError(f"{first.path}: {what}; expected torch AdamW's state dict (state, param_groups) or "
                                  f"NeuronZero1Optimizer's ({', '.join(_ZERO1_KEYS)}[, {_MASTERS}])")
        for other in files[1:]:
            if set(other.top) != keys or _plain(other.top["param_groups"]) != _plain(top["param_groups"]):
                raise ConversionError(f"{other.path}: keys or param groups differ from {first.path}")
        groups = _param_groups(top["param_groups"], first.path)
        count = sum(len(g["params"]) for g in groups)
        declared = self.model.declared(shard_file(tp_rank=tp, pp_rank=pp))
        model_names = [k for k in declared if not k.endswith("inv_freq")]
        if count != len(model_names):
            raise ConversionError(f"{first.path}: the optimizer holds {count} parameters, the model shard "
                                  f"{len(model_names)}; the optimizer belongs to another model or layout")
        per_dp = [self._states(f, fmt, count) for f in files]
        index_shapes = self._full_shapes(fmt, files, per_dp, count)
        model_shapes = {k: declared[k][1] for k in model_names}
        names, naming = index_names(model_names, model_shapes, [len(g["params"]) for g in groups], index_shapes,
                                    str(first.path))
        group_of = [g for g, group in enumerate(groups) for _ in group["params"]]
        slots = []
        for i, name in enumerate(names):
            states = [states[i] for states, _ in per_dp]
            masters = [masters[i] for _, masters in per_dp] if all(m for _, m in per_dp) else None
            slots.append(_Slot(name, i, group_of[i], index_shapes[i], [s["step"] for s in states],
                               {m: [s[m] for s in states] for m in MOMENTS}, masters))
        named = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
                 for g in groups]
        return fmt, _Rank(named, slots, naming)

    def _states(self, f: _OptimFile, fmt: OptimFormat, count: int) -> tuple[list[dict[str, _Leaf]], list[_Leaf]]:
        """(AdamW state of every index, the masters of every index or [])."""
        top = f.top
        if fmt is OptimFormat.ZERO1 and top["state"] != {}:
            raise ConversionError(f"{f.path}: 'state' of a NeuronZero1Optimizer file is not empty")
        state = top["state"] if fmt is OptimFormat.ADAMW else top["base_state"]
        where = "state" if fmt is OptimFormat.ADAMW else "base_state"
        states = [_adamw_state(_indexed(state, i, f.path, where), f.path, f"{where}[{i}]") for i in range(count)]
        _no_extra(state, count, f.path, where)
        masters: list[_Leaf] = []
        if _MASTERS in top:
            masters = [_tensor(_indexed(top[_MASTERS], i, f.path, _MASTERS), f.path, f"{_MASTERS}[{i}]")
                       for i in range(count)]
            _no_extra(top[_MASTERS], count, f.path, _MASTERS)
        return states, masters

    def _full_shapes(self, fmt: OptimFormat, files: list[_OptimFile], per_dp: list[Any], count: int) -> list[tuple[int, ...]]:
        """Each index's full parameter shape, every dp chunk checked against NxD's partition of it."""
        if fmt is OptimFormat.ADAMW:
            shapes = [per_dp[0][0][i]["exp_avg"].shape for i in range(count)]
        else:
            info = files[0].top["shape_info"]
            shapes = [_shape(_indexed(info, i, files[0].path, "shape_info"), files[0].path, f"shape_info[{i}]")
                      for i in range(count)]
            _no_extra(info, count, files[0].path, "shape_info")
        for dp, (states, masters) in enumerate(per_dp):
            for i, shape in enumerate(shapes):
                chunk = shape if fmt is OptimFormat.ADAMW else _chunk_shape(shape, self.dp, files[dp].path, i)
                leaves = [("step", states[i]["step"])] + [(m, states[i][m]) for m in MOMENTS]
                leaves += [(_MASTERS, masters[i])] if masters else []
                for what, leaf in leaves:
                    want = () if what == "step" else chunk
                    if tuple(leaf.shape) != want and not (what == "step" and tuple(leaf.shape) == (1,)):
                        raise ConversionError(_chunk_error(files[dp].path, what, i, leaf.shape, want, shape, self.dp))
        return shapes

    # -- opening: the DCP variant ---------------------------------------------------------

    def _open_dcp(self, io: str, check: bool) -> None:
        dcp = self._dcp = DcpCheckpoint(self.dir, io=io, check=check)
        groups_raw: dict[int, dict[str, Any]] = {}
        leaves: dict[tuple[int, int], dict[str, dict[str, _Leaf]]] = {}
        steps: dict[str, _Leaf] = {}
        for key in dcp.keys():
            if key.startswith("param_groups."):
                m = re.fullmatch(r"param_groups\.(\d+)\.(\w+)", key)
                if m is None:
                    raise ConversionError(f"{self.dir / DCP_METADATA}: unexpected key {key!r}")
                groups_raw.setdefault(int(m.group(1)), {})[m.group(2)] = dcp.read_value(key)
            elif key.startswith("base_state."):
                m = re.fullmatch(r"base_state\.(.+)\.(step|exp_avg|exp_avg_sq)((?:\|pp-\d{4})?)((?:\|tp-\d{4})?)", key)
                if m is None:
                    raise ConversionError(f"{self.dir / DCP_METADATA}: unexpected key {key!r}")
                name, what = m.group(1), m.group(2)
                if what == "step":
                    steps[name] = _DcpLeaf(dcp, key)
                    continue
                rank = (int(m.group(4)[4:]) if m.group(4) else 0, int(m.group(3)[4:]) if m.group(3) else 0)
                leaves.setdefault(rank, {}).setdefault(name, {})[what] = _DcpLeaf(dcp, key)
            elif not re.fullmatch(r"shape_info\.\d+", key):
                raise ConversionError(f"{self.dir / DCP_METADATA}: unexpected key {key!r}; expected NxD's ZeRO-1 DCP "
                                      "keys (param_groups.*, base_state.*, shape_info.*)")
        if sorted(groups_raw) != list(range(len(groups_raw))) or len(groups_raw) != 1:
            raise ConversionError(f"{self.dir / DCP_METADATA}: {len(groups_raw)} param groups; NxD's DCP optimizer "
                                  "save works with one only, and only one is read")
        group = groups_raw[0]
        expected = {(tp, pp) for tp in range(self.model.tp) for pp in range(self.model.pp)}
        if set(leaves) != expected:
            raise ConversionError(f"{self.dir / DCP_METADATA}: holds tp x pp ranks {sorted(leaves)}; the model has "
                                  f"tp {self.model.tp} x pp {self.model.pp}")
        # a rank's state is matched with its model shard (whose header names its parameters) when first asked for
        self._dcp_ranks = (group, leaves, steps)
        self._found = {rank: {} for rank in leaves}
        # each dp rank saved its chunk of every tensor: the most chunks any tensor has is the dp size
        self.dp = max(len(dcp.entry(k).chunks) for k in dcp.keys() if dcp.entry(k).is_tensor)

    def _parse_dcp_rank(self, tp: int, pp: int) -> _Rank:
        """One (tp, pp) rank of the DCP variant: its keys' tensors matched with its model shard's parameters."""
        group, leaves, steps = self._dcp_ranks
        by_name = leaves[(tp, pp)]
        declared = self.model.declared(shard_file(tp_rank=tp, pp_rank=pp))
        names = [k for k in declared if not k.endswith("inv_freq")]
        if set(by_name) != set(names) or len(group.get("params", [])) != len(names):
            odd = sorted(set(by_name) ^ set(names)) or ["(param_groups.0.params)"]
            raise ConversionError(f"{self.dir / DCP_METADATA}: optimizer state of tp rank {tp} pp rank {pp} does "
                                  f"not match the model shard's parameters (first difference {odd[0]!r})")
        slots = []
        for i, name in enumerate(names):
            state = by_name[name]
            if set(state) != set(MOMENTS) or name not in steps:
                raise ConversionError(f"{self.dir / DCP_METADATA}: {name!r} lacks one of step, exp_avg, exp_avg_sq")
            shape = declared[name][1]
            for moment in MOMENTS:
                if tuple(state[moment].shape) != shape:
                    raise ConversionError(f"{self.dir / DCP_METADATA}: {name!r} {moment} has shape "
                                          f"{list(state[moment].shape)}, the parameter {list(shape)}")
            slots.append(_Slot(name, i, 0, shape, [steps[name]], {k: [state[k]] for k in MOMENTS}, None))
        named = {**{k: v for k, v in group.items() if k != "params"}, "params": names}
        return _Rank([named], slots, "names in the DCP keys")


# --------------------------------------------------------------------------------------------
# Checks of the parsed structure: one line naming the file and the key


def _plain(value: Any) -> Any:
    """The structure without tensors (to compare param groups across dp ranks)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return None if isinstance(value, _Leaf) else value


def _param_groups(groups: Any, path: Path) -> list[dict[str, Any]]:
    if not isinstance(groups, list) or not groups:
        raise ConversionError(f"{path}: 'param_groups' must be a non-empty list, got {type(groups).__name__}")
    start = 0
    for g, group in enumerate(groups):
        params = group.get("params") if isinstance(group, dict) else None
        if not isinstance(params, list) or params != list(range(start, start + len(params))):
            raise ConversionError(f"{path}: param_groups[{g}]['params'] must number the parameters "
                                  f"{start}, {start + 1}, ... in order, got {params!r}")
        start += len(params)
    return groups


def _indexed(table: Any, i: int, path: Path, where: str) -> Any:
    if not isinstance(table, dict):
        raise ConversionError(f"{path}: {where!r} must be a dict by optimizer index, got {type(table).__name__}")
    if i not in table:
        raise ConversionError(f"{path}: {where!r} has no entry for optimizer index {i} (a parameter never stepped?)")
    return table[i]


def _no_extra(table: dict[Any, Any], count: int, path: Path, where: str) -> None:
    extra = [k for k in table if not (isinstance(k, int) and 0 <= k < count)]
    if extra:
        raise ConversionError(f"{path}: {where!r} has key {extra[0]!r}; the param groups number {count} parameters")


def _adamw_state(state: Any, path: Path, where: str) -> dict[str, _Leaf]:
    if not isinstance(state, dict) or set(state) != set(_ADAMW_KEYS):
        keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        extra = sorted(map(str, set(state) - set(_ADAMW_KEYS))) if isinstance(state, dict) else []
        what = f"unknown key {extra[0]!r}" if extra else f"keys {keys}"
        raise ConversionError(f"{path}: {where} has {what}; expected AdamW's {', '.join(_ADAMW_KEYS)}")
    step = state["step"]
    if isinstance(step, (int, float)) and not isinstance(step, bool):
        state = {**state, "step": _NumberLeaf(step)}
    return {k: _tensor(state[k], path, f"{where}[{k!r}]") for k in _ADAMW_KEYS}


def _tensor(value: Any, path: Path, where: str) -> _Leaf:
    if not isinstance(value, _Leaf):
        raise ConversionError(f"{path}: {where} must be a tensor, got {type(value).__name__}")
    return value


def _shape(value: Any, path: Path, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(d) is int and d >= 0 for d in value):
        raise ConversionError(f"{path}: {where} must be a list of sizes, got {value!r}")
    return tuple(value)


def _chunk_shape(shape: tuple[int, ...], dp: int, path: Path, i: int) -> tuple[int, ...]:
    if not shape:
        raise ConversionError(f"{path}: shape_info[{i}] is a scalar parameter; ZeRO-1 partitions dim 0")
    return (math.ceil(shape[0] / dp), *shape[1:])


def _chunk_error(path: Path, what: str, i: int, actual: Any, want: tuple[int, ...], full: tuple[int, ...],
                 dp: int) -> str:
    message = (f"{path}: {what} of optimizer index {i} has shape {list(actual)}; the parameter is {list(full)}, so "
               f"{dp} dp rank file(s) imply {list(want)}")
    if dp == 1 and what != "step" and len(actual) == len(full) and 0 < actual[0] < full[0]:
        message += (" (one dp rank's ZeRO-1 chunk of a run with more dp ranks whose other files are absent: NxDT "
                    "saves ZeRO-1 state as if replicated unless its model config sets wrap_with_zero)")
    return message


def read_optimizer_state(tag: str | Path, *, io: str = "mmap", check: bool = True) -> Iterator[ParamState]:
    """Every parameter's AdamW state (and master, when saved) of an NxD training tag, one at a time:
    the reader nxdtrain's resume of NxD's own tags calls. Checks complete when the iteration ends."""
    with NxdOptimizer.open(tag, io=io, check=check) as optim:
        yield from optim.params()
        optim.finish_checks(workers=1)


def optimizer_summary(model: NxdCheckpoint, check: bool) -> dict[str, Any] | None:
    """What ``inspect`` says of a tag's ``optim/``: NxD's format read and summarised (the structure of every
    file; moment bytes are checked when read), or why it could not be read (nxdtrain's own tags hold
    another format); None without ``optim/``."""
    if not (model.root / OPTIM_DIR).is_dir():
        return None

    def summary(optim: NxdOptimizer) -> dict[str, Any]:
        return {"format": optim.format.value, "dp": optim.dp, "dtype": optim.dtype_of_masters(),
                "masters": optim.has_masters, "param_groups": len(optim.groups()),
                "parameters_per_rank": len(optim.names()), "step": optim.step(), "naming": optim.naming()}

    try:  # every rank's files parsed: the summary describes (and its checks cover) all of them
        if model.nxd_optimizer is not None:  # opened already (ckptconv.sources.masters, keep=True): closed with the model
            return summary(model.nxd_optimizer.load_all())
        with NxdOptimizer(model, check=check) as optim:
            return summary(optim.load_all())
    except ValueError as exc:  # ConversionError, UnsafeCheckpointError, a zip the reader refuses
        return {"format": None, "not_read": str(exc)}
