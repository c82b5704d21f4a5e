"""Running one conversion: its plan written into OUT under OUT's lock, resumed, split into parts, finalized; and
:class:`Run`, the scaffold every verb shares (options, start time, notes, the result's epilogue).

A verb is thin: it opens its source, plans, then

    >>> run = Run("to-nxd", options)                                              # doctest: +SKIP
    >>> result = run.write(plan, reader, out, sinks, spec, sources=[src])          # doctest: +SKIP
    >>> return run.finish(result, layout.to_json())                                # doctest: +SKIP

``write`` declares every path before the first byte, skips an up-to-date OUT, resumes an interrupted run of the
same conversion (same :func:`fingerprint`), never removes what ckptconv did not record, and finalizes when it is
the last part to finish.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ckptconv.core.human import human_bytes
from ckptconv.core.plan import NESTED_TORCH, Plan
from ckptconv.engine import outdir
from ckptconv.engine.execute import ExecOptions, run_plan
from ckptconv.engine.finalize import (
    FinalizeSpec,
    assign_files,
    pending_fingerprint,
    record_part,
    state_name,
    try_finalize,
    write_spec,
)
from ckptconv.engine.options import RunOptions, default_workers, workers_for
from ckptconv.engine.progress import byte_progress
from ckptconv.errors import ConversionError
from ckptconv.io.digest import FileRecord
from ckptconv.io.metadata import read_metadata, tool_version
from ckptconv.io.nxd import TENSORS_SUFFIX


@dataclass
class Result:
    """What a verb did: OUT, the files it holds (path -> record), bytes written by this process, seconds, notes."""

    out: Path
    files: dict[str, FileRecord]
    bytes_written: int
    seconds: float
    notes: list[str]
    layout: dict[str, Any] | None = None
    skipped: bool = False
    finalized: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "files": len(self.files),
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 3),
            "layout": self.layout,
            "notes": self.notes,
            "up_to_date": self.skipped,
            "complete": self.finalized,
        }


class PlannedPart(Protocol):
    """One part of a conversion planned from its own files only (a training tag's reshard part,
    :class:`ckptconv.training.tag_parts.TagPart`): what it writes, what the whole run declares, how many files."""

    @property
    def mine(self) -> Collection[str]: ...  # the files this part writes

    @property
    def declared(self) -> Collection[str]: ...  # every path any part may create

    @property
    def count(self) -> int: ...  # how many files all parts write


class Run:
    """One call of a verb: its options (defaults when None), its start time and the notes it gathers."""

    def __init__(self, label: str, options: RunOptions | None) -> None:
        self.label = label
        self.options = options or RunOptions()
        self.started = time.monotonic()
        self.notes: list[str] = []
        self._finished = False

    def write(self, plan: Plan, reader: Any, out: Path, sinks: Any, spec: FinalizeSpec, kv_replicas: str = "error", *,
              sources: list[Path], part_of: PlannedPart | None = None) -> Result:
        """:func:`write_plan` with this run's options and label."""
        return write_plan(plan, reader, out, sinks, self.options, spec, self.label, kv_replicas, sources=sources,
                          part_of=part_of)

    def finish(self, result: Result, layout: dict[str, Any] | None = None) -> Result:
        """The epilogue: this run's notes before the writer's, the layout written, the seconds taken. Once a run:
        a second call would say every note twice."""
        assert not self._finished, f"{self.label}: the run was finished already"
        self._finished = True
        result.notes[:0] = self.notes
        if layout is not None:
            result.layout = layout
        result.seconds = time.monotonic() - self.started
        return result


