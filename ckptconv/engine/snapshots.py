"""Snapshots of a live run: every completed step of a checkpoint root exported into ``OUT/step-N/``, once.

``ckptconv from-dcp ROOT OUT --every`` and ``nxdtrain export ROOT OUT --every`` call :func:`export_every` with the
root's completed steps (TorchTitan: a ``step-N`` holding ``.metadata``; a training tag: its ``done`` marker) and the
one-shot export of one step. Each ``OUT/step-N`` is an ordinary output of that export, so it is resumable and
idempotent by the rules every output follows (:mod:`ckptconv.engine.run`): a step whose ``ckptconv.json`` exists
(written last) is done and skipped without reopening its source; one killed half-way is resumed by the next call.
A step still being written is never listed; one the run deletes (TorchTitan's ``keep_latest_k``, nxdtrain's
retention) before or while it is exported is skipped with a note, and what this tool had written of it is removed.
So is a half-export an earlier call left when it was killed, once the run has deleted its step (the step is older
than the newest one listed and no longer listed): only what this tool wrote (its ``.ckptconv-tmp`` claim and the files
declared there), and never while another call holds it.

``watch``: poll again every so many seconds until ``stop`` is set (:func:`stop_on_interrupt` sets it on Ctrl-C; the
step in flight is finished first, a second Ctrl-C abandons it, resumable).

Example:
    >>> export_every(lambda: [(3, Path("ckpt/step-3"))], lambda s, o: from_dcp(s, o), Path("snaps"))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptconv.core.human import human_bytes
from ckptconv.engine import outdir
from ckptconv.errors import ConversionError
from ckptconv.io.metadata import read_metadata

Steps = Callable[[], list[tuple[int, Path]]]  # the root's completed steps, (N, directory), oldest first
Export = Callable[[Path, Path], Any]  # the one-shot export of one step into its OUT (returns a Result)


def snapshot_name(step: int) -> str:
    """The folder of OUT that holds step ``step``'s export."""
    return f"step-{step}"


_SNAPSHOT = re.compile(r"step-(\d+)")  # snapshot_name's folders


@dataclass
class Snapshots:
    """What :func:`export_every` did: steps exported now, found already exported, skipped (gone), and notes."""

    out: Path
    exported: list[int] = field(default_factory=list)
    up_to_date: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"out": str(self.out), "exported": self.exported, "up_to_date": self.up_to_date,
                "skipped": self.skipped, "notes": self.notes}


def export_every(steps: Steps, export: Export, out: Path, *, watch: float | None = None,
                 stop: threading.Event | None = None, say: Callable[[str], None] | None = None,
                 prog: str = "ckptconv") -> Snapshots:
    """Export each completed step of ``steps()`` not yet in ``out`` into ``out/step-N`` (oldest first); with
    ``watch`` seconds, poll again until ``stop`` is set (in the main thread, Ctrl-C sets it:
    :func:`stop_on_interrupt`). ``say``: one line per step (progress)."""
    if watch is not None and watch <= 0:
        raise ConversionError(f"--watch {watch}: seconds between looks at the checkpoint folder, a number > 0")
    stop = stop or threading.Event()
    interrupt = watch is not None and threading.current_thread() is threading.main_thread()
    with stop_on_interrupt(stop, prog) if interrupt else contextlib.nullcontext(stop):
        return _every(steps, export, Path(out), watch, stop, say or (lambda line: None))


def _every(steps: Steps, export: Export, out: Path, watch: float | None, stop: threading.Event,
           tell: Callable[[str], None]) -> Snapshots:
    done = Snapshots(out)
    seen: set[int] = set()
    while True:
        listing = _listing(steps)
        for step, target in _orphans(out, listing):
            gone = _orphan_removed(step, target)
            if gone:
                done.skipped.append(step)
                done.notes.append(gone)
                tell(gone)
        for step, source in listing:
            if step in seen:
                continue
            seen.add(step)
            _one(step, source, export, done, tell)
            if stop.is_set():
                break
        if watch is None or stop.is_set() or stop.wait(watch):
            return done


