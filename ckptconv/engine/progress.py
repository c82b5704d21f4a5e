"""Progress on stderr (rich): bytes written, rate, ETA. Silent when quiet or not wanted."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def byte_progress(description: str, total: int, *, quiet: bool) -> Iterator[Callable[[int], None]]:
    """Yield an ``advance(nbytes)`` callback (thread-safe) that drives one progress bar."""
    if quiet:
        yield lambda n: None
        return
    from rich.console import Console  # only for a bar: a quiet or --json run never imports rich (~50 modules)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    console = Console(file=sys.stderr)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    lock = threading.Lock()
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(description, total=total)

        def advance(n: int) -> None:
            with lock:
                progress.advance(task, n)

        yield advance
