"""What a command's SRC is, said before anything is converted: an HF model, NxD shards, or neither.

A command given the other kind of checkpoint points to the command that reads it (``to-hf`` of an HF
folder: ``did you mean ckptconv to-nxd?``), and a file that is no checkpoint at all (``config.json``)
is named in one line that says what SRC must be.

Example:
    >>> hf_source_error("llama-hf", "to-hf")              # doctest: +SKIP
    'SRC llama-hf is an HF checkpoint already; to-hf converts NxD shards to HF; did you mean ckptconv to-nxd?'
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ckptconv.core.layout import MODEL_DIR, parse_shard_name
from ckptconv.engine.finalize import refuse_unfinished
from ckptconv.errors import ConversionError
from ckptconv.io.hf import HfCheckpoint, is_hf_dir
from ckptconv.io.metadata import METADATA_FILE, read_metadata
from ckptconv.io.safetensors_io import NotSafetensorsError

HF_SRC = ("an HF model directory, a hub id org/name, or one state-dict file (.safetensors, .pt, .bin) "
          "with --config")
NXD_SRC = "NxD shards: a directory holding model/, a model/ directory, a training tag, or a checkpoint root"
_NXD_READERS = {"to-hf": "converts NxD shards to HF", "reshard": "converts NxD shards to another layout",
                "to-dcp": "", "verify": "", "nxd-compat": ""}


def is_nxd_dir(path: Path) -> bool:
    """NxD shards: a ``model/`` folder, shard files, or a ckptconv.json of NxD shards; no HF weights."""
    if not path.is_dir() or is_hf_dir(path):
        return False
    meta = read_metadata(path) if (path / METADATA_FILE).is_file() else None
    if meta is not None:
        return meta.kind == "nxd"
    return (path / MODEL_DIR).is_dir() or any(parse_shard_name(p.name) is not None for p in path.iterdir())


def refuse_hf_source(src: str | Path, command: str) -> None:
    """``command`` reads NxD shards: an HF folder as its SRC points to ``to-nxd``."""
    if is_hf_dir(Path(src)):
        does = _NXD_READERS.get(command) or "reads NxD shards"
        raise ConversionError(f"SRC {src} is an HF checkpoint already; {command} {does}; did you mean "
                              f"ckptconv to-nxd?")


def refuse_nxd_source(src: str | Path, command: str = "to-nxd") -> None:
    """to-nxd reads HF models: NxD shards as its SRC point to ``to-hf`` and ``reshard``."""
    if is_nxd_dir(Path(src)):
        raise ConversionError(f"SRC {src} holds NxD shards already; {command} converts an HF model to NxD; did you "
                              "mean ckptconv to-hf (to HF) or ckptconv reshard (to another layout)?")


@contextmanager
def open_hf(src: str | Path, *, config: str | Path | None = None, io: str = "mmap") -> Iterator[HfCheckpoint]:
    """:class:`HfCheckpoint` of SRC; a file that is no tensor file (``config.json``) is refused in one line
    that names it and says what SRC must be; an interrupted export is named as such (rerun it)."""
    refuse_unfinished(src)
    try:
        hf = HfCheckpoint(src, config=config, io=io)
    except NotSafetensorsError as e:
        if not Path(src).is_file():
            raise
        raise ConversionError(f"SRC {e}; SRC must be {HF_SRC}") from None
    with hf:
        yield hf