def _listing(steps: Steps) -> list[tuple[int, Path]]:
    """``steps()``, listed again when a step vanished while it was listed (the run's retention at work)."""
    for _ in range(3):
        with contextlib.suppress(FileNotFoundError):
            return steps()
    return steps()


def _one(step: int, source: Path, export: Export, done: Snapshots, tell: Callable[[str], None]) -> None:
    """Export one step (or find it exported, or gone); its one line said."""
    target = done.out / snapshot_name(step)
    if target.is_dir() and read_metadata(target) is not None:
        done.up_to_date.append(step)
        tell(f"{source.name}: already exported in {target}")
        return
    started = time.monotonic()
    try:
        result = export(source, target)
    except Exception:
        if source.exists():
            raise
        gone = _removed(source, target)
    else:
        done.exported.append(step)
        tell(f"{source.name} -> {target} ({len(result.files)} files, {human_bytes(result.bytes_written)} written, "
             f"{time.monotonic() - started:.1f} s)")
        return
    done.skipped.append(step)
    done.notes.append(gone)
    tell(gone)


RETENTION = "its checkpoint retention: TorchTitan's keep_latest_k, nxdtrain's --keep"


def _removed(source: Path, target: Path) -> str:
    """The note for a step the run deleted under the export; what the export had written of it is removed (ours
    only: :func:`ckptconv.engine.outdir.remove_owned`), so nothing of it is left to look like a snapshot."""
    if target.is_dir():
        _remove_ours(target)
    return f"{source.name}: removed by the run while it was exported ({RETENTION}); skipped"


def _remove_ours(target: Path) -> None:
    """What this tool wrote in ``target`` (under its lock), then ``target`` itself if nothing else is left in it."""
    with outdir.acquire(target, fingerprint="snapshot-removed"):
        outdir.remove_owned(target)
    for empty in (target / outdir.TMP_DIR, target):  # each only when empty (the lock's release may have done the first)
        with contextlib.suppress(OSError):
            empty.rmdir()


def _orphans(out: Path, listing: list[tuple[int, Path]]) -> list[tuple[int, Path]]:
    """OUT's half-exported ``step-N`` folders (our claim in them, no ``ckptconv.json``) whose step the root no longer
    lists though a newer one is listed: the run deleted it (a step older than a completed one is never still being
    written)."""
    listed = {step for step, _ in listing}
    if not listed or not out.is_dir():
        return []
    found = []
    for target in sorted(out.iterdir()):
        named = _SNAPSHOT.fullmatch(target.name)
        if named is None or target.is_symlink() or not target.is_dir():
            continue
        step = int(named.group(1))
        if (step not in listed and step < max(listed) and (target / outdir.TMP_DIR).is_dir()
                and read_metadata(target) is None):
            found.append((step, target))
    return found


def _orphan_removed(step: int, target: Path) -> str | None:
    """The note for a half-export whose step the run deleted, its files (ours only) removed; None when another
    call holds it (it is in flight there)."""
    try:
        _remove_ours(target)
    except outdir.BusyError:
        return None
    return (f"{snapshot_name(step)}: half-exported by an earlier call that was stopped, and removed by the run since "
            f"({RETENTION}); what ckptconv wrote of it is removed")


@contextlib.contextmanager
def stop_on_interrupt(stop: threading.Event, prog: str) -> Iterator[threading.Event]:
    """While inside: the first Ctrl-C (SIGINT) sets ``stop`` (the step in flight is finished, then the loop
    returns); a second raises KeyboardInterrupt (the step is abandoned; the next call resumes it)."""
    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print(f"{prog}: interrupted: finishing the step in flight (Ctrl-C again abandons it; the next call "
              "redoes it)", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
