"""``nxdtrain plot LOG.jsonl -o curves.png``: loss (and evaluation loss), learning rate and throughput against the step.

Reads the ``--log-jsonl`` file of a run (a resumed run appends to it; a step logged twice keeps its
last line, as the resumed run's value is the one the checkpoint continues from) and draws three
panels with matplotlib's Agg backend, so no display is needed. Steps that evaluated ``--eval-data``
carry ``eval_loss``: drawn in the loss panel as a second line.

    >>> figure = plot_log("train-log.jsonl", "curves.png")        # doctest: +SKIP
    >>> [ax.get_ylabel() for ax in figure.axes]                     # doctest: +SKIP
    ['loss', 'learning rate', 'tokens/s']
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nxdtrain.config.extras import require
from nxdtrain.errors import TrainError

# (jsonl field, panel label, y axis starts at 0) in panel order
PANELS = (("loss", "loss", False), ("lr", "learning rate", True), ("tokens_per_s", "tokens/s", True))


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """The per-step records of a ``--log-jsonl`` file, one per step in step order (the last line of a step wins)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise TrainError(f"{path}: no such file") from None
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            by_step[int(record["step"])] = record
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise TrainError(f"{path}: line {number} is not a step record of nxdtrain's --log-jsonl") from None
    if not by_step:
        raise TrainError(f"{path}: no step records")
    missing = [f for f, _, _ in PANELS if f not in next(iter(by_step.values()))]
    if missing:
        raise TrainError(f"{path}: records lack {', '.join(missing)}")
    return [by_step[s] for s in sorted(by_step)]


def plot_log(log: str | Path, out: str | Path, *, title: str | None = None) -> Any:
    """Draw the curves of ``log`` into the PNG ``out``; return the matplotlib figure (its lines hold the data)."""
    matplotlib = require("matplotlib", "nxdtrain plot")
    matplotlib.use("Agg")  # files only: never open a window
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    records = read_log(log)
    steps = [r["step"] for r in records]
    figure = Figure(figsize=(8, 7.5), layout="constrained")
    axes = figure.subplots(len(PANELS), 1, sharex=True)
    for ax, (field, label, from_zero) in zip(axes, PANELS, strict=True):
        ax.plot(steps, [r[field] for r in records], marker="o" if len(steps) <= 50 else None, markersize=3,
                linewidth=1.5, label=field, clip_on=False)
        evaluated = [r for r in records if r.get("eval_loss") is not None]
        if field == "loss" and evaluated:
            ax.plot([r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated], marker="s", markersize=4,
                    linewidth=1.5, label="eval_loss", clip_on=False)
            ax.legend(loc="upper right")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if from_zero:  # a rate or a throughput: its scale matters, not only its shape
            ax.set_ylim(bottom=0, top=max(r[field] for r in records) * 1.08 or 1.0)
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    figure.suptitle(title or f"{Path(log).name}: steps {steps[0]}-{steps[-1]}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100, format="png")
    return figure
