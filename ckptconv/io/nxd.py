"""NxD checkpoint directories: the names of their files, the serialization flavours, and finding the shards and the
tag to read (what a tag is, its name and markers: :mod:`ckptconv.io.tags`).

Three serialization flavours (docs/nxd-format.md §2): ``plain`` (torch.save of a dict), ``xser-inline``
(the same bytes plus an empty ``<file>.tensors/``; what the official ``--save_xser`` writes), and
``xser-split`` (a dict of ``TensorReference`` + ``<file>.info.pt`` + one file per tensor; what NxD
training writes). Legacy ``tp_rank_XX_pp_rank_YY/checkpoint.pt`` directories are found too. Reading the shards:
:mod:`ckptconv.io.nxd_read`; writing them: :mod:`ckptconv.io.nxd_write`.

Example:
    >>> resolve_checkpoint("/fsx/ckpt")[2]          # a root: its newest completed tag  # doctest: +SKIP
    'newest completed tag step_120 (highest step)'
"""

from __future__ import annotations

import warnings
from enum import Enum
from pathlib import Path

from ckptconv.core.layout import MODEL_DIR, parse_ep_shard_name, parse_shard_name
from ckptconv.errors import ConversionError
from ckptconv.io.tags import CHECKPOINT_MARKER, DONE_MARKER, newest_tag

TENSORS_SUFFIX = ".tensors"
INFO_SUFFIX = ".info.pt"


class Flavour(str, Enum):
    PLAIN = "plain"
    XSER_INLINE = "xser-inline"
    XSER_SPLIT = "xser-split"


def detect_flavour(path: Path) -> Flavour:
    """The flavour a shard was saved in, from what lies beside it."""
    if Path(str(path) + INFO_SUFFIX).is_file():
        return Flavour.XSER_SPLIT
    if Path(str(path) + TENSORS_SUFFIX).is_dir():
        return Flavour.XSER_INLINE
    return Flavour.PLAIN


# --------------------------------------------------------------------------------------------
# Finding a checkpoint


def ep_shard_files(directory: Path) -> dict[tuple[int, int, int], Path]:
    """The shard of every (ep, tp, pp) rank in ``directory`` named in NxD's expert-parallel form."""
    if not directory.is_dir():
        return {}
    return {ranks: entry for entry in directory.iterdir() if (ranks := parse_ep_shard_name(entry.name)) is not None}


def shard_files(directory: Path) -> dict[tuple[int, int], Path]:
    """The shard of every (tp, pp) rank in ``directory``, by the rank its name says (legacy ``tp_rank_XX_pp_rank_YY/``
    directories: their ``checkpoint.pt``)."""
    found: dict[tuple[int, int], Path] = {}
    if not directory.is_dir():
        return found
    for entry in directory.iterdir():
        ranks = parse_shard_name(entry.name)
        if ranks is None:
            continue
        if entry.is_dir():  # legacy: tp_rank_XX_pp_rank_YY/checkpoint.pt
            entry = entry / "checkpoint.pt"
            if not entry.is_file():
                continue
        found[ranks] = entry
    return found


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path, str]:
    """(root holding ``model/``, the shard directory, how it was found) for any accepted PATH.

    Accepted: a directory holding ``model/``; a ``model/`` directory; a training tag; a
    checkpoint root (its newest completed tag); a legacy ``tp_rank_XX_pp_rank_YY`` directory.
    """
    path = Path(path)
    if not path.exists():
        raise ConversionError(f"{path}: no such directory")
    if not path.is_dir():
        raise ConversionError(f"{path}: expected a directory of NxD shards")
    if shard_files(path / MODEL_DIR) or ep_shard_files(path / MODEL_DIR):
        how = "tag" if (path / DONE_MARKER).exists() or (path / CHECKPOINT_MARKER).exists() else "directory"
        if how == "tag" and not (path / DONE_MARKER).is_file():
            raise ConversionError(f"{path}: tag has no '{DONE_MARKER}' marker (an interrupted save); refusing to read it")
        return path, path / MODEL_DIR, how
    if shard_files(path):
        return (path.parent if path.name == MODEL_DIR else path), path, "model directory"
    tag, differs = newest_tag(path)
    if tag is not None:
        how = f"newest completed tag {tag.name} (highest step)"
        if differs:
            warnings.warn(differs, stacklevel=2)
            how += f"; {differs}"
        return tag, tag / MODEL_DIR, how
    raise ConversionError(
        f"{path}: no NxD shards found (looked for {MODEL_DIR}/dp_rank_00_tp_rank_XX_pp_rank_YY.pt, "
        f"shards in the directory itself, and tag directories with a '{DONE_MARKER}' marker)"
    )


__all__ = [
    "Flavour",
    "INFO_SUFFIX",
    "TENSORS_SUFFIX",
    "detect_flavour",
    "resolve_checkpoint",
    "ep_shard_files",
    "shard_files",
]
