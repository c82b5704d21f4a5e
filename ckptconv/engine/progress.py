"""Progress on stderr (rich): bytes written (or things done), rate, ETA. Silent when quiet or not wanted."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def byte_progress(description: str, total: int, *, quiet: bool, of: str | None = None) -> Iterator[Callable[[int], None]]:
    """Yield an ``advance(nbytes)`` callback (thread-safe) that drives one progress bar; ``of``: what is counted
    instead of bytes (``"layers"``: the bar says ``3/32 layers``)."""
    if quiet:
        yield lambda n: None
        return
    from rich.console import Console  # only for a bar: a quiet or --json run never imports rich (~50 modules)
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = Console(file=sys.stderr)
    amount = (DownloadColumn(), TransferSpeedColumn()) if of is None else (MofNCompleteColumn(), TextColumn(of))
    columns = (TextColumn("{task.description}"), BarColumn(), *amount, TimeRemainingColumn())
    lock = threading.Lock()
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(description, total=total)

        def advance(n: int) -> None:
            with lock:
                progress.advance(task, n)

        yield advance
