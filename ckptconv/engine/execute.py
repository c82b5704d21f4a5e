"""Run a :class:`~ckptconv.core.plan.Plan`: bounded memory, parallel workers, atomic and resumable writes.

Every output tensor is produced in *bands* of rows and written straight to its place in a
preallocated output file, so memory is bounded by the band size, not by tensor, file or model
size. Tensors cut by columns from shared sources (``down_proj`` for all tp ranks, say) are
grouped so that each source band is read once and feeds all of them.

Output files are written under ``<out>/.ckptconv-tmp/`` with their final basenames (torch.save
output depends on the basename) and renamed into place when complete; a file's size and digest
are then recorded in ``.ckptconv-tmp/state.json`` so a rerun after a crash skips it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from ckptconv.core.plan import OutFile, OutTensor, Piece, Plan, ReplicaGroup, Source
from ckptconv.engine.arena import SCRATCH as _SCRATCH
from ckptconv.engine.arena import Scratch as _Scratch
from ckptconv.engine.claims import BandClaims, band_extent, claim_band, row_bytes, unit_order, write_order
from ckptconv.engine.columns import column_band, column_block, column_groups, transposed_rows
from ckptconv.engine.options import default_workers
from ckptconv.engine.outdir import TMP_DIR
from ckptconv.engine.slab_parts import SlabWork, slab_extents, slab_work, slab_writes
from ckptconv.engine.slabs import slab_band, slab_groups
from ckptconv.engine.state_file import load_state, save_state
from ckptconv.errors import ConversionError, VerificationError
from ckptconv.io import direct_io
from ckptconv.io.atomic import disk_full, ensure_dir, move_into_place
from ckptconv.io.digest import DEFAULT, FileRecord, record_files
from ckptconv.io.transpose import transpose_into
from ckptconv.io.write_digest import WriteDigests, recording

STATE_FILE = "state.json"


class TensorReader(Protocol):
    """What the executor needs from any source (HF directory, NxD shards)."""

    def info(self, source: Source) -> tuple[torch.dtype, tuple[int, ...], bool]:
        """dtype, shape and whether the stored tensor is column-major."""
        ...

    def read_rows(self, source: Source, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) along dim 0, as a contiguous tensor (read into ``out`` when given)."""
        ...


class Sink(Protocol):
    """One output file being written (or several physical files, for xser split). Optional: ``claim(key, offset,
    nbytes)`` (engine.claims) and ``file_offset(key, offset)``, the file offset of a tensor's byte (_file_phase)."""

    def write_extent(self, key: str, offset: int, data: torch.Tensor) -> None: ...

    def finish(self) -> list[Path]:
        """Complete the file(s) in the temp dir; return their temp paths."""
        ...


SinkFactory = Callable[[OutFile, Path], Sink]


@dataclass(frozen=True, kw_only=True)
class ExecOptions:
    workers: int = field(default_factory=default_workers)
    max_memory: int = 2 * 2**30
    replicas: str = "error"  # "error" | "first" | "mean": when copies of a K/V head (or norm) differ
    fingerprint: str = ""    # identifies plan + sources; a rerun resumes only when it matches
    hash: str | None = DEFAULT  # digest of every output file (None: sizes only)
    write_io: str = "direct"    # "direct": large writes skip the page cache where the filesystem allows (io.direct_io)
    progress: Callable[[int], None] | None = None  # called with bytes written


