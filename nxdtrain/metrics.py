"""What rank 0 shows and records per step: a rich progress line (or plain lines when not a
terminal), ``--log-jsonl`` with one JSON object per step, and ``--tensorboard`` event files; a step's results
stay on the device (:class:`PendingStep`) until :func:`read_metrics` reads them, once per log line."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float         # before clipping
    tokens_per_s: float
    consumed_samples: int
    param_norm: float = 0.0  # after the update; each distinct element once, as grad_norm
    eval_loss: float | None = None  # on the steps that evaluated --eval-data
    aux_loss: float | None = None   # MoE: the router's load-balancing loss (unscaled; loss stays the cross-entropy)


@dataclass(frozen=True)
class PendingStep:
    """One step's results, still on the device until the next log read."""

    step: int
    loss: torch.Tensor
    lr: float
    grad_norm: torch.Tensor
    consumed_samples: int
    param_norm: torch.Tensor
    eval_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None  # MoE: the router's load-balancing loss


def read_metrics(pending: list[PendingStep], started: float, tokens_per_step: int) -> list[StepMetrics]:
    """Host numbers for the steps since the last read (``started``): one wait for the device per read."""
    values = [(float(p.loss), float(p.grad_norm), float(p.param_norm),
               None if p.eval_loss is None else float(p.eval_loss),
               None if p.aux_loss is None else float(p.aux_loss)) for p in pending]
    rate = tokens_per_step * len(pending) / (time.perf_counter() - started)
    return [StepMetrics(p.step, loss, p.lr, norm, rate, p.consumed_samples, param_norm, eval_loss, aux)
            for p, (loss, norm, param_norm, eval_loss, aux) in zip(pending, values, strict=True)]


# TensorBoard tags of the StepMetrics fields, ours and NxDT's (what its PyTorch Lightning module logs, so the
# dashboards of either read the run); the x axis is the step. NxDT's "throughput" is sequences/s.
TENSORBOARD_TAGS = {"loss": ("train/loss", "reduced_train_loss"), "lr": ("train/lr", "lr"),
                    "grad_norm": ("train/grad_norm", "gradient_norm"),
                    "param_norm": ("train/param_norm", "parameter_norm"),
                    "tokens_per_s": ("train/tokens_per_s",),
                    "consumed_samples": ("train/consumed_samples", "consumed_samples"),
                    "eval_loss": ("eval/loss", "val_loss"), "aux_loss": ("train/aux_loss", "aux_loss")}
NXDT_STEP_TAGS = ("global_step", "throughput")  # the step itself, and tokens/s over --seq-len


def require_tensorboard() -> None:
    """Fail with one line, before training, when --tensorboard cannot write (the optional extra is missing)."""
    from nxdtrain.config.extras import require

    require("tensorboard", "--tensorboard")  # torch.utils.tensorboard needs it


def note(message: str) -> None:
    """A one-line message on stderr (rank 0 decides whether to call it)."""
    print(f"nxdtrain: {message}", file=sys.stderr, flush=True)


class StepLog:
    """Rank 0's view of the run: progress with loss, lr, tokens/s and ETA; the jsonl file."""

    def __init__(self, *, first_step: int, last_step: int, jsonl: str | None, enabled: bool,
                 tensorboard: str | None = None, seq_len: int = 1) -> None:
        self.enabled, self.seq_len = enabled, seq_len
        self.first, self.last = first_step, last_step
        self._jsonl: TextIO | None = None
        self._tensorboard: Any = None
        self._progress: Any = None
        self._started = time.monotonic()
        if not enabled:
            return
        if jsonl:
            Path(jsonl).parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(jsonl, "a")  # a resumed run appends to the same log
        if tensorboard:
            require_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=tensorboard)  # a new event file per run; resumes add one
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
        if m.aux_loss is not None:
            stats = stats.replace("  lr", f"  aux {m.aux_loss:.4f}  lr", 1)
        if m.eval_loss is not None:
            stats += f"  eval loss {m.eval_loss:.4f}"
        if self._jsonl is not None:
            row = asdict(m)
            if m.aux_loss is None:  # dense runs: the lines as before
                del row["aux_loss"]
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._tensorboard is not None:
            for field, tags in TENSORBOARD_TAGS.items():
                value = getattr(m, field)
                for tag in tags if value is not None else ():
                    self._tensorboard.add_scalar(tag, value, global_step=m.step)
            global_step, throughput = NXDT_STEP_TAGS
            self._tensorboard.add_scalar(global_step, m.step, global_step=m.step)
            self._tensorboard.add_scalar(throughput, m.tokens_per_s / self.seq_len, global_step=m.step)
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
        if self._tensorboard is not None:
            self._tensorboard.close()
