"""Reading NxD shards: a checkpoint's shards opened lazily and checked (:class:`NxdCheckpoint`, the executor's
``TensorReader``), its weights optionally served from fp32 masters, and one shard read whole.

Example:
    >>> ckpt = NxdCheckpoint("/fsx/ckpt")          # a root: its newest completed tag  # doctest: +SKIP
    >>> sorted(ckpt.files)[:1]                                                        # doctest: +SKIP
    ['model/dp_rank_00_tp_rank_00_pp_rank_00.pt']
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Protocol

import torch

from ckptconv.core.layout import MODEL_DIR, ShardId, parse_shard_name, shard_file, shard_name
from ckptconv.core.plan import Source
from ckptconv.errors import ConversionError, IntegrityError
from ckptconv.io.checked import CheckedFiles, check_whole_file
from ckptconv.io.metadata import read_metadata
from ckptconv.io.nxd import (
    INFO_SUFFIX,
    TENSORS_SUFFIX,
    Flavour,
    detect_flavour,
    ep_shard_files,
    resolve_checkpoint,
    shard_files,
)
from ckptconv.io.readers import FileReader, TorchFileReader, try_read_columns
from ckptconv.io.safe_load import load_small
from ckptconv.io.torchzip import StoredTensor, TorchZipReader
from ckptconv.io.torchzip_read import is_row_major


class _SplitShard:
    """An xser-split shard: a dict of TensorReference, each tensor in ``<file>.tensors/tensor_<tid>.pt``."""

    def __init__(self, path: Path, io: str, checks: CheckedFiles | None = None) -> None:
        self.path = path
        self.checks = checks
        if checks is not None:  # small files, loaded whole by torch.load: check them whole first
            for small in (path, Path(str(path) + INFO_SUFFIX)):
                check_whole_file(small, checks.record(small))
        refs = load_small(path)
        if not isinstance(refs, dict):
            raise ConversionError(f"{path}: expected a dict of TensorReference, got {type(refs).__name__}")
        self._tids: dict[str, int] = {}
        for key, ref in refs.items():
            tid = getattr(ref, "tid", None)
            if not isinstance(tid, int):
                raise ConversionError(f"{path}: {key!r} is not a TensorReference")
            self._tids[key] = tid
        self.io = io
        self._readers: dict[str, TorchZipReader] = {}

    def _tensor_reader(self, key: str) -> TorchZipReader:
        if key not in self._readers:
            file = Path(str(self.path) + TENSORS_SUFFIX) / f"tensor_{self._tids[key]}.pt"
            if not file.is_file():
                raise ConversionError(f"{self.path}: {key!r} refers to {file}, which is missing")
            self._readers[key] = TorchZipReader(file, io=self.io, checks=self.checks)
        return self._readers[key]

    def keys(self) -> list[str]:
        return list(self._tids)

    @functools.cached_property
    def _declared(self) -> Any:
        """``.info.pt``: {tid: {"dtype", "shape", ...}}; only :meth:`declared` needs it (not a conversion's reads)."""
        return load_small(Path(str(self.path) + INFO_SUFFIX))

    def declared(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """dtype and shape that ``.info.pt`` records for ``key`` (known even when its tensor file was not saved)."""
        entry = self._declared.get(self._tids[key]) if isinstance(self._declared, dict) else None
        dtype, shape = (entry.get("dtype"), entry.get("shape")) if isinstance(entry, dict) else (None, None)
        if not isinstance(dtype, torch.dtype) or not isinstance(shape, (tuple, list)):
            raise ConversionError(f"{self.path}{INFO_SUFFIX}: no dtype and shape for tid {self._tids[key]} ({key!r})")
        return dtype, tuple(int(d) for d in shape)

    def unsaved(self) -> list[str]:
        """Keys whose tensor file is absent (NxD writes none under ``avoid_saving_lower_precision_weights``);
        one directory listing, not a look-up per tensor (slow on network file systems)."""
        directory = Path(str(self.path) + TENSORS_SUFFIX)
        present = set(os.listdir(directory)) if directory.is_dir() else set()
        return [key for key, tid in self._tids.items() if f"tensor_{tid}.pt" not in present]

    def _entry(self, key: str) -> StoredTensor:
        reader = self._tensor_reader(key)
        entry = reader.entry(reader.keys()[0])
        assert isinstance(entry, StoredTensor)
        return entry

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...], bool]:
        e = self._entry(key)
        return e.dtype, tuple(e.shape), not is_row_major(tuple(e.shape), tuple(e.stride))

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        reader = self._tensor_reader(key)
        return reader.read_rows(reader.keys()[0], start, stop, out)

    def read_columns(self, key: str, start: int, stop: int, out: torch.Tensor) -> bool:
        reader = self._tensor_reader(key)
        return reader.read_columns(reader.keys()[0], start, stop, out)

    def read(self, key: str) -> torch.Tensor:
        reader = self._tensor_reader(key)
        return reader.read(reader.keys()[0])

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()