def write_plan(plan: Plan, reader: Any, out: Path, sinks: Any, options: RunOptions, spec: FinalizeSpec,
             label: str, kv_replicas: str = "error", *, sources: list[Path], part_of: PlannedPart | None = None) -> Result:
    """Write this process's part of ``plan`` under OUT's lock; finalize when it is the last part to finish.
    ``part_of``: a part planned from its own files, whose ``plan`` holds those files only."""
    part = options.part
    spec.parts = part[1]
    spec.hash = options.digest
    if part[1] > 1 and options.overwrite:
        raise ConversionError("--overwrite cannot be combined with several parts; run without --part first")
    outdir.check_separate(sources, out)
    with outdir.acquire(out, fingerprint=spec.fingerprint, parts=part[1]) as lock:
        if not lock.shared:  # the first (or only) process: check OUT and set it up
            if _up_to_date(out, spec.fingerprint, options):
                outdir.clear_tmp(out)  # what a run killed after writing ckptconv.json left behind
                return Result(out, _recorded(out), 0, 0.0, ["output is up to date"], skipped=True)
            _prepare_out(out, spec.fingerprint, options)
            outdir.declare(out, spec.fingerprint[:16], planned_outputs(plan, spec) if part_of is None else list(part_of.declared))
            write_spec(out, spec)
            if part[1] > 1:
                lock.share()
        mine = assign_files(plan, part) if part_of is None else set(part_of.mine)
        total = sum(f.nbytes for f in plan.files if f.path in mine)
        workers = workers_for(total, options.workers)
        kept: list[str] = []
        with byte_progress(f"{label} {out.name}", total, quiet=options.quiet) as advance:
            exec_options = ExecOptions(workers=workers, max_memory=options.max_memory, replicas=kv_replicas,
                                       fingerprint=spec.fingerprint, hash=spec.hash, progress=advance,
                                       write_io=options.write_io)
            files = run_plan(plan, reader, out, sinks, exec_options, only_files=mine, state_file=state_name(part),
                             kept=kept)
        if hasattr(reader, "finish_checks"):  # every input file read from matches its record, before OUT is complete
            reader.finish_checks(workers=options.workers or default_workers())  # may read more than was written
        record_part(out, part, files)
        finalized = try_finalize(out, lock)
    count = len(plan.files) if part_of is None else part_of.count
    notes = [] if part[1] == 1 else [f"part {part[0]}/{part[1]}: {len(mine)} of {count} files"]
    kept_bytes = sum(f.nbytes for f in plan.files if f.path in set(kept))
    if kept:
        notes.append(f"resumed: {len(kept)} file{'s' if len(kept) != 1 else ''} / {human_bytes(kept_bytes)} kept "
                     "from the interrupted run; bytes_written counts only what this run wrote")
    if finalized is None:
        notes.append(f"other parts are still running; the last one (or `ckptconv finalize {out}`) finishes OUT")
    return Result(out, finalized or files, total - kept_bytes, 0.0, notes, finalized=finalized is not None)


def planned_outputs(plan: Plan, spec: FinalizeSpec) -> list[str]:
    """Every path this conversion may create in OUT (declared before the first byte is written)."""
    paths = [f.path for f in plan.files] + [f.path + TENSORS_SUFFIX for f in plan.files
                                            if f.format in ("torch", NESTED_TORCH)]
    return paths + list(spec.texts) + list(spec.blobs) + [rel for _, rel in spec.copies] + spec.markers


def file_identity(files: list[Path]) -> list[tuple[str, int, int]]:
    """What identifies the inputs cheaply: names, sizes, modification times."""
    return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def fingerprint(*parts: Any) -> str:
    """What identifies a conversion: the tool version and everything that decides its output."""
    payload = json.dumps([tool_version(), *parts], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def _up_to_date(out: Path, identity: str, options: RunOptions) -> bool:
    meta = read_metadata(out) if out.is_dir() else None
    if meta is None or meta.fingerprint != identity or options.overwrite:
        return False
    return all(FileRecord.from_json(rec).matches(out / rel) for rel, rec in meta.files.items())


def _recorded(out: Path) -> dict[str, FileRecord]:
    meta = read_metadata(out)
    assert meta is not None
    return {rel: FileRecord.from_json(rec) for rel, rec in meta.files.items()}


def _prepare_out(out: Path, identity: str, options: RunOptions) -> None:
    """Under OUT's lock: resume this conversion, or start it in an empty OUT, or (``--overwrite``)
    replace an earlier ckptconv conversion. Never removes what no ckptconv writer recorded."""
    meta = read_metadata(out) if out.is_dir() else None
    if meta is not None and meta.fingerprint == identity:
        return  # same conversion, some files damaged or missing: redo those
    if meta is None and pending_fingerprint(out) == identity:
        return  # an interrupted run of this same conversion (or another part of it): resume
    strangers, ours = outdir.foreign(out), outdir.present(out)
    if strangers and options.overwrite:
        raise ConversionError(
            f"{out}: --overwrite only replaces files a ckptconv conversion recorded; {strangers[0]!r} is not one of "
            "them; choose another OUT (or move that file away yourself)"
        )
    if (strangers or ours) and not options.overwrite:
        what = (f"another conversion ({meta.kind}, fingerprint {meta.fingerprint[:12]})" if meta is not None
                else "files of an unfinished conversion" if ours else f"files ckptconv did not write ({strangers[0]!r})")
        # Only ckptconv's own output may be replaced, and only when asked: the flag is named with what it deletes.
        replace = "" if strangers else (", or pass --overwrite to delete that conversion's files and write this one"
                                        " instead")
        raise ConversionError(f"{out}: not empty; holds {what}; choose another OUT{replace}")
    outdir.remove_owned(out)  # only ours: listed in ckptconv.json or declared in the temporary directory
