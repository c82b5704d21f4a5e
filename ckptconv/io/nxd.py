"""NxD checkpoint directories: finding the shards, reading them lazily, and writing them.

Three serialization flavours (docs/nxd-format.md §2): ``plain`` (torch.save of a dict), ``xser-inline``
(the same bytes plus an empty ``<file>.tensors/``; what the official ``--save_xser`` writes), and
``xser-split`` (a dict of ``TensorReference`` + ``<file>.info.pt`` + one file per tensor; what NxD
training writes). Legacy ``tp_rank_XX_pp_rank_YY/checkpoint.pt`` directories are read too.

Example:
    >>> ckpt = NxdCheckpoint("/fsx/ckpt")          # a root: its newest completed tag  # doctest: +SKIP
    >>> sorted(ckpt.files)[:1]                                                        # doctest: +SKIP
    ['model/dp_rank_00_tp_rank_00_pp_rank_00.pt']
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Collection, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import torch

from ckptconv.core.layout import MODEL_DIR, parse_shard_name, shard_file, shard_name
from ckptconv.core.plan import NESTED_TORCH, OutFile, OutTensor, Piece, Source
from ckptconv.errors import ConversionError, IntegrityError
from ckptconv.io.atomic import move_into_place, write_text
from ckptconv.io.checked import CheckedFiles, check_whole_file
from ckptconv.io.metadata import METADATA_FILE, read_metadata
from ckptconv.io.readers import FileReader, TorchFileReader
from ckptconv.io.safe_load import TensorReference, load_small
from ckptconv.io.torchzip import StoredTensor, TensorMeta, TorchZipReader, TorchZipWriter, plan_zip, save_state_dict
from ckptconv.io.torchzip_pickle import map_tensor_at
from ckptconv.io.torchzip_read import is_row_major

DONE_MARKER = "done"
CHECKPOINT_MARKER = "checkpoint"
TENSORS_SUFFIX = ".tensors"
INFO_SUFFIX = ".info.pt"
BARE_TENSOR_KEY = ""  # how the torch zip layer names the one tensor of a torch.save(tensor) file


class Flavour(str, Enum):
    PLAIN = "plain"
    XSER_INLINE = "xser-inline"
    XSER_SPLIT = "xser-split"


# --------------------------------------------------------------------------------------------
# Finding a checkpoint


def tag_step(name: str) -> int | None:
    """The step number in a tag name (``step_120``, ``x--step=120-consumed_samples=9.ckpt``)."""
    m = re.search(r"(?:^step_|--step=)(\d+)", name)
    return int(m.group(1)) if m else None


def completed_tags(root: Path) -> list[Path]:
    """Tag directories under ``root`` that have a ``done`` marker, oldest first (step, then mtime)."""
    tags = [p for p in root.iterdir() if p.is_dir() and (p / DONE_MARKER).is_file()]

    def order(p: Path) -> tuple[int, float]:
        step = tag_step(p.name)
        return (step if step is not None else -1, (p / DONE_MARKER).stat().st_mtime)

    return sorted(tags, key=order)


def newest_tag(root: Path) -> tuple[Path | None, str | None]:
    """The tag a checkpoint root resumes or exports from: the completed tag with the highest step
    (the ``done`` marker's mtime only breaks ties), and a warning when NxD's own rule, the tag whose
    ``done`` was modified last, would take another one (after a copy that lost the timestamps)."""
    tags = completed_tags(root)
    if not tags:
        return None, None
    ours = tags[-1]
    by_mtime = max(tags, key=lambda p: (p / DONE_MARKER).stat().st_mtime)
    if by_mtime == ours or (by_mtime / DONE_MARKER).stat().st_mtime == (ours / DONE_MARKER).stat().st_mtime:
        return ours, None
    return ours, (f"{root}: took {ours.name}, the highest step; NxD's load_checkpoint would take {by_mtime.name}, "
                  f"whose '{DONE_MARKER}' marker was modified last (timestamps changed by a copy?); pass a tag "
                  "directory to choose")


def _shard_files(directory: Path) -> dict[tuple[int, int], Path]:
    found: dict[tuple[int, int], Path] = {}
    if not directory.is_dir():
        return found
    for entry in directory.iterdir():
        ranks = parse_shard_name(entry.name)
        if ranks is None:
            continue
        if entry.is_dir():  # legacy: tp_rank_XX_pp_rank_YY/checkpoint.pt
            entry = entry / "checkpoint.pt"
            if not entry.is_file():
                continue
        found[ranks] = entry
    return found


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path, str]:
    """(root holding ``model/``, the shard directory, how it was found) for any accepted PATH.

    Accepted: a directory holding ``model/``; a ``model/`` directory; a training tag; a
    checkpoint root (its newest completed tag); a legacy ``tp_rank_XX_pp_rank_YY`` directory.
    """
    path = Path(path)
    if not path.exists():
        raise ConversionError(f"{path}: no such directory")
    if not path.is_dir():
        raise ConversionError(f"{path}: expected a directory of NxD shards")
    if _shard_files(path / MODEL_DIR):
        how = "tag" if (path / DONE_MARKER).exists() or (path / CHECKPOINT_MARKER).exists() else "directory"
        if how == "tag" and not (path / DONE_MARKER).is_file():
            raise ConversionError(f"{path}: tag has no '{DONE_MARKER}' marker (an interrupted save); refusing to read it")
        return path, path / MODEL_DIR, how
    if _shard_files(path):
        return (path.parent if path.name == MODEL_DIR else path), path, "model directory"
    tag, differs = newest_tag(path)
    if tag is not None:
        how = f"newest completed tag {tag.name} (highest step)"
        if differs:
            warnings.warn(differs, stacklevel=2)
            how += f"; {differs}"
        return tag, tag / MODEL_DIR, how
    raise ConversionError(
        f"{path}: no NxD shards found (looked for {MODEL_DIR}/dp_rank_00_tp_rank_XX_pp_rank_YY.pt, "
        f"shards in the directory itself, and tag directories with a '{DONE_MARKER}' marker)"
    )


# --------------------------------------------------------------------------------------------
# Reading


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

    def read(self, key: str) -> torch.Tensor:
        reader = self._tensor_reader(key)
        return reader.read(reader.keys()[0])

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()


def detect_flavour(path: Path) -> Flavour:
    if Path(str(path) + INFO_SUFFIX).is_file():
        return Flavour.XSER_SPLIT
    if Path(str(path) + TENSORS_SUFFIX).is_dir():
        return Flavour.XSER_INLINE
    return Flavour.PLAIN


OPTIM_DIR = "optim"  # a training tag's optimizer files (nxdtrain's: ckptconv.training.state; NxD's: nxd_optimizer)


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
    (``masters_for(shard file)`` reads that shard's, :func:`ckptconv.training.state.use_masters`); keys they
    lack (``inv_freq``) come from the file. ``identity``: the optimizer files read (names, sizes, mtimes) for a
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
        shards = _shard_files(self.model_dir)
        self.ranks = sorted(shards)
        self.files = {shard_file(tp_rank=tp, pp_rank=pp): p for (tp, pp), p in shards.items()}
        self.tp = 1 + max(tp for tp, _ in shards)
        self.pp = 1 + max(pp for _, pp in shards)
        missing = [
            shard_name(tp_rank=tp, pp_rank=pp)
            for tp in range(self.tp)
            for pp in range(self.pp)
            if (tp, pp) not in shards
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
        files are among a conversion's input files instead: ``ckptconv.commands.api._input_files``)."""
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
        not before (after that its reads fail, :class:`ckptconv.training.nxd_optimizer.NxdOptimizer`)."""
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

    def position(self, source: Source) -> int:
        """Where a tensor's bytes start in its file (an execution order that reads files front to back)."""
        assert source.file is not None
        reader = self._reader(source.file)
        return reader.position(source.key) if isinstance(reader, TorchFileReader) else 0

    def stage_files(self) -> list[str]:
        """One model file per pp stage, tp rank 0's: every key of a stage is split or copied across the stage's tp
        ranks (docs/nxd-format.md §3, "Per-key slices"), all saved from one model, so each of them declares the same
        keys in the same dtypes and these files declare every key's dtype (:meth:`check_stages` checks any file)."""
        return [shard_file(tp_rank=0, pp_rank=pp) for pp in range(self.pp)]

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
            ranks = parse_shard_name(Path(file).name)
            assert ranks is not None, file
            first = shard_file(tp_rank=0, pp_rank=ranks[1])
            if file == first:
                continue
            mine = {key: dtype for key, (dtype, _) in self.declared(file).items()}
            theirs = {key: dtype for key, (dtype, _) in self.declared(first).items()}
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


# --------------------------------------------------------------------------------------------
# Writing


class TorchZipSink:
    """One shard as a torch.save zip, filled by extents; optionally with the empty xser dir."""

    def __init__(self, out_file: OutFile, tmp: Path, *, empty_tensors_dir: bool = False) -> None:
        self.path = tmp / out_file.path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        metas: dict[str, Any] = dict(out_file.plain)
        if out_file.format != NESTED_TORCH:  # nested: the tensors are placed inside ``plain`` already
            metas.update({t.key: TensorMeta(t.dtype, t.shape, t.stride) for t in out_file.tensors})
        self._writer = TorchZipWriter(self.path, plan_zip(self.path, metas))
        self._empty_dir = Path(str(self.path) + TENSORS_SUFFIX) if empty_tensors_dir else None

    def write_extent(self, key: str, offset: int, data: torch.Tensor) -> None:
        self._writer.write_extent(key, offset, data)  # thread-safe: positional writes, locked bookkeeping

    def finish(self) -> list[Path]:
        self._writer.finish()
        paths = [self.path]
        if self._empty_dir is not None:
            self._empty_dir.mkdir(exist_ok=True)
            paths.append(self._empty_dir)
        return paths


class XserSplitSink:
    """NxD training's layout: refs file, ``.info.pt`` and one torch file per tensor. A NESTED_TORCH file (NxD's
    optimizer state) keeps its structure, each TensorAt a TensorReference numbered depth-first, as NxD's xser
    save numbers them."""

    def __init__(self, out_file: OutFile, tmp: Path) -> None:
        self.path = tmp / out_file.path
        self.tensor_dir = Path(str(self.path) + TENSORS_SUFFIX)
        self.tensor_dir.mkdir(parents=True, exist_ok=True)
        self.out_file = out_file
        if out_file.format == NESTED_TORCH:
            order: list[str] = []
            map_tensor_at(dict(out_file.plain), lambda t: order.append(t.key))
        else:
            order = [t.key for t in out_file.tensors]
        self.tid = {key: tid for tid, key in enumerate(order)}
        self._writers: dict[str, TorchZipWriter] = {}
        for t in out_file.tensors:
            file = self.tensor_dir / f"tensor_{self.tid[t.key]}.pt"
            meta = TensorMeta(t.dtype, t.shape, TensorMeta.contiguous(t.dtype, t.shape).stride)
            self._writers[t.key] = TorchZipWriter(file, plan_zip(file, meta))
        self._column_major = {t.key for t in out_file.tensors if t.column_major}

    def write_extent(self, key: str, offset: int, data: torch.Tensor) -> None:
        if key in self._column_major:  # per-tensor files are contiguous: store rows, not columns
            data = data.t().contiguous()
        self._writers[key].write_extent(BARE_TENSOR_KEY, offset, data)

    def finish(self) -> list[Path]:
        for writer in self._writers.values():
            writer.finish()
        refs: dict[str, Any]
        if self.out_file.format == NESTED_TORCH:
            refs = map_tensor_at(dict(self.out_file.plain), lambda t: TensorReference(self.tid[t.key]))
        else:
            refs = {t.key: TensorReference(self.tid[t.key]) for t in self.out_file.tensors}
        by_tid = sorted(self.out_file.tensors, key=lambda t: self.tid[t.key])
        info = {self.tid[t.key]: {"dtype": t.dtype, "shape": torch.Size(t.shape), "expert_model_parallel": False}
                for t in by_tid}
        info_path = Path(str(self.path) + INFO_SUFFIX)
        torch.save(info, info_path)  # plain data
        save_state_dict(self.path, refs)  # our writer names TensorReference without importing torch_xla
        return [self.tensor_dir, info_path, self.path]


def sink_factory(flavour: Flavour):  # type: ignore[no-untyped-def]
    """The executor's sink factory for NxD shards of ``flavour``."""
    flavour = Flavour(flavour)

    def make(out_file: OutFile, tmp: Path):  # type: ignore[no-untyped-def]
        if flavour is Flavour.XSER_SPLIT:
            return XserSplitSink(out_file, tmp)
        return TorchZipSink(out_file, tmp, empty_tensors_dir=flavour is Flavour.XSER_INLINE)

    return make


TAG_MARKERS = (CHECKPOINT_MARKER, DONE_MARKER)  # in writing order: a tag without ``done`` is never resumed from


def write_markers(tag_dir: Path) -> None:
    """``checkpoint`` first, ``done`` last: a tag without ``done`` is never resumed from."""
    for name in TAG_MARKERS:
        write_text(tag_dir / name, "1")


__all__ = [
    "Flavour",
    "NxdCheckpoint",
    "METADATA_FILE",
    "completed_tags",
    "resolve_checkpoint",
    "TAG_MARKERS",
    "sink_factory",
    "tag_step",
    "write_markers",
]


# --------------------------------------------------------------------------------------------
# Whole shards in memory (training saves and loads one rank's state at a time)


def save_shard(path: Path, state: Mapping[str, torch.Tensor], flavour: Flavour | str = Flavour.PLAIN, *,
               column_major: Collection[str] | None = None) -> list[Path]:
    """Write one rank's shard from memory, byte-identical to ``torch.save`` for ``plain``.

    Tensors may live on any device: each is copied to the CPU only when it is written, one at a
    time. ``column_major``: the keys stored column-major; by default read from each tensor's
    strides (an XLA tensor reports contiguous strides whatever its layout, so its caller says).
    Written under a temp directory beside ``path`` with the final basename (torch.save output
    depends on it) and renamed into place, the main ``.pt`` last. Returns the paths written.
    """
    path = Path(path)
    flavour = Flavour(flavour)

    def is_column_major(key: str, t: torch.Tensor) -> bool:
        if column_major is not None:
            return key in column_major
        return t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1 and t.stride() == (1, t.shape[0])

    out_file = OutFile(
        path.name, "torch",
        tuple(
            OutTensor(k, t.dtype, tuple(t.shape), 0, (Piece(Source(None, k), 0, t.shape[0] if t.dim() else 1),),
                      column_major=is_column_major(k, t))
            for k, t in state.items()
        ),
    )
    tmp = path.parent / f".{path.name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    sink = sink_factory(flavour)(out_file, tmp)
    for t_out in out_file.tensors:
        t = _own_storage(state[t_out.key])
        data = t.t().contiguous() if t_out.column_major else t.contiguous()
        sink.write_extent(t_out.key, 0, data.reshape(()) if t.dim() == 0 else data)
        del t, data
    written = move_into_place(sink, tmp, path.parent)
    tmp.rmdir()
    return written


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns exactly its storage (a view would serialize its whole parent)."""
    t = t.detach().cpu()
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    if not (t.is_contiguous() or (t.dim() == 2 and t.stride() == (1, t.shape[0]))):
        t = t.contiguous()
    return t


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
