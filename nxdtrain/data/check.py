"""The data checked before any process starts: every file parses, and every row's length fits ``--seq-len``.

A short row used to stop a run when it was reached (at a random time with shuffling, named as a row of
the whole data set), and long rows were cut without a word. Here, once, before the first process:

* a datasets directory: every row's length from its Arrow offsets (no row is decoded);
* ``.jsonl``/``.json`` files: every row parsed when a file holds at most :data:`PARSE_ALL` rows, else
  :data:`SAMPLE` rows spread over it (first and last included), and said so;
* a row shorter than ``--seq-len`` is refused naming its file and row; a longer row is cut (default: the
  start says how many tokens that drops), split into rows of ``--seq-len`` (``--long-rows split``: the
  remainder shorter than a row is dropped, counted) or refused (``--long-rows error``).

    >>> plan = check_rows(ListRows("a.jsonl", [[1, 2, 3, 4, 5], [6, 7, 8]]), seq_len=2, long_rows="split")
    >>> plan.rows.size, plan.dropped_tokens
    (3, 2)
"""

from __future__ import annotations

import bisect
import itertools
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from nxdtrain.data.rows import ConcatRows, DatasetRows, RowSource, row_where
from nxdtrain.errors import TrainError

PARSE_ALL = 50_000  # rows of one JSON file parsed whole; beyond that, sampled
SAMPLE = 2_000


class ListRows:
    """Rows held in a list (tests, doctests)."""

    def __init__(self, name: str, rows: list[list[int]]) -> None:
        self.name, self._rows, self.size = name, rows, len(rows)

    def row(self, index: int) -> list[int]:
        return self._rows[index]