class _WithMasters:
    """One shard whose tensors come from nxdtrain's fp32 masters where they have them (a ShardsWithMasters reader)."""

    def __init__(self, shard: FileReader | _SplitShard, masters: Any) -> None:
        self.shard, self.masters = shard, masters
        self._names = set(masters.keys())

    def _of(self, key: str) -> FileReader | _SplitShard:
        return self.masters if key in self._names else self.shard

    def keys(self) -> list[str]:
        return self.shard.keys()

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...], bool]:
        return self._of(key).info(key)

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._of(key).read_rows(key, start, stop, out)

    def read_columns(self, key: str, start: int, stop: int, out: torch.Tensor) -> bool:
        return try_read_columns(self._of(key), key, start, stop, out)

    def close(self) -> None:
        self.shard.close()
        self.masters.close()


class WeightSource(Protocol):
    """Where an :class:`NxdCheckpoint` reads its tensors when not from the model files alone: NxD's masters
    (:class:`ckptconv.sources.masters.MasterWeights`, in place of the model files) or nxdtrain's
    (:class:`ShardsWithMasters`, over them)."""

    label: str  # where the weights come from, in a report's words

    def shard(self, file: str) -> FileReader | _WithMasters: ...

    def finish_checks(self, *, workers: int = 8, only_read: bool = True) -> int: ...

    def close(self) -> None: ...


class ShardsWithMasters:
    """A :class:`WeightSource`: each model file with the fp32 masters an nxdtrain bf16 run keeps over it
    (``masters_for(shard file)`` reads that shard's, :func:`ckptconv.training.nxdtrain_format.masters.use_masters`);
    keys they lack (``inv_freq``) come from the file. ``identity``: the optimizer files read (names, sizes, mtimes) for a
    conversion's fingerprint; ``owner`` (what reads them) is closed with the checkpoint."""

    label = "nxdtrain's master weights"

    def __init__(self, ckpt: NxdCheckpoint, masters_for: Callable[[str], Any], identity: list[tuple[str, int, int]],
                 owner: Any) -> None:
        self.ckpt, self.masters_for, self.identity, self.owner = ckpt, masters_for, identity, owner

    def shard(self, file: str) -> _WithMasters:
        ckpt = self.ckpt
        return _WithMasters(open_shard(ckpt.files[file], ckpt.io, ckpt.checks), self.masters_for(file))

    def finish_checks(self, *, workers: int = 8, only_read: bool = True) -> int:
        return 0  # the masters are read through the checkpoint's own checks (CheckedFiles shared with the owner)

    def close(self) -> None:
        self.owner.close()