class _ByteBudget:
    """A counting semaphore over bytes, so concurrent bands stay inside ``--max-memory``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.cond = threading.Condition()

    def acquire(self, amount: int) -> int:
        amount = min(amount, self.capacity)  # an oversized band runs alone rather than never
        with self.cond:
            self.cond.wait_for(lambda: self.used + amount <= self.capacity)
            self.used += amount
        return amount

    def release(self, amount: int) -> None:
        with self.cond:
            self.used -= amount
            self.cond.notify_all()


@dataclass
class _Unit:
    """Tensors produced together, band by band, over the same rows."""

    tensors: list[tuple[int, OutTensor]]  # (file index, tensor)
    rows: int
    band_rows: int
    row_bytes: int  # bytes in memory per row of a band (sources + output)
    slab_work: SlabWork | None = None  # a slab unit's bands: whole slabs or parts (ckptconv.engine.slab_parts)
    transposed: bool = False  # banded by the stored rows of a column-major tensor (ckptconv.engine.columns)

    @property
    def shared_sources(self) -> bool:
        return self.tensors[0][1].dim == 1

    @property
    def by_slab(self) -> bool:
        return self.tensors[0][1].by_slab

    def extents(self, start: int, stop: int) -> list[tuple[int, int]]:
        """(byte offset in its tensor, bytes) that band [start, stop) writes of each tensor."""
        if self.slab_work is not None:
            return slab_extents(self.slab_work, [t for _, t in self.tensors], start)
        return [band_extent(t, start, stop, self.transposed) for _, t in self.tensors]


def run_plan(
    plan: Plan,
    reader: TensorReader,
    out_dir: Path,
    sink_factory: SinkFactory,
    options: ExecOptions,
    *,
    only_files: set[str] | None = None,
    state_file: str = STATE_FILE,
    kept: list[str] | None = None,
) -> dict[str, FileRecord]:
    """Write the files of ``plan`` (or ``only_files`` of them) under ``out_dir``.

    Returns {relative path: size and digest} of every file written or found done; ``kept`` (when given) receives
    the plan's paths an earlier, interrupted run of the same plan had finished (not written again).
    """
    tmp = ensure_dir(out_dir, TMP_DIR)
    state = load_state(tmp / state_file, options.fingerprint)
    wanted = [i for i, f in enumerate(plan.files) if only_files is None or f.path in only_files]
    done = {path: recs for path, recs in state.items() if all(r.matches(out_dir / p) for p, r in recs.items())}
    todo = [i for i in wanted if plan.files[i].path not in done]
    if kept is not None:
        kept += [plan.files[i].path for i in wanted if plan.files[i].path in done]

    _check_replicas(plan.replicas, reader, options.replicas)
    if not todo:
        return _flatten(done, plan, wanted)

    digests = WriteDigests(options.hash) if options.hash else None  # each file hashed as written, not read back
    with recording(digests), direct_io.direct_writes(options.write_io == "direct"):
        sinks = _open_sinks(plan, todo, sink_factory, tmp)
    band_bytes = max(options.max_memory // (2 * max(1, options.workers)), 1 << 20)
    units = _units(plan, todo, reader, band_bytes, sinks)
    # Bands are the tasks, not units: a large tensor's bands run on several workers at once.
    tasks = [(unit, start, stop) for unit in units for start, stop in _bands(unit)]
    completed = _write_bands(plan, reader, out_dir, tmp, tmp / state_file, state, options, sinks, tasks, band_bytes,
                             digests)
    return _flatten(done | completed, plan, wanted)


def _open_sinks(plan: Plan, todo: list[int], sink_factory: SinkFactory, tmp: Path) -> dict[int, Sink]:
    """A sink for every file to write, preallocated under ``tmp``, by file index."""
    sinks: dict[int, Sink] = {}
    for i in todo:
        with _naming(plan.files[i], tmp):  # preallocation can find the disk full already
            sinks[i] = sink_factory(plan.files[i], tmp)
    return sinks


def _write_bands(plan: Plan, reader: TensorReader, out_dir: Path, tmp: Path, state_path: Path,
                 state: dict[str, dict[str, FileRecord]], options: ExecOptions, sinks: dict[int, Sink],
                 tasks: list[tuple[_Unit, int, int]], band_bytes: int,
                 digests: WriteDigests | None) -> dict[str, dict[str, FileRecord]]:
    """Run every band on ``options.workers`` threads within the memory budget; each file is moved into place when
    its last band is written, then recorded in the state file (in another pool: files not hashed as they were
    written are read back for their digest). Returns the records."""
    lock = threading.Lock()
    budget = _ByteBudget(options.max_memory)
    pending = dict.fromkeys(sinks, 0)  # per file: (tensor, band) pairs still to write
    for unit, _, _ in tasks:
        for file_index, _ in unit.tensors:
            pending[file_index] += 1
    completed: dict[str, dict[str, FileRecord]] = {}

    hashing: list[Future[None]] = []

    def record(file_index: int, paths: list[Path]) -> None:
        records = record_files(paths, out_dir, options.hash, None if digests is None else digests.under(tmp))
        with lock:
            completed[plan.files[file_index].path] = records
            state[plan.files[file_index].path] = records
            save_state(state_path, options.fingerprint, state)

    def finish_band(file_index: int) -> None:
        with lock:
            pending[file_index] -= 1
            last = pending[file_index] == 0
        if last and not failed.is_set():  # after a failure, no file is moved into place unrecorded
            # Record in another pool, so converting goes on meanwhile (a file read back for its digest is CPU-bound).
            with _naming(plan.files[file_index], tmp):
                paths = move_into_place(sinks[file_index], tmp, out_dir)
            hashing.append(hash_pool.submit(record, file_index, paths))

    # Bands larger than band_bytes (unsplittable column-major tensors) run one at a time, so peak
    # memory is about workers x band_bytes plus one of them, however many the model has.
    oversized = threading.Lock()

    failed = threading.Event()

    def run_band(unit: _Unit, start: int, stop: int) -> None:
        try:
            _run_band(unit, start, stop)
        except BaseException:
            failed.set()
            raise

    def _run_band(unit: _Unit, start: int, stop: int) -> None:
        need = unit.row_bytes * max(stop - start, 1)
        with oversized if need > band_bytes else contextlib.nullcontext():
            held = budget.acquire(need)
            claims = None
            try:
                extents = unit.extents(start, stop)
                claims = claim_band(unit.tensors, extents, sinks)  # its file's digest waits for it (engine.claims)
                _SCRATCH.start_band(need)
                with _naming(plan.files[unit.tensors[0][0]], tmp):
                    _write_band(unit, start, stop, reader, sinks, options.progress, claims, extents)
            finally:
                if claims is not None:
                    claims.release()
                _SCRATCH.end_band(keep=band_bytes)
                budget.release(held)
        for file_index, _ in unit.tensors:
            finish_band(file_index)

    workers = max(1, options.workers)
    # Files without tensors (an ep rank's stage without experts), found before any band runs: once bands run, a
    # file whose bands have all finished has a count of 0 too, and must not be moved into place twice.
    empty = [file_index for file_index, count in pending.items() if not count]
    with ThreadPoolExecutor(max_workers=workers) as pool, ThreadPoolExecutor(max_workers=workers) as hash_pool:
        for file_index in empty:
            pending[file_index] = 1
            finish_band(file_index)
        futures = [pool.submit(run_band, *task) for task in tasks]
        _raise_first_error(futures)
        _raise_first_error(list(hashing))
    return completed


def _raise_first_error(futures: list[Future[None]]) -> None:
    finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
    for future in finished:
        if future.exception() is not None:
            for other in futures:
                other.cancel()
            raise future.exception()  # type: ignore[misc]


def _flatten(per_file: dict[str, dict[str, FileRecord]], plan: Plan, wanted: list[int]) -> dict[str, FileRecord]:
    out: dict[str, FileRecord] = {}
    for i in wanted:
        out.update(per_file[plan.files[i].path])
    return out


# --------------------------------------------------------------------------------------------
# Work units and bands


def _units(plan: Plan, todo: Iterable[int], reader: TensorReader, band_bytes: int,
           sinks: dict[int, Sink]) -> list[_Unit]:
    row_split: list[_Unit] = []
    by_source: dict[Source, list[tuple[int, OutTensor]]] = {}
    stacked: list[tuple[int, OutTensor]] = []
    for i in todo:
        for tensor in plan.files[i].tensors:
            if tensor.by_slab:
                stacked.append((i, tensor))
            elif tensor.dim == 0:
                row_split.append(_row_unit(i, tensor, reader, band_bytes))
            elif (stored := transposed_rows(tensor, reader, band_bytes)) is not None:
                row_split.append(_Unit([(i, tensor)], *stored, transposed=True))
            else:
                by_source.setdefault(tensor.pieces[0].source, []).append((i, tensor))
    units = (row_split + _slab_units(stacked, reader, band_bytes)
             + [_Unit(*group) for group in column_groups(by_source, reader, band_bytes)])
    order = unit_order([u.tensors for u in units], plan, getattr(reader, "position", None), _file_place(sinks))
    return [units[n] for n in order]


def _file_place(sinks: dict[int, Sink]) -> Callable[[int, OutTensor], int]:
    """Where a tensor's bytes start in its output file, where its sink says (``file_offset``), else 0: units then
    start in the order their bytes lie, so each file's digest hashes them as written, not read back."""
    def place(file_index: int, tensor: OutTensor) -> int:
        offset = getattr(sinks.get(file_index), "file_offset", None)
        return int(offset(tensor.key, 0)) if offset is not None else 0
    return place


