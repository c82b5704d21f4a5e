"""Writing a training tag, once for every writer: ``reshard`` of a tag and ``from-dcp --to nxd`` (a plan run by
:mod:`ckptconv.engine.run`, finished by :mod:`ckptconv.engine.finalize` through :func:`complete_as_tag`) and
nxdtrain's saves (every rank writes its files in process; ``nxdtrain.checkpoint.save`` says who writes what).

The protocol: claim the tag (its lock; what another tool wrote there refused, what an earlier try of ours left
cleared) -> declare every name it may hold -> write each file under a temporary name, renamed when complete ->
record each file (size, digest) -> ``ckptconv.json`` -> the markers, once, last (:data:`ckptconv.io.tags.TAG_MARKERS`)
-> the retention hook. What a tag is on disk: :mod:`ckptconv.io.tags`.
"""

from __future__ import annotations

import base64
import contextlib
import io
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptconv.core.layout import HF_FILES_DIR, MODEL_DIR
from ckptconv.engine import outdir
from ckptconv.io.digest import DEFAULT, record_files
from ckptconv.io.direct_io import direct_writes
from ckptconv.io.metadata import Metadata, write_metadata
from ckptconv.io.tags import OPTIM_DIR, SCHEDULER_FILE, TAG_MARKERS, USER_CONTENT_FILE, write_markers
from ckptconv.io.write_digest import WriteDigests, recording

if TYPE_CHECKING:
    from ckptconv.engine.finalize import FinalizeSpec

RECORD_KEY = "nxdtrain"  # ckptconv.json's extra[RECORD_KEY]: the run at this tag
# Every name a tag may hold at its top (what an in-process save declares before its first byte).
TAG_ENTRIES = (MODEL_DIR, OPTIM_DIR, HF_FILES_DIR, SCHEDULER_FILE, USER_CONTENT_FILE, *TAG_MARKERS)


def run_record(step: int, consumed_samples: int | None, **more: Any) -> dict[str, Any]:
    """What ``ckptconv.json`` records of the run at a tag: its step, its data position, and ``more``."""
    return {"step": int(step), "consumed_samples": consumed_samples, **more}


def torch_blob(value: Any) -> str:
    """A small side file's content (``torch.save``), as FinalizeSpec's blobs hold it."""
    import torch  # noqa: PLC0415 (a tag's writers only: the engine's other users start without torch)

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def complete_as_tag(spec: FinalizeSpec, *, side: dict[str, Any], record: dict[str, Any],
                    copies: list[tuple[str, str]] | None = None, **extra: Any) -> None:
    """``spec`` finishes its output as a training tag: ``side`` (file name -> value) saved as torch files, ``copies``
    (source path, file name) carried as they are, the run ``record`` (and ``extra``) in ``ckptconv.json``, then the
    markers."""
    spec.blobs.update({name: torch_blob(value) for name, value in side.items()})
    spec.copies.extend(copies or [])
    assert spec.metadata is not None
    spec.metadata["extra"] = {**(spec.metadata.get("extra") or {}), RECORD_KEY: record, **extra}
    spec.markers = list(TAG_MARKERS)  # after ckptconv.json: a tag is complete only then


# --------------------------------------------------------------------------------------------
# The protocol for writers in process (nxdtrain's saves)


def claim_tag(tag: Path, fingerprint: str, refuse: Callable[[str], Exception]) -> outdir.OutLock:
    """Lock ``tag``, refuse it when it holds what we did not write (``refuse(first stranger)`` is raised), clear
    what an earlier save of it left, declare :data:`TAG_ENTRIES`, and write the ``checkpoint`` marker: until
    ``done`` follows, every reader sees an interrupted save (refused), never shards that look complete."""
    lock = outdir.acquire(tag, fingerprint=fingerprint)
    try:
        strangers = outdir.foreign(tag, TAG_MARKERS)
        if strangers:
            raise refuse(strangers[0])
        clear_tag(tag, keep=(outdir.LOCK_FILE,))  # an interrupted save of this same step, or a rerun
        outdir.declare(tag, "tag", list(TAG_ENTRIES))
        outdir.ensure_dir(tag, MODEL_DIR)
        outdir.ensure_dir(tag, OPTIM_DIR)
        outdir.write_text(tag / TAG_MARKERS[0], "1")
    except BaseException:
        lock.release()
        raise
    return lock


@contextlib.contextmanager
def tag_writes(direct: bool = False, *, hold: bool = False) -> Iterator[WriteDigests]:
    """The converter's write path for the files written in this block (in this thread) by :func:`save_torch` and
    ``ckptconv.io.nxd_write.save_shard``: positional writes from the tensors' memory, hashed as they are written (the
    digests yielded, for :func:`file_records`); with ``direct``, large writes with ``O_DIRECT`` where the filesystem
    allows. A training save leaves it off: it stalls training until its bytes are written, and a buffered write
    returns once they are in the page cache, where each direct write waits for the device (measured: a 256 MB state
    0.24 s buffered, 2.0 s direct, cp 0.27 s; docs/performance.md, "Saves"). ``hold``: the writers keep the memory
    of every write unchanged until its file is finished (:class:`ckptconv.io.write_digest.WriteDigest`), so that a
    thread done with its own files may hash another's (``digests.lend_hand()``)."""
    digests = WriteDigests(DEFAULT, hold=hold)
    with recording(digests), direct_writes(direct):
        yield digests


def save_torch(obj: Any, path: Path) -> Path:
    """torch.save to a temporary name in the same directory, then rename: never a half-written file. The bytes are
    torch.save's; written by ckptconv's torch-zip writer where it can (:mod:`ckptconv.io.torch_save`)."""
    import torch  # noqa: PLC0415 (as torch_blob)

    from ckptconv.io.torch_save import save_object  # noqa: PLC0415 (imports torch)

    with outdir.atomic_target(path) as partial:
        if not save_object(obj, partial):
            torch.save(obj, partial)
    return path


def file_records(paths: list[Path], tag: Path, digests: WriteDigests | None = None) -> dict[str, dict[str, Any]]:
    """The ``ckptconv.json`` records (size, digest) of files written in ``tag``; a file ``digests`` hashed as it was
    written is not read again."""
    known = None if digests is None else (lambda rel: digests.of_file(tag / rel))
    return {rel: rec.to_json() for rel, rec in record_files(paths, tag, DEFAULT, known).items()}


def seal(out: Path, meta: Metadata | None, markers: Sequence[str]) -> None:
    """``ckptconv.json`` (its presence means the directory is complete, markers aside), then ``markers`` (known
    names, not in ckptconv.json), then the temporary directory cleared (the lock goes with its holder)."""
    if meta is not None:
        write_metadata(out, meta)
    write_markers(out, markers)
    outdir.clear_tmp(out)


def finish_tag(tag: Path, meta: Metadata, retain: Callable[[], object] | None = None) -> None:
    """The end of a tag's save: ``ckptconv.json``, the markers, then the retention hook (older tags pruned)."""
    seal(tag, meta, TAG_MARKERS)
    if retain is not None:
        retain()


def clear_tag(tag: Path, *, keep: tuple[str, ...] = ()) -> None:
    """Delete what we wrote in ``tag`` (what its ckptconv.json lists, and the markers, ``done`` first: a crash
    halfway leaves a tag that is never resumed); what another tool wrote stays."""
    outdir.remove_owned(tag, also=TAG_MARKERS[::-1], keep=keep)


def remove_tag(tag: Path) -> None:
    """:func:`clear_tag`, and the directory when nothing foreign is left in it."""
    clear_tag(tag)
    with contextlib.suppress(OSError):
        tag.rmdir()
