"""Training rows: token-id rows from a datasets directory, a jsonl(.gz) file, or synthetic.

Sample ``i`` (counting every row ever consumed, across epochs) is row ``order(i)``: file order
with ``--no-shuffle``, else a seeded permutation drawn afresh for each epoch. Global batch ``s``
is samples ``[s·gbs, (s+1)·gbs)``; data-parallel rank ``d`` takes the ``d``-th of ``dp`` equal
slices of it. A resumed run continues at its ``consumed_samples``.

    >>> rows = Batches(open_rows("synthetic", vocab=100, seq_len=4, seed=0), seq_len=4, shuffle=False, seed=0)
    >>> rows.batch(consumed=8, count=2).shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Protocol

import torch

from nxdtrain.errors import TrainError

COLUMN = "input_ids"


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


class JsonlRows:
    """One JSON object with ``input_ids`` per line (the SageMaker model-parallel format).

    Plain files are indexed by line offsets and read a line at a time; ``.gz`` files cannot be
    seeked cheaply, so they are decompressed into memory once.
    """

    def __init__(self, path: Path) -> None:
        self.name, self.path = str(path), path
        self._lines: list[bytes] | None = None
        self._offsets: list[int] = []
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                self._lines = [line for line in f if line.strip()]
            self.size = len(self._lines)
            return
        offset = 0
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    self._offsets.append(offset)
                offset += len(line)
        self.size = len(self._offsets)

    def row(self, index: int) -> list[int]:
        if self._lines is not None:
            line = self._lines[index]
        else:
            with open(self.path, "rb") as f:
                f.seek(self._offsets[index])
                line = f.readline()
        try:
            value = json.loads(line)[COLUMN]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise TrainError(f"{self.path}: row {index} is not a JSON object with {COLUMN!r}") from None
        return value


class DatasetRows:
    """A directory written by ``datasets.Dataset.save_to_disk`` (a DatasetDict's ``train`` split)."""

    def __init__(self, path: Path) -> None:
        import datasets

        self.name = str(path)
        data: Any = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if "train" not in data:
                raise TrainError(f"{path}: a DatasetDict without a 'train' split (has {', '.join(data)})")
            data = data["train"]
        if COLUMN not in data.column_names:
            raise TrainError(f"{path}: no {COLUMN!r} column (columns: {', '.join(data.column_names)})")
        self._data = data.select_columns([COLUMN])
        self.size = len(self._data)

    def row(self, index: int) -> list[int]:
        return self._data[index][COLUMN]


def open_rows(spec: str, *, vocab: int, seq_len: int, seed: int) -> RowSource:
    """The row source named by ``--data``."""
    if spec == "synthetic":
        return SyntheticRows(vocab=vocab, seq_len=seq_len, seed=seed)
    path = Path(spec)
    if not path.exists():
        raise TrainError(f"--data {spec}: no such file or directory (expected a datasets dir, .jsonl, .jsonl.gz "
                         "or 'synthetic')")
    if path.is_dir():
        if not any((path / name).exists() for name in ("dataset_info.json", "dataset_dict.json", "state.json")):
            raise TrainError(f"--data {spec}: not a datasets save_to_disk directory (no dataset_info.json)")
        source: RowSource = DatasetRows(path)
    elif path.name.endswith((".jsonl", ".jsonl.gz")):
        source = JsonlRows(path)
    else:
        raise TrainError(f"--data {spec}: expected a datasets dir, a .jsonl or .jsonl.gz file, or 'synthetic'")
    if source.size == 0:
        raise TrainError(f"--data {spec}: holds no rows")
    return source


class Batches:
    """Rows in training order, cut to ``seq_len`` and checked against the vocabulary."""

    def __init__(self, source: RowSource, *, seq_len: int, shuffle: bool, seed: int, vocab: int | None = None) -> None:
        self.source, self.seq_len, self.shuffle, self.seed = source, seq_len, shuffle, seed
        self.vocab = vocab
        self._epoch: tuple[int, torch.Tensor] | None = None

    def row_index(self, sample: int) -> int:
        """The source row of global sample ``sample``."""
        size = self.source.size
        if size is None:
            return sample
        epoch, position = divmod(sample, size)
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
            if len(ids) < self.seq_len:
                raise TrainError(f"{self.source.name}: row {index} has {len(ids)} tokens; --seq-len {self.seq_len} "
                                 "needs at least that many (pack shorter rows first)")
            rows.append(ids[: self.seq_len])
        out = torch.tensor(rows, dtype=torch.int64)
        if self.vocab is not None and out.numel() and (out.min() < 0 or out.max() >= self.vocab):
            bad = int(out.max()) if out.max() >= self.vocab else int(out.min())
            raise TrainError(f"{self.source.name}: token id {bad} is outside the model's vocabulary [0, {self.vocab})")
        return out

    def dp_slice(self, *, consumed: int, gbs: int, dp_rank: int, dp: int) -> torch.Tensor:
        """Data-parallel rank ``dp_rank``'s rows of the global batch starting at sample ``consumed``."""
        per = gbs // dp
        return self.batch(consumed=consumed + dp_rank * per, count=per)