def _bands(unit: _Unit) -> list[tuple[int, int]]:
    """Row ranges [start, stop) of a unit; a 0-dim tensor is one band (0, 0)."""
    if not unit.rows:
        return [(0, 0)]
    return [(start, min(start + unit.band_rows, unit.rows)) for start in range(0, unit.rows, unit.band_rows)]


def _row_unit(file_index: int, tensor: OutTensor, reader: TensorReader, band_bytes: int) -> _Unit:
    rows = tensor.shape[0] if tensor.shape else 1
    src_dtype, _, src_cm = reader.info(tensor.pieces[0].source)
    period = _period(tensor)
    per_row = row_bytes(tensor.shape, tensor.dtype.itemsize) * 2 + row_bytes(tensor.shape, src_dtype.itemsize)
    if period > 1:  # permuted pieces are read into a buffer of their own first
        per_row += row_bytes(tensor.shape, src_dtype.itemsize)
    if src_cm:  # a column-major source's rows are gathered a run per column, then transposed (io.torchzip_read)
        per_row += 2 * row_bytes(tensor.shape, src_dtype.itemsize)
    whole = tensor.column_major or not tensor.shape
    band_rows = rows if whole else max(1, band_bytes // max(per_row, 1))
    band_rows = max(period, band_rows - band_rows % period)  # bands never cut a permuted period
    return _Unit([(file_index, tensor)], rows, max(band_rows, 1), per_row)


def _slab_units(stacked: list[tuple[int, OutTensor]], reader: TensorReader, band_bytes: int) -> list[_Unit]:
    """Stacked tensors (NxD's experts), or ones read from stacked sources: one slab index (or part of one, beyond
    ``band_bytes``) per band, of every tensor that shares its source matrices (ckptconv.engine.slabs), budgeted at
    every buffer the band builds."""
    units = []
    for group in slab_groups(stacked):
        work = slab_work([t for _, t in group], reader, band_bytes)
        units.append(_Unit(group, (group[0][1].slabs or 1) * work.per_slab, 1, work.nbytes, work))
    return units


def _period(tensor: OutTensor) -> int:
    """The row period of the tensor's permuted pieces (1: none); one period per tensor."""
    periods = {len(p.row_perm) for p in tensor.pieces if p.row_perm}
    if len(periods) > 1:
        raise AssertionError(f"{tensor.key}: pieces permute rows in periods {sorted(periods)}")
    if periods and tensor.dim != 0:
        raise AssertionError(f"{tensor.key}: rows can be permuted only in a tensor split by rows")
    return periods.pop() if periods else 1


def _write_band(
    unit: _Unit,
    start: int,
    stop: int,
    reader: TensorReader,
    sinks: dict[int, Sink],
    progress: Callable[[int], None] | None,
    claims: BandClaims,
    extents: list[tuple[int, int]],
) -> None:
    """Write band [start, stop) of ``unit``'s tensors, whose ``extents`` (:meth:`_Unit.extents`) it claimed, in
    :func:`write_order`, giving up each one's claim once written."""
    cache: dict[Source, torch.Tensor] = {}
    slabs = []
    if unit.slab_work is not None:  # one slab, or part of one, of each tensor, built in this band's arena
        slabs = slab_writes(unit.slab_work, [t for _, t in unit.tensors], start, reader, _SCRATCH.get,
                            lambda n, at, size: _file_phase(sinks[unit.tensors[n][0]], unit.tensors[n][1], at, size))
    for n in write_order(unit.tensors, extents, _file_place(sinks)):
        file_index, tensor = unit.tensors[n]
        offset, nbytes = extents[n]
        phase = _file_phase(sinks[file_index], tensor, offset, nbytes)
        if slabs:
            offset, band = slabs[n]
        elif unit.transposed:
            band = column_block(tensor, start, stop, reader)
        elif unit.shared_sources:
            band = column_band(tensor, start, stop, reader, cache, phase)
        else:
            band = row_band(tensor, start, stop, reader, phase)
        if band.dtype != tensor.dtype:
            band = _SCRATCH.get(tensor.dtype, tuple(band.shape), phase).copy_(band)
        if tensor.column_major:  # storage order of a column-major tensor is its transpose
            data = transpose_into(_SCRATCH.get(tensor.dtype, (band.shape[1], band.shape[0]), phase), band)
        else:
            data = band
        sinks[file_index].write_extent(tensor.key, offset, data.reshape(()) if not tensor.shape else data)
        claims.written(n)
        if progress is not None:
            progress(data.numel() * data.element_size())


def _file_phase(sink: Sink, tensor: OutTensor, offset: int, nbytes: int) -> int | None:
    """Where in a page ``nbytes`` at byte ``offset`` of the tensor start in its file, if O_DIRECT may write them."""
    file_offset = getattr(sink, "file_offset", None)
    if file_offset is None or nbytes < direct_io.MIN_DIRECT:
        return None
    return file_offset(tensor.key, offset) % _Scratch.PAGE


def row_band(tensor: OutTensor, start: int, stop: int, reader: TensorReader, phase: int | None = None) -> torch.Tensor:
    """Output rows [start, stop), each piece read straight into its place in one buffer (at ``phase``, see
    _Scratch.get)."""
    if not tensor.shape:  # 0-dim: one piece, the whole thing
        return reader.read_rows(tensor.pieces[0].source, 0, 1).reshape(())
    src_dtype = reader.info(tensor.pieces[0].source)[0]
    band = _SCRATCH.get(src_dtype, (stop - start, *tensor.shape[1:]), phase)
    offset = 0
    for piece in tensor.pieces:
        lo, hi = max(start, offset), min(stop, offset + piece.length)
        if lo < hi:
            shift = lo - offset
            target = band[lo - start:hi - start]
            if piece.row_perm:  # read in source order, then put each period's rows in place
                period = len(piece.row_perm)
                if shift % period or (hi - lo) % period:
                    raise AssertionError(f"{tensor.key}: band rows {lo}..{hi} cut a period of {period}")
                source_rows = _SCRATCH.get(src_dtype, tuple(target.shape))
                _read_piece_rows(reader, piece, shift, hi - lo, source_rows, src_dtype)
                order = torch.tensor(piece.row_perm, dtype=torch.long)
                grouped = source_rows.view(-1, period, max(1, source_rows[0].numel()))
                torch.index_select(grouped, 1, order, out=target.view(grouped.shape))
            else:
                _read_piece_rows(reader, piece, shift, hi - lo, target, src_dtype)
        offset += piece.length
    return band


def _read_piece_rows(reader: TensorReader, piece: Piece, shift: int, n: int, target: torch.Tensor,
                     dtype: torch.dtype) -> None:
    """``n`` rows of ``piece`` from its row ``shift`` (or the fp32 mean of its copies) into ``target``."""
    if piece.zeros:  # vocabulary padding
        target.zero_()
    elif piece.alternates:  # --kv-replicas mean: average every copy, in fp32
        copies = [reader.read_rows(p.source, p.start + shift, p.start + shift + n).float()
                  for p in (piece, *piece.alternates)]
        target.copy_(torch.stack(copies).mean(dim=0))
    elif reader.info(piece.source)[0] == dtype:
        reader.read_rows(piece.source, piece.start + shift, piece.start + shift + n, out=target)
    else:
        target.copy_(reader.read_rows(piece.source, piece.start + shift, piece.start + shift + n))



# --------------------------------------------------------------------------------------------
# Replica checks


def _check_replicas(groups: list[ReplicaGroup], reader: TensorReader, policy: str) -> None:
    """All copies of a replicated range must be equal before one of them is exported."""
    if policy not in ("error", "first", "mean"):
        raise ConversionError(f"--kv-replicas must be 'error', 'first' or 'mean', got {policy!r}")
    if policy != "error":
        return  # the plan keeps the first copy, or averages them
    for group in groups:
        for first, other, copy in replica_bands(reader, group):
            if not torch.equal(first, other):
                diff = (first.float() - other.float()).abs().max().item()
                raise VerificationError(
                    f"replicas of {group.hf_key}[{group.start}:{group.stop}] differ: "
                    f"{copy.source.file}:{copy.source.key} vs {group.copies[0].source.file}:"
                    f"{group.copies[0].source.key}, max abs difference {diff:.3g}; "
                    "the K/V replica order was checked against the layout when the shards were opened, so "
                    "these copies drifted apart (e.g. trained without keeping replicas in sync): pass "
                    "--kv-replicas first or mean to export the first copy or their mean"
                )


REPLICA_BAND_BYTES = 64 << 20  # replicas are compared band by band: a tied 128k-row embedding is GBs


def replica_bands(reader: TensorReader, group: ReplicaGroup):  # type: ignore[no-untyped-def]
    """(first copy, other copy, that copy's piece) band by band (whole pieces when split by columns)."""
    first_piece = group.copies[0]
    if group.dim != 0:
        first = _read_piece(reader, first_piece, group.dim)
        for copy in group.copies[1:]:
            yield first, _read_piece(reader, copy, group.dim), copy
        return
    dtype, shape, _ = reader.info(first_piece.source)
    rows = max(1, REPLICA_BAND_BYTES // max(1, row_bytes(shape, dtype.itemsize)))
    for lo in range(0, first_piece.length, rows):
        hi = min(lo + rows, first_piece.length)
        first = reader.read_rows(first_piece.source, first_piece.start + lo, first_piece.start + hi)
        for copy in group.copies[1:]:
            yield first, reader.read_rows(copy.source, copy.start + lo, copy.start + hi), copy


def read_tensor(tensor: OutTensor, reader: TensorReader) -> torch.Tensor:
    """A planned tensor whole, in memory (a training rank reads its own shard of another layout this way)."""
    if not tensor.shape:  # 0-dim: one piece, the whole thing
        return reader.read_rows(tensor.pieces[0].source, 0, 1).reshape(()).to(tensor.dtype)
    if tensor.by_slab:
        return slab_band(tensor, 0, tensor.slabs, reader).to(tensor.dtype).contiguous()
    if any(p.row_perm or p.alternates for p in tensor.pieces):
        raise AssertionError(f"{tensor.key}: permuted or averaged pieces are read by the executor only")
    parts = [_zero_piece(tensor, piece) if piece.zeros else _read_piece(reader, piece, tensor.dim)
             for piece in tensor.pieces]
    out = parts[0] if len(parts) == 1 else torch.cat([p.to(tensor.dtype) for p in parts], dim=tensor.dim)
    return out.to(tensor.dtype).contiguous()


def _zero_piece(tensor: OutTensor, piece: Piece) -> torch.Tensor:
    """Vocabulary padding: ``piece.length`` zero rows (or columns) of the tensor."""
    shape = list(tensor.shape)
    shape[tensor.dim] = piece.length
    return torch.zeros(shape, dtype=tensor.dtype)


def _read_piece(reader: TensorReader, piece, dim: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    if dim == 0:
        return reader.read_rows(piece.source, piece.start, piece.stop)
    _, shape, _ = reader.info(piece.source)
    return reader.read_rows(piece.source, 0, shape[0])[:, piece.start:piece.stop]


# --------------------------------------------------------------------------------------------
# Files: finalize, hash, rename, resume state


@contextlib.contextmanager
def _naming(out_file: OutFile, tmp: Path):  # type: ignore[no-untyped-def]
    """A full disk while writing ``out_file`` becomes an error naming it and its size."""
    try:
        yield
    except OSError as exc:
        error = disk_full(exc, tmp / out_file.path, out_file.nbytes)
        if error is None:
            raise
        raise error from exc