class NxdCheckpoint:
    """NxD shards opened lazily; implements the executor's ``TensorReader``.

    ``files`` maps the canonical relative name (``model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt``) to
    the file on disk, whatever its actual (legacy) name.
    """

    def __init__(self, path: str | Path, *, io: str = "mmap", check: bool = True) -> None:
        self.root, self.model_dir, self.found_as = resolve_checkpoint(path)
        self.io = io
        self.metadata = read_metadata(self.root)
        # Checked reads: sizes now, digests and zip CRC-32s as the bytes are read (finish_checks).
        self.checks = CheckedFiles(self.root, None if self.metadata is None else self.metadata.files, enabled=check)
        self.checks.check_sizes(MODEL_DIR)
        by_ep = ep_shard_files(self.model_dir)  # NxD's expert-parallel names: ep > 1
        shards = {(0, tp, pp): p for (tp, pp), p in shard_files(self.model_dir).items()} if not by_ep else by_ep
        self.ep = 1 + max(ep for ep, _, _ in shards) if by_ep else 1
        self.ranks = sorted({(tp, pp) for _, tp, pp in shards})
        ep_of = (lambda ep: ep) if by_ep else (lambda ep: None)
        self.files = {shard_file(tp_rank=tp, pp_rank=pp, ep_rank=ep_of(ep)): p for (ep, tp, pp), p in shards.items()}
        # each file's ranks as read from the directory, so no caller parses them back out of its name
        self.shard_of = {shard_file(tp_rank=tp, pp_rank=pp, ep_rank=ep_of(ep)): ShardId(ep, tp, pp)
                         for ep, tp, pp in shards}
        self.tp = 1 + max(tp for _, tp, _ in shards)
        self.pp = 1 + max(pp for _, _, pp in shards)
        missing = [
            shard_name(tp_rank=tp, pp_rank=pp, ep_rank=ep_of(ep))
            for ep in range(self.ep)
            for tp in range(self.tp)
            for pp in range(self.pp)
            if (ep, tp, pp) not in shards
        ]
        if missing:
            raise ConversionError(f"{self.model_dir}: incomplete checkpoint, missing {', '.join(missing[:4])}")
        first = next(iter(self.files.values()))
        self.flavour = detect_flavour(first)
        self._readers: dict[str, FileReader | _SplitShard | _WithMasters] = {}
        self._lock = threading.Lock()
        self._weights: WeightSource | None = None  # NxD's or nxdtrain's masters (read_weights_from), or None
        self._nxd_optimizer: Any = None  # NxD's optimizer of this tag, once keep_nxd_optimizer()
        self._declared: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {}  # file -> declared()

    def _reader(self, file: str) -> FileReader | _SplitShard | _WithMasters:
        with self._lock:
            if file not in self._readers:
                if file not in self.files:
                    raise ConversionError(f"{self.model_dir}: no shard {file}")
                self._readers[file] = (open_shard(self.files[file], self.io, self.checks) if self._weights is None
                                       else self._weights.shard(file))
            return self._readers[file]

    def use_masters(self, masters_for: Callable[[str], Any], identity: list[tuple[str, int, int]],
                    owner: Any) -> None:
        """Read the weights from the fp32 masters an nxdtrain bf16 run keeps with its optimizer state instead of
        the shards' rounded copy (:class:`ShardsWithMasters`)."""
        self.read_weights_from(ShardsWithMasters(self, masters_for, identity, owner))

    def masters_identity(self) -> list[tuple[str, int, int]] | None:
        """nxdtrain's optimizer files read for its master weights (names, sizes, mtimes), or None (NxD's optimizer
        files are among a conversion's input files instead: ``ckptconv.commands.steps.input_files``)."""
        return self._weights.identity if isinstance(self._weights, ShardsWithMasters) else None

    def read_weights_from(self, source: WeightSource) -> None:
        """Serve every shard's tensors from ``source`` (fp32 masters in ``optim/``) instead of the model files
        alone; call before reading any tensor. The shard readers opened so far read the model files, so they are
        dropped (only they: what else this checkpoint holds stays open). A second source would replace the
        first one's reads unseen: refused."""
        if self._weights is not None:
            raise RuntimeError(f"{self.root}: the weights are read from another source already "
                               f"({self._weights.label})")
        self._close_readers()
        self._weights = source

    def keep_nxd_optimizer(self, optim: Any) -> None:
        """Keep NxD's optimizer of this tag open for the callers that read it too (inspect's summary, a resume's
        optimizer state; see :func:`ckptconv.sources.masters.nxd_masters`): it is closed with this checkpoint, and
        not before (after that its reads fail, :class:`ckptconv.training.nxd_format.read.NxdOptimizer`)."""
        if self._nxd_optimizer is not None and self._nxd_optimizer is not optim:
            raise RuntimeError(f"{self.root}: keeps another NxD optimizer open already")
        self._nxd_optimizer = optim

    @property
    def nxd_optimizer(self) -> Any:
        """NxD's optimizer of this tag where :meth:`keep_nxd_optimizer` kept it, else None."""
        return self._nxd_optimizer

    @property
    def weight_source(self) -> WeightSource | None:
        """Where tensors are read from when not the model files alone (see :meth:`read_weights_from`)."""
        return self._weights

    def declared(self, file: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """dtype and shape of every tensor of a model file, in file order, as the shard declares them
        (xser: ``.info.pt``), even when the tensors were not saved; unaffected by :meth:`read_weights_from`.
        A file's headers are read once (the optimizer's reader and the precision and weight notes all ask)."""
        if file not in self._declared:
            # The model file's own reader where reads go to it (opened once, for this and the reads that follow);
            # a reader of its own where they go elsewhere (masters), closed at once.
            own = self._weights is None
            reader = self._reader(file) if own else open_shard(self.files[file], self.io, None)
            try:
                self._declared[file] = ({key: reader.declared(key) for key in reader.keys()}
                                        if isinstance(reader, _SplitShard)
                                        else {key: reader.info(key)[:2] for key in reader.keys()})
            finally:
                if not own:
                    reader.close()
        return dict(self._declared[file])

    def unsaved_tensors(self, files: Collection[str] | None = None) -> list[str]:
        """``file: key`` of every model tensor whose data is absent (an xser tag saved with
        ``avoid_saving_lower_precision_weights``: its weights exist only as the optimizer's masters); of
        ``files`` only where given (what one rank reads)."""
        if self.flavour is not Flavour.XSER_SPLIT:
            return []
        missing = []
        for file, path in sorted(self.files.items()):
            if files is not None and file not in files:
                continue
            reader = _SplitShard(path, self.io)
            missing += [f"{file}: {key}" for key in reader.unsaved()]
            reader.close()
        return missing

    def finish_checks(self, *, workers: int = 8) -> int:
        """Complete the checks of every shard read from (hash what was not read); raise
        IntegrityError naming the first bad file. Returns how many files were checked."""
        checked = self.checks.finish(workers=workers)
        return checked + (self._weights.finish_checks(workers=workers) if self._weights is not None else 0)

    def keys(self, file: str) -> list[str]:
        return self._reader(file).keys()

    def info(self, source: Source) -> tuple[torch.dtype, tuple[int, ...], bool]:
        assert source.file is not None
        return self._reader(source.file).info(source.key)

    def read_rows(self, source: Source, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        assert source.file is not None
        return self._reader(source.file).read_rows(source.key, start, stop, out)

    def read_columns(self, source: Source, start: int, stop: int, out: torch.Tensor) -> bool:
        """Columns ``[start, stop)`` of a stored matrix into ``out``, reading only them where the shard's reader
        can (ckptconv.io.torchzip_read); False (nothing read) otherwise: the caller reads whole rows."""
        assert source.file is not None
        return try_read_columns(self._reader(source.file), source.key, start, stop, out)

    def read_slab_rows(self, source: Source, slab: int, start: int, stop: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of one slab of a stacked tensor (an expert's matrix), only their bytes where the shard
        is one torch zip (else the slab is read whole and cut)."""
        assert source.file is not None
        reader = self._reader(source.file)
        if isinstance(reader, TorchFileReader):
            return reader.read_slab_rows(source.key, slab, start, stop, out)
        rows = reader.read_rows(source.key, slab, slab + 1)[0, start:stop]
        return rows if out is None else out.copy_(rows)

    def position(self, source: Source) -> int:
        """Where a tensor's bytes start in its file (an execution order that reads files front to back)."""
        assert source.file is not None
        reader = self._reader(source.file)
        return reader.position(source.key) if isinstance(reader, TorchFileReader) else 0

    def file_of(self, *, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> str:
        """The model file of rank (ep_rank, tp_rank, pp_rank) (NxD's expert-parallel name when the shards have one)."""
        return shard_file(tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank if self.ep > 1 else None)

    def stage_files(self) -> list[str]:
        """One model file per pp stage, tp rank 0's: every key of a stage is split or copied across the stage's tp
        ranks (docs/nxd-format.md §3, "Per-key slices"), all saved from one model, so each of them declares the same
        keys in the same dtypes and these files declare every key's dtype (:meth:`check_stages` checks any file)."""
        return [shard_file(tp_rank=0, pp_rank=pp, ep_rank=0 if self.ep > 1 else None) for pp in range(self.pp)]

    def dtypes(self, *, stages_only: bool = False) -> dict[str, torch.dtype]:
        """dtype of every key, read from :meth:`stage_files`. Every other model file is checked to declare what its
        stage's first file declares, unless ``stages_only`` (one ``--part`` of a conversion: it checks the files it
        reads instead, so a part opens one model header per stage rather than all of them)."""
        out: dict[str, torch.dtype] = {}
        for file in self.stage_files():
            for key in self.keys(file):
                if key not in out:
                    out[key] = self.info(Source(file, key))[0]
        if not stages_only:
            self.check_stages(self.files)
        return out

    def check_stages(self, files: Collection[str]) -> None:
        """Each of ``files`` (model file names) declares the keys and dtypes its stage's first file declares
        (what :meth:`dtypes` and a plan assume of every file); else ConversionError naming both files."""
        for file in sorted(files):
            ranks = self.shard_of[file]
            first = self.stage_files()[ranks.pp]
            if file == first:
                continue
            mine = {key: dtype for key, (dtype, _) in self.declared(file).items()}
            theirs = {key: dtype for key, (dtype, _) in self.declared(first).items()}
            if ranks.ep > 0:  # an ep rank > 0 holds only its experts (NxD's rule)
                theirs = {key: dtype for key, dtype in theirs.items() if key in mine}
            if mine == theirs:
                continue
            if set(mine) != set(theirs):
                odd = sorted(set(mine) ^ set(theirs))[0]
                raise ConversionError(
                    f"{self.files[file]}: {'holds' if odd in mine else 'lacks'} {odd!r}, which {first} "
                    f"{'lacks' if odd in mine else 'holds'}: the tp ranks of a pp stage must hold the same keys")
            key = next(k for k in mine if mine[k] != theirs[k])
            raise ConversionError(f"{self.files[file]}: {key!r} is {str(mine[key]).removeprefix('torch.')}, "
                                  f"{first} holds it as {str(theirs[key]).removeprefix('torch.')}: the tp ranks of "
                                  "a pp stage must hold the same dtypes")

    def _close_readers(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def close(self) -> None:
        """Close everything this checkpoint holds: the shard readers, the weight source and a kept NxD optimizer
        (whose reads then fail, not reopen)."""
        self._close_readers()
        if self._weights is not None:
            self._weights.close()
        if self._nxd_optimizer is not None:
            self._nxd_optimizer.close()

    def __enter__(self) -> NxdCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_shard(path: Path, io: str, checks: CheckedFiles | None = None) -> FileReader | _SplitShard:
    """A lazy reader of one shard of any flavour; with ``checks``, also that it is the rank its name says."""
    reader: FileReader | _SplitShard
    if detect_flavour(path) is Flavour.XSER_SPLIT:
        reader = _SplitShard(path, io, checks)
    else:
        reader = TorchFileReader(path, io, checks)
        if checks is not None and checks.enabled:
            try:
                check_rank_identity(path, reader.archive)
            except BaseException:
                reader.close()
                raise
    return reader


def check_rank_identity(path: Path, archive: str) -> None:
    """torch.save names a file's records after its basename; a shard saved for another rank and
    then moved under this name (swapped rank files) still carries the other rank's name."""
    name = path.parent.name if path.name == "checkpoint.pt" else path.name
    mine, inside = parse_shard_name(name), parse_shard_name(archive + ".pt")
    if mine is not None and inside is not None and mine != inside:
        raise IntegrityError(
            f"{path}: holds the shard saved as {archive}.pt (tp rank {inside[0]}, pp rank {inside[1]}), not tp rank "
            f"{mine[0]} pp rank {mine[1]}; rank files were swapped or renamed")


def load_shard(path: Path, *, io: str = "read", checks: CheckedFiles | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of one shard (any flavour), in file order, owning their memory, with stored strides.

    With ``checks`` the shard's record CRC-32s (and recorded size and digest) are checked as it is read.
    """
    path = Path(path)
    reader = open_shard(path, io, checks)
    try:
        state = {key: reader.read(key) for key in reader.keys()}
        if checks is not None:
            checks.finish(workers=1)
        return state
    finally:
        reader.close()


__all__ = ["NxdCheckpoint", "ShardsWithMasters", "WeightSource", "check_rank_identity", "load_shard", "open_shard"]