class SplitRows:
    """Each row of ``source`` as ``len // seq_len`` rows of ``seq_len`` tokens (``--long-rows split``).

    Holds one integer per source row (the pieces before the next row), not one entry per piece: a corpus of
    millions of rows costs 8 bytes a row here, in every process.
    """

    def __init__(self, source: RowSource, lengths: Iterable[int], seq_len: int, *, ends: array[int] | None = None) -> None:
        """``ends``: the pieces' ends another process computed from the same ``lengths`` (:class:`CheckedData`)."""
        self.name, self.source, self.seq_len = source.name, source, seq_len
        # A row shorter than seq_len (only there with --pad) stays one row, padded when it is read.
        self.ends = ends if ends is not None else array("q", itertools.accumulate(max(n // seq_len, 1) for n in lengths))
        self.size = self.ends[-1] if self.ends else 0

    def _locate(self, index: int) -> tuple[int, int]:
        """(source row, first token) of piece ``index``."""
        if not 0 <= index < self.size:
            raise IndexError(f"row {index} of {self.size}")
        row = bisect.bisect_right(self.ends, index)
        return row, (index - (self.ends[row - 1] if row else 0)) * self.seq_len

    def row(self, index: int) -> list[int]:
        row, start = self._locate(index)
        return self.source.row(row)[start:start + self.seq_len]

    def where(self, index: int) -> tuple[str, int]:
        return row_where(self.source, self._locate(index)[0])


@dataclass
class DataPlan:
    """What the check found, and the rows the run trains on (``--long-rows split``: the pieces)."""

    rows: RowSource
    checked: int                # rows whose length was read
    total: int                  # rows in the data
    long_rows: int = 0          # rows longer than --seq-len (among those checked)
    short_rows: int = 0         # rows shorter than --seq-len, padded (--pad; among those checked)
    pad_positions: int = 0      # positions --pad adds (among those checked)
    dropped_tokens: int = 0     # tokens no step trains on: cut tails or split remainders (among those checked)
    notes: list[str] = field(default_factory=list)

    def lines(self, seq_len: int, long_rows: str) -> list[str]:
        how = "all rows" if self.checked == self.total else f"{self.checked:,} of {self.total:,} rows (sampled)"
        out = [f"data {self.rows.name}: {self.total:,} rows, {how} checked against --seq-len {seq_len}"]
        if self.long_rows:
            verb = {"cut": "cut to --seq-len", "split": "split into rows of --seq-len"}[long_rows]
            other = "split" if long_rows == "cut" else "cut"
            out.append(f"{self.long_rows:,} rows longer than --seq-len {seq_len} are {verb} (--long-rows {long_rows}): "
                       f"{self.dropped_tokens:,} tokens are never trained on{'' if self.checked == self.total else ' in the rows checked'}"
                       f"; --long-rows {other} or error to change that")
        if self.short_rows:
            out.append(f"{self.short_rows:,} rows shorter than --seq-len {seq_len} are padded (--pad): "
                       f"{self.pad_positions:,} positions hold no token and are not trained on")
        return out + self.notes


@dataclass(frozen=True)
class CheckedData:
    """What a check found, for the processes that train on the same data without checking it again (the
    workers ``--nproc`` starts: their launcher checked it): the lines it says, and ``--long-rows split``'s pieces."""

    lines: tuple[str, ...]
    ends: array[int] | None = None  # SplitRows.ends; None: the rows as they are


def checked_rows(source: RowSource, *, seq_len: int, long_rows: str, pad: bool,
                 checked: CheckedData | None = None) -> tuple[RowSource, CheckedData]:
    """The rows to train on and what the check found: checked here (:func:`check_rows`), or as ``checked`` says."""
    if checked is not None:
        return (source if checked.ends is None else SplitRows(source, (), seq_len, ends=checked.ends)), checked
    plan = check_rows(source, seq_len=seq_len, long_rows=long_rows, pad=pad)
    lines = tuple(plan.lines(seq_len, long_rows)) if plan.rows.size is not None else ()
    return plan.rows, CheckedData(lines, plan.rows.ends if isinstance(plan.rows, SplitRows) else None)


def _lengths(source: RowSource, *, whole: bool) -> tuple[Iterator[tuple[int, int]], int]:
    """((row, length) for the rows checked, read as they are iterated; how many those are). ``whole``: every
    row, however many."""
    size = source.size or 0
    if isinstance(source, DatasetRows):
        lengths = source.lengths()
        if lengths is not None:
            return enumerate(lengths), len(lengths)
    picked: list[int] | range = range(size)
    if not whole and size > PARSE_ALL:
        step = (size - 1) / (SAMPLE - 1)
        picked = sorted({round(k * step) for k in range(SAMPLE)})
    return ((i, len(_parsed(source, i))) for i in picked), len(picked)


def _parsed(source: RowSource, index: int) -> list[int]:
    ids = source.row(index)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        name, row = row_where(source, index)
        raise TrainError(f"{name}: row {row}: input_ids is not a list of integer token ids")
    return ids


def check_rows(source: RowSource, *, seq_len: int, long_rows: str, pad: bool = False) -> DataPlan:
    """Check every part of ``source`` (see the module docstring); the rows to train on."""
    if source.size is None:  # synthetic: rows of exactly --seq-len
        return DataPlan(source, 0, 0)
    parts = source.parts if isinstance(source, ConcatRows) else [source]
    plan = DataPlan(source, 0, source.size)
    split = long_rows == "split"
    all_lengths = array("q")  # --long-rows split: every row's length (8 bytes a row), for SplitRows
    for part in parts:
        found, count = _lengths(part, whole=split)
        plan.checked += count
        for row, n in found:
            if split:
                all_lengths.append(n)
            if n < seq_len and pad and n >= 1:
                plan.short_rows += 1
                plan.pad_positions += seq_len - n
                continue
            if n < seq_len:
                name, local = row_where(part, row)
                raise TrainError(f"{name}: row {local} has {n} tokens, fewer than --seq-len {seq_len}; pack the data "
                                 f"into rows of {seq_len} (nxdtrain data pack --seq-len {seq_len}), lower --seq-len, "
                                 "or pass --pad")
            if n > seq_len:
                if long_rows == "error":
                    name, local = row_where(part, row)
                    raise TrainError(f"{name}: row {local} has {n} tokens, more than --seq-len {seq_len} "
                                     "(--long-rows error); --long-rows cut or split to train on it")
                plan.long_rows += 1
                plan.dropped_tokens += n - seq_len if long_rows == "cut" else n % seq_len
    if split and plan.long_rows:
        plan.rows = SplitRows(source, all_lengths, seq_len)
        plan.notes.append(f"--long-rows split: {plan.total:,} rows became {plan.rows.size:,} rows of --seq-len "
                          f"{seq_len}")
    return plan
