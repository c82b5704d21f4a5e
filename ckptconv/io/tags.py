"""What a training tag is on disk, said once for both packages: its name ``step_<N>``, the markers that make it
complete, which tags of a checkpoint root are complete and which one is newest, and its folders and side files.

A tag ``<root>/step_<N>/`` holds ``model/`` (the shards), ``optim/`` (the optimizer files: nxdtrain's format,
:mod:`ckptconv.training.nxdtrain_format`, or NxD's own, :mod:`ckptconv.training.nxd_format`), ``scheduler.pt`` and
``user_content.pt``, ``hf/``, ``ckptconv.json``, and the markers ``checkpoint`` then ``done``, written last. How a
tag is written: :mod:`ckptconv.engine.tags`.

    >>> tag_name(120), tag_step("step_120"), tag_step("x--step=120-consumed_samples=9.ckpt"), is_step_tag("best")
    ('step_120', 120, 120, False)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from ckptconv.io.atomic import write_text

TAG_PREFIX = "step_"
DONE_MARKER = "done"
CHECKPOINT_MARKER = "checkpoint"
# The one order: ``checkpoint`` first, ``done`` last; a tag without ``done`` is never resumed from (so a removal
# takes them in the other order, ``done`` first). Not listed in ckptconv.json: ours by name.
TAG_MARKERS = (CHECKPOINT_MARKER, DONE_MARKER)
OPTIM_DIR = "optim"  # a training tag's optimizer files
SCHEDULER_FILE, USER_CONTENT_FILE = "scheduler.pt", "user_content.pt"


def tag_name(step: int) -> str:
    """The directory name of the tag saved at ``step``."""
    return f"{TAG_PREFIX}{step}"


def tag_step(name: str) -> int | None:
    """The step number in a tag name (``step_120``, ``x--step=120-consumed_samples=9.ckpt``)."""
    m = re.search(r"(?:^step_|--step=)(\d+)", name)
    return int(m.group(1)) if m else None


def is_step_tag(name: str) -> bool:
    """Whether ``name`` is a ``step_<N>`` tag's (the tags nxdtrain writes, and prunes)."""
    return name.startswith(TAG_PREFIX) and tag_step(name) is not None


def write_markers(tag_dir: Path, names: Sequence[str] = TAG_MARKERS) -> None:
    """``checkpoint`` first, ``done`` last: a tag without ``done`` is never resumed from (``names``: another
    output's markers, in their order)."""
    for name in names:
        write_text(tag_dir / name, "1")


def completed_tags(root: Path) -> list[Path]:
    """Tag directories under ``root`` that have a ``done`` marker, oldest first (step, then mtime)."""
    tags = [p for p in root.iterdir() if p.is_dir() and (p / DONE_MARKER).is_file()]

    def order(p: Path) -> tuple[int, float]:
        step = tag_step(p.name)
        return (step if step is not None else -1, (p / DONE_MARKER).stat().st_mtime)

    return sorted(tags, key=order)


def newest_tag(root: Path) -> tuple[Path | None, str | None]:
    """The tag a checkpoint root resumes or exports from: the completed tag with the highest step
    (the ``done`` marker's mtime only breaks ties), and a warning when NxD's own rule, the tag whose
    ``done`` was modified last, would take another one (after a copy that lost the timestamps)."""
    tags = completed_tags(root)
    if not tags:
        return None, None
    ours = tags[-1]
    by_mtime = max(tags, key=lambda p: (p / DONE_MARKER).stat().st_mtime)
    if by_mtime == ours or (by_mtime / DONE_MARKER).stat().st_mtime == (ours / DONE_MARKER).stat().st_mtime:
        return ours, None
    return ours, (f"{root}: took {ours.name}, the highest step; NxD's load_checkpoint would take {by_mtime.name}, "
                  f"whose '{DONE_MARKER}' marker was modified last (timestamps changed by a copy?); pass a tag "
                  "directory to choose")
