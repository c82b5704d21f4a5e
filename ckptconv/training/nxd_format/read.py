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
(:func:`ckptconv.training.nxd_format.ranks.index_names`, checked against every stored shape).

This module is the per-parameter view of them (:class:`NxdOptimizer`); an optimizer file's structure is parsed by
:mod:`ckptconv.training.nxd_format.files`, checked by :mod:`ckptconv.training.nxd_format.checks`, and a rank's
parameters are matched with their state by :mod:`ckptconv.training.nxd_format.ranks`.

    >>> with NxdOptimizer.open("ckpt/step_2") as optim:             # doctest: +SKIP
    ...     for p in optim.params():
    ...         p.name, p.tp_rank, p.pp_rank, p.step, p.exp_avg.shape, p.master is not None
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptconv.core.layout import parse_ep_shard_name, parse_rank_file
from ckptconv.errors import ConversionError
from ckptconv.io.checked import CheckedFiles
from ckptconv.io.dcp import METADATA as DCP_METADATA
from ckptconv.io.dcp import DcpCheckpoint
from ckptconv.io.nxd_read import NxdCheckpoint
from ckptconv.io.tags import OPTIM_DIR
from ckptconv.training.nxd_format.files import MOMENTS, Leaf, OptimFile
from ckptconv.training.nxd_format.ranks import (
    DcpRanks,
    OptimFormat,
    Rank,
    Slot,
    open_dcp,
    parse_dcp_rank,
    parse_rank,
)
from ckptconv.training.nxd_format.read_ep import parse_ep_ranks


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
    ep_rank: int = 0  # whose experts (ep > 1); the non-expert parameters are ep rank 0's, as in the shards


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
        self._files: list[OptimFile] = []
        self._dcp: DcpCheckpoint | None = None
        self._dcp_ranks: DcpRanks | None = None  # the DCP variant's keys by rank
        self._found: dict[tuple[int, int], dict[int, Path]] = {}  # (tp, pp) -> dp rank -> file, none opened yet
        self._ranks: dict[tuple[int, int, int], Rank] = {}  # (tp, pp, ep rank) -> the ranks parsed so far
        self._first: tuple[OptimFormat, bool] | None = None  # format and masters of the first rank parsed
        self._io = io
        self._parse_lock = threading.RLock()  # the executor's workers may ask for an unparsed rank at once
        self._closed = False  # reads after close() fail: its leaves would otherwise reopen their files unseen
        if not self.dir.is_dir():
            raise ConversionError(f"{self.dir}: no optimizer state in this tag")
        self.ep: int = getattr(model, "ep", 1)  # > 1: NeuronEPZero1Optimizer's merged files (nxd_optimizer_ep)
        try:
            if self.ep > 1 and (self.dir / DCP_METADATA).is_file():
                raise ConversionError(f"{self.dir}: NxD's ZeRO-1 DCP optimizer at ep {self.ep} is not read; "
                                      "reshard the shards alone with --weights-only")
            if (self.dir / DCP_METADATA).is_file():  # one metadata file names every rank's tensors
                self.dp = 1
                ranks = self._dcp_ranks = open_dcp(self.dir, model, io, check)
                self._dcp = ranks.dcp
                # a rank's state is matched with its model shard (whose header names its parameters) when first asked
                self._found = {rank: {} for rank in ranks.leaves}
                self.dp = ranks.dp
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
        return sorted(self._found or {key[:2] for key in self._ranks})

    def parsed_ranks(self) -> list[tuple[int, int]]:
        """The (tp, pp) ranks whose files were opened and parsed so far (at ep > 1 every ep rank's at once)."""
        with self._parse_lock:
            return sorted({key[:2] for key in self._ranks})

    def load_all(self) -> NxdOptimizer:
        """Open and parse every rank's files now (what ``inspect`` describes and checks)."""
        for tp, pp in self.rank_ids():
            for e in range(self.ep):
                self._rank(tp, pp, e)
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

    def groups(self, tp_rank: int = 0, pp_rank: int = 0, ep_rank: int = 0) -> list[dict[str, Any]]:
        """The param groups of a rank as saved, ``params`` given as parameter names (ep > 1: ep rank 0's are the
        non-expert groups then the expert ones, an ep rank > 0's the expert ones)."""
        return self._rank(tp_rank, pp_rank, ep_rank).groups

    def names(self, tp_rank: int = 0, pp_rank: int = 0, ep_rank: int = 0) -> list[str]:
        """Parameter names in optimizer index order (ep > 1: those of the rank's model shard)."""
        return [slot.name for slot in self._rank(tp_rank, pp_rank, ep_rank).slots]

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
            for e in range(self.ep):
                for slot in self._rank(tp, pp, e).slots:
                    yield ParamState(slot.name, tp, pp, slot.index, slot.group, self._step(slot),
                                     self._whole(slot, slot.moments["exp_avg"]),
                                     self._whole(slot, slot.moments["exp_avg_sq"]),
                                     None if slot.master is None else self._whole(slot, slot.master), e)

    def rows(self, tp_rank: int, pp_rank: int, name: str, what: str, start: int, stop: int,
             ep_rank: int = 0) -> torch.Tensor:
        """Rows [start, stop) of dim 0 of a parameter's ``master``, ``exp_avg`` or ``exp_avg_sq``, read from
        the dp chunks that hold them and nothing else (a resume at another layout reads only its slice)."""
        slot = self._slot(tp_rank, pp_rank, name, ep_rank)
        if what == "master":
            if slot.master is None:
                raise ConversionError(f"{self.dir}: no master weights for {name!r} (saved without "
                                      "use_master_weights_in_ckpt)")
            return self._rows(slot, slot.master, start, stop)
        if what not in MOMENTS:
            raise ValueError(f"what must be master, exp_avg or exp_avg_sq; got {what!r}")
        return self._rows(slot, slot.moments[what], start, stop)

    def slot_info(self, tp_rank: int, pp_rank: int, name: str, ep_rank: int = 0) -> tuple[torch.dtype, tuple[int, ...]]:
        """The optimizer dtype (of the master, else of the moments) and the parameter's full shape."""
        slot = self._slot(tp_rank, pp_rank, name, ep_rank)
        leaves = slot.master if slot.master is not None else slot.moments["exp_avg"]
        return leaves[0].dtype, slot.shape

    def dtype_of(self, tp_rank: int, pp_rank: int, name: str, what: str, ep_rank: int = 0) -> torch.dtype:
        """The stored dtype of a parameter's ``master``, ``exp_avg`` or ``exp_avg_sq``."""
        slot = self._slot(tp_rank, pp_rank, name, ep_rank)
        leaves = slot.master if what == "master" else slot.moments.get(what)
        if not leaves:
            raise ConversionError(f"{self.dir}: no {what} for {name!r} on tp rank {tp_rank} pp rank {pp_rank}")
        return leaves[0].dtype

    def param_step(self, tp_rank: int, pp_rank: int, name: str, ep_rank: int = 0) -> float:
        """AdamW's step count of one parameter (the same on every dp rank, else an error)."""
        return self._step(self._slot(tp_rank, pp_rank, name, ep_rank))

    def open_masters(self) -> None:
        """Open the file of every master (xser: one per tensor) without reading it; then
        ``finish_checks(only_read=False)`` checks every byte of them (every rank parsed for it)."""
        self._check_open()
        for tp, pp in self.rank_ids():
            for slot in (s for e in range(self.ep) for s in self._rank(tp, pp, e).slots):
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

    def _rank(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> Rank:
        """A rank's parsed state; its files are opened and parsed at the first ask (at ep > 1: every ep rank's
        state on (tp, pp) at once, from the same files)."""
        self._check_open()
        key = (tp_rank, pp_rank, ep_rank)
        with self._parse_lock:
            if key not in self._ranks:
                if (tp_rank, pp_rank) not in self._found or not 0 <= ep_rank < self.ep:
                    raise ConversionError(f"{self.dir}: no optimizer state for tp rank {tp_rank} pp rank {pp_rank}"
                                          + (f" ep rank {ep_rank}" if ep_rank else ""))
                if self._dcp_ranks is not None:
                    self._ranks[key] = parse_dcp_rank(self._dcp_ranks, self.model, tp_rank, pp_rank)
                else:
                    for e, rank in self._parse_files(tp_rank, pp_rank).items():
                        self._ranks[(tp_rank, pp_rank, e)] = rank
            return self._ranks[key]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.dir}: read after close() (closed with the checkpoint that kept it?)")

    def _slot(self, tp_rank: int, pp_rank: int, name: str, ep_rank: int = 0) -> Slot:
        slot = self._rank(tp_rank, pp_rank, ep_rank).by_name.get(name)
        if slot is not None:
            return slot
        raise ConversionError(f"{self.dir}: no optimizer state for {name!r} on tp rank {tp_rank} pp rank {pp_rank}"
                              + (f" ep rank {ep_rank}" if ep_rank else ""))

    def _step(self, slot: Slot) -> float:
        values = {float(leaf.read().reshape(())) for leaf in slot.step}
        if len(values) != 1:
            raise ConversionError(f"{self.dir}: dp ranks hold different steps for {slot.name!r}: {sorted(values)}")
        return values.pop()

    def _rows(self, slot: Slot, chunks: list[Leaf], start: int, stop: int) -> torch.Tensor:
        if len(chunks) == 1:
            return chunks[0].read_rows(start, stop)
        per = chunks[0].shape[0]  # every dp rank holds ceil(d0 / dp) rows; the pad rows sit at the end
        parts = []
        for dp, leaf in enumerate(chunks):
            lo, hi = max(start, dp * per), min(stop, (dp + 1) * per)
            if lo < hi:
                parts.append(leaf.read_rows(lo - dp * per, hi - dp * per))
        return torch.cat(parts) if parts else torch.empty((0, *slot.shape[1:]), dtype=chunks[0].dtype)

    def _whole(self, slot: Slot, chunks: list[Leaf]) -> torch.Tensor:
        if not slot.shape:
            return chunks[0].read()
        return self._rows(slot, chunks, 0, slot.shape[0]).reshape(slot.shape)

    # -- opening: dp_rank_XX_tp_rank_YY_pp_rank_ZZ.pt files ---------------------------------

    def _find_files(self) -> None:
        """Which file holds which (dp, tp, pp) rank, from the names in ``optim/``; none is opened."""
        found: dict[tuple[int, int], dict[int, Path]] = {}
        for entry in sorted(self.dir.iterdir()):
            if self.ep > 1 and parse_ep_shard_name(entry.name) is not None:
                raise ConversionError(f"{entry}: NxD's per-ep-rank AdamW files (ZeRO-1 off at ep {self.ep}) are not "
                                      "read yet; reshard the shards alone with --weights-only")
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

    def _parse_files(self, tp: int, pp: int) -> dict[int, Rank]:
        """Open and parse one (tp, pp) rank's files (one per dp rank), by ep rank; it must agree with the first
        rank parsed."""
        files = []
        for dp in range(self.dp):
            self._files.append(OptimFile(self._found[(tp, pp)][dp], self._io, self.checks))
            files.append(self._files[-1])
        if self.ep > 1:
            fmt, ranks = OptimFormat.ZERO1, parse_ep_ranks(self.model, tp, pp, files, self.ep)
        else:
            fmt, rank = parse_rank(self.model, tp, pp, files, self.dp)
            ranks = {0: rank}
        masters = all(slot.master is not None for rank in ranks.values() for slot in rank.slots)
        if self._first is None:
            self._first = (fmt, masters)
        elif self._first != (fmt, masters):
            first = sorted(self._ranks)[0]
            said = lambda f, m: f"{f.value} {'with' if m else 'without'} masters"  # noqa: E731
            raise ConversionError(f"{files[0].path}: {said(fmt, masters)}; tp rank {first[0]} pp rank {first[1]} "
                                  f"holds {said(*self._first)}: the ranks hold different optimizer formats")
        return ranks

def read_optimizer_state(tag: str | Path, *, io: str = "mmap", check: bool = True) -> Iterator[ParamState]:
    """Every parameter's AdamW state (and master, when saved) of an NxD training tag, one at a time:
    the reader nxdtrain's resume of NxD's own tags calls. Checks complete when the iteration ends."""
    with NxdOptimizer.open(tag, io=io, check=check) as optim:
        yield from optim.params()
        optim.finish_checks(workers=1)


def nxd_optimizer_summary(model: NxdCheckpoint, check: bool) -> dict[str, Any] | None:
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
