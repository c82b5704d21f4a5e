"""What rank 0 shows and records per step: a rich progress line (or plain lines when not a
terminal), and ``--log-jsonl`` with one JSON object per step."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    consumed_samples: int


def note(message: str) -> None:
    """A one-line message on stderr (rank 0 decides whether to call it)."""
    print(f"nxdtrain: {message}", file=sys.stderr, flush=True)


class StepLog:
    """Rank 0's view of the run: progress with loss, lr, tokens/s and ETA; the jsonl file."""

    def __init__(self, *, first_step: int, last_step: int, jsonl: str | None, enabled: bool) -> None:
        self.enabled = enabled
        self.first, self.last = first_step, last_step
        self._jsonl: TextIO | None = None
        self._progress: Any = None
        self._started = time.monotonic()
        if not enabled:
            return
        if jsonl:
            Path(jsonl).parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(jsonl, "a")  # a resumed run appends to the same log
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[stats]}"),
                TextColumn("ETA"), TimeRemainingColumn(), console=Console(stderr=True),
            )
            self._task = self._progress.add_task("train", total=last_step, completed=first_step, stats="")
            self._progress.start()

    def record(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        stats = f"loss {m.loss:.4f}  lr {m.lr:.3g}  |g| {m.grad_norm:.3g}  {m.tokens_per_s:,.0f} tok/s"
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(asdict(m)) + "\n")
            self._jsonl.flush()
        if self._progress is not None:
            self._progress.update(self._task, completed=m.step, stats=stats)
        else:
            done = m.step - self.first
            eta = (time.monotonic() - self._started) / max(1, done) * (self.last - m.step)
            print(f"step {m.step}/{self.last}  {stats}  ETA {eta:.0f}s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._jsonl is not None:
            self._jsonl.close()
