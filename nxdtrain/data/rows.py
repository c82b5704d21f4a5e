"""Training rows: token-id rows from a datasets directory, .jsonl/.json(.gz) files, or synthetic.

Sample ``i`` (counting every row ever consumed, across epochs) is row ``order(i)``: file order
with ``--no-shuffle``, else a seeded permutation drawn afresh for each epoch. With ``gbs`` given,
an epoch is ``rows // gbs`` whole global batches (see :mod:`nxdtrain.data.epochs`). Global batch ``s``
is samples ``[s·gbs, (s+1)·gbs)``; data-parallel rank ``d`` takes the ``d``-th of ``dp`` equal
slices of it. A resumed run continues at its ``consumed_samples``.

    >>> rows = Batches(open_rows("synthetic", vocab=100, seq_len=4, seed=0), seq_len=4, shuffle=False, seed=0)
    >>> rows.batch(consumed=8, count=2).shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import bisect
import glob
import gzip
import itertools
import json
import mmap
import os
import re
import shutil
import tempfile
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from nxdtrain.config.extras import require
from nxdtrain.data.epochs import epoch_samples
from nxdtrain.errors import TrainError

if TYPE_CHECKING:
    from nxdtrain.config.options import TrainConfig

COLUMN = "input_ids"
PAD = -1  # --pad: the positions after a short row's last token (never a token id; nxdtrain.model.pipeline ignores them)


def row_where(source: Any, index: int) -> tuple[str, int]:
    """(file, row in that file) of row ``index`` of ``source``: what a message about a row names."""
    return source.where(index) if hasattr(source, "where") else (source.name, index)


class RowSource(Protocol):
    """Rows of token ids; ``size`` is None for an endless source."""

    @property
    def name(self) -> str: ...

    @property
    def size(self) -> int | None: ...

    def row(self, index: int) -> list[int]: ...


class SyntheticRows:
    """Endless random rows; row ``i`` depends only on (seed, i)."""

    def __init__(self, *, vocab: int, seq_len: int, seed: int) -> None:
        self.name, self.size = "synthetic", None
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

    def row(self, index: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, self.vocab, (self.seq_len,), generator=generator).tolist()


class Spill:
    """One anonymous temporary file per process holding decompressed ``.gz`` inputs.

    A gzip stream cannot be seeked, so each ``.gz`` file is decompressed once, streaming, into
    this file; rows are then read at byte offsets like a plain file's. Memory stays flat whatever
    the corpus size; the file disappears when the process ends.
    """

    _file: Any = None

    @classmethod
    def append(cls, path: Path) -> tuple[int, int, int]:
        """Decompress ``path`` at the end of the spill; return (fd, start, end) of its bytes there."""
        if cls._file is None:
            cls._file = tempfile.TemporaryFile(prefix="nxdtrain-gz-")
        f = cls._file
        f.seek(0, os.SEEK_END)
        start = f.tell()
        try:
            with gzip.open(path, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
        except (OSError, EOFError) as exc:
            raise TrainError(f"{path}: not a readable gzip file ({exc})") from None
        f.flush()
        return f.fileno(), start, f.tell()


# A JSON string (escapes included) or a bracket: enough to find the elements of a top-level list.
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _list_extents(buffer: Any, start: int, end: int, name: str) -> list[tuple[int, int]]:
    """(start, end) byte extents of the objects of a top-level JSON list in ``buffer[start:end]``."""
    extents, depth, first = [], 0, 0
    for match in _JSON_TOKEN.finditer(buffer, start, end):
        char = buffer[match.start()]
        if char in b"[{":
            if depth == 1:
                first = match.start()
            depth += 1
        elif char in b"]}":
            depth -= 1
            if depth == 1:
                extents.append((first, match.end()))
            elif depth == 0:
                return extents
    raise TrainError(f"{name}: a JSON list that does not end (truncated file?)")


def _line_extents(buffer: Any, start: int, end: int) -> list[tuple[int, int]]:
    """(start, end) byte extents of the non-blank lines of ``buffer[start:end]``."""
    extents, offset = [], start
    while offset < end:
        newline = buffer.find(b"\n", offset, end)
        stop = end if newline < 0 else newline + 1
        if buffer[offset:stop].strip():
            extents.append((offset, stop))
        offset = stop
    return extents


class JsonRows:
    """Rows with ``input_ids`` in a ``.jsonl`` / ``.json`` file (JSON lines or one JSON list), gzipped or not.

    This is the SageMaker model-parallel format. Opening indexes the byte extent of every row
    once (a ``.gz`` file is first decompressed into the process's :class:`Spill`); a row read is
    one ``pread`` and one ``json.loads``.
    """

    def __init__(self, path: Path, column: str = COLUMN) -> None:
        self.name, self.path, self.column = str(path), path, column
        if path.name.endswith(".gz"):
            self._fd, start, end = Spill.append(path)
            self._owned = False
        else:
            self._fd, start, end = os.open(path, os.O_RDONLY), 0, path.stat().st_size
            self._owned = True
        extents: list[tuple[int, int]] = []
        if end > start:
            with mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ) as buffer:
                head = buffer[start:min(end, start + 4096)].lstrip()
                if head.startswith(b"["):
                    extents = _list_extents(buffer, start, end, self.name)
                else:
                    extents = _line_extents(buffer, start, end)
        self._starts = array("q", (a for a, _ in extents))
        self._ends = array("q", (b for _, b in extents))
        self.size = len(self._starts)

    def row(self, index: int) -> Any:
        start = self._starts[index]
        text = os.pread(self._fd, self._ends[index] - start, start)
        try:
            value = json.loads(text)[self.column]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise TrainError(f"{self.path}: row {index} is not a JSON object with {self.column!r}") from None
        return value

    def __del__(self) -> None:
        if getattr(self, "_owned", False):
            os.close(self._fd)


class ConcatRows:
    """Several row sources read one after another (the files of a directory or glob, in sorted order)."""

    def __init__(self, name: str, parts: list[RowSource]) -> None:
        self.name, self.parts = name, parts
        self._ends = list(itertools.accumulate(part.size or 0 for part in parts))
        self.size = self._ends[-1] if parts else 0

    def row(self, index: int) -> list[int]:
        part, local = self._locate(index)
        return self.parts[part].row(local)

    def _locate(self, index: int) -> tuple[int, int]:
        part = bisect.bisect_right(self._ends, index)
        return part, index - (self._ends[part - 1] if part else 0)

    def where(self, index: int) -> tuple[str, int]:
        """(file, row in that file) of row ``index``: what an error names."""
        part, local = self._locate(index)
        return self.parts[part].name, local


def load_column(path: Path, column: str) -> Any:
    """A ``save_to_disk`` directory's rows (a DatasetDict's 'train' split), reduced to ``column``."""
    datasets = require("datasets", f"--data {path} (a save_to_disk dataset)")

    _thread_lock_for_tqdm()
    data: Any = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise TrainError(f"{path}: a DatasetDict without a 'train' split (has {', '.join(data)})")
        data = data["train"]
    if column not in data.column_names:
        raise TrainError(f"{path}: no {column!r} column (columns: {', '.join(data.column_names)})")
    return data.select_columns([column])


def _thread_lock_for_tqdm() -> None:
    """Give tqdm a thread lock before ``datasets`` draws its first bar.

    ``load_from_disk`` runs its file loads through tqdm, whose default lock holds a multiprocessing
    semaphore registered with Python's resource tracker. A training process stopped by SIGTERM exits
    without releasing it, and the tracker then warns once per process about "leaked semaphore objects".
    Our processes never share a bar, so a thread lock is all tqdm needs; an explicit lock is kept.
    """
    import threading

    from tqdm import tqdm

    if getattr(tqdm, "_lock", None) is None:
        tqdm.set_lock(threading.RLock())


class DatasetRows:
    """A directory written by ``datasets.Dataset.save_to_disk`` (a DatasetDict's ``train`` split)."""

    def __init__(self, path: Path) -> None:
        self.name = str(path)
        self._data = load_column(path, COLUMN)
        self.size = len(self._data)

    def row(self, index: int) -> list[int]:
        return self._data[index][COLUMN]

    def lengths(self) -> array[int] | None:
        """Every row's length from the Arrow list offsets (no row decoded; 8 bytes a row); None for an indexed
        view."""
        import pyarrow.compute as pc

        if getattr(self._data, "_indices", None) is not None:
            return None
        lengths = pc.list_value_length(self._data.data.table.column(COLUMN))
        out = array("q")
        for chunk in lengths.chunks:
            out.frombytes(chunk.to_numpy(zero_copy_only=False).astype("int64").tobytes())
        return out


JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
EXPECTED = "a datasets save_to_disk dir, a .jsonl/.json(.gz) file, a directory or glob of those, or 'synthetic'"


def json_files(spec: str) -> list[Path]:
    """The ``.jsonl``/``.json`` files (gzipped or not) of a directory or glob, in sorted path order."""
    path = Path(spec)
    found = path.iterdir() if path.is_dir() else (Path(p) for p in glob.glob(spec, recursive=True))
    return sorted((p for p in found if p.is_file() and p.name.endswith(JSON_SUFFIXES)), key=str)


def open_rows(spec: str, *, vocab: int, seq_len: int, seed: int) -> RowSource:
    """The row source named by ``--data``."""
    if spec == "synthetic":
        return SyntheticRows(vocab=vocab, seq_len=seq_len, seed=seed)
    path = Path(spec)
    source: RowSource
    if path.is_dir() and any((path / name).exists() for name in DATASET_MARKERS):
        source = DatasetRows(path)
    elif path.is_file():
        if not path.name.endswith(JSON_SUFFIXES):
            raise TrainError(f"--data {spec}: expected {EXPECTED}")
        source = JsonRows(path)
    elif path.is_dir() or any(c in spec for c in "*?["):  # a glob
        files = json_files(spec)
        if not files:
            what = "directory holds no" if path.is_dir() else "glob matches no"
            raise TrainError(f"--data {spec}: the {what} .jsonl/.json(.gz) files and is not a datasets "
                             "save_to_disk directory (no dataset_info.json)")
        source = ConcatRows(spec, [JsonRows(f) for f in files])
    else:
        raise TrainError(f"--data {spec}: no such file or directory (expected {EXPECTED})")
    if source.size == 0:
        raise TrainError(f"--data {spec}: holds no rows")
    return source


class Batches:
    """Rows in training order, cut to ``seq_len`` and checked against the vocabulary."""

    def __init__(self, source: RowSource, *, seq_len: int, shuffle: bool, seed: int, vocab: int | None = None,
                 gbs: int | None = None, pad: bool = False) -> None:
        self.source, self.seq_len, self.shuffle, self.seed = source, seq_len, shuffle, seed
        self.pad = pad  # short rows end in PAD positions instead of being an error
        self.vocab = vocab
        self._epoch: tuple[int, torch.Tensor] | None = None
        size = source.size
        # An epoch is whole global batches only: the last rows % gbs of each epoch's order are skipped.
        # Data smaller than one global batch keeps all its rows per epoch (--epochs refuses it).
        self.epoch_len = size if size is None or not gbs or size < gbs else epoch_samples(size, gbs)

    def row_index(self, sample: int) -> int:
        """The source row of global sample ``sample``."""
        size = self.source.size
        if size is None or self.epoch_len is None:
            return sample
        epoch, position = divmod(sample, self.epoch_len)
        if not self.shuffle:
            return position
        if self._epoch is None or self._epoch[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._epoch = (epoch, torch.randperm(size, generator=generator))
        return int(self._epoch[1][position])

    def batch(self, *, consumed: int, count: int) -> torch.Tensor:
        """Samples ``[consumed, consumed + count)`` as a ``(count, seq_len)`` int64 tensor."""
        rows = []
        for sample in range(consumed, consumed + count):
            index = self.row_index(sample)
            ids = self.source.row(index)
            if len(ids) < self.seq_len and self.pad:
                ids = list(ids) + [PAD] * (self.seq_len - len(ids))
            if len(ids) < self.seq_len:
                name, row = row_where(self.source, index)
                raise TrainError(f"{name}: row {row} has {len(ids)} tokens; --seq-len {self.seq_len} "
                                 "needs at least that many (pack shorter rows first)")
            rows.append(ids[: self.seq_len])
        out = torch.tensor(rows, dtype=torch.int64)
        real = out[out != PAD] if self.pad else out
        if self.vocab is not None and real.numel() and (real.min() < 0 or real.max() >= self.vocab):
            bad = int(real.max()) if real.max() >= self.vocab else int(real.min())
            raise TrainError(f"{self.source.name}: token id {bad} is outside the model's vocabulary [0, {self.vocab})")
        return out

    def dp_slice(self, *, consumed: int, gbs: int, dp_rank: int, dp: int) -> torch.Tensor:
        """Data-parallel rank ``dp_rank``'s rows of the global batch starting at sample ``consumed``."""
        per = gbs // dp
        return self.batch(consumed=consumed + dp_rank * per, count=per)


def global_batches(cfg: TrainConfig, vocab: int, *, start: int = 0) -> list[torch.Tensor]:
    """The rows of global batches ``start+1 .. cfg.steps``, in training order (what a run of ``cfg`` trains on,
    whole; for references and benchmarks that train the same rows another way)."""
    data = cfg.data
    rows = open_rows(data.data, vocab=vocab, seq_len=data.seq_len, seed=cfg.seed)
    batches = Batches(rows, seq_len=data.seq_len, shuffle=data.shuffle, seed=cfg.seed, vocab=vocab, gbs=data.gbs,
                      pad=data.pad)
    return [batches.batch(consumed=s * data.gbs, count=data.gbs) for s in range(start, cfg.steps)]
