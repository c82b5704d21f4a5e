"""Temporary names, then rename: the one way ckptconv writes a file, so none ever looks complete early.

:func:`atomic_target` writes beside the target under ``.NAME.partial`` and renames at the end, never
through a planted symbolic link; :func:`write_text`, :func:`copy_file` and :func:`move_into_place`
(the executor's and a training save's finished temp files) are built on it or on :func:`place`.
Imports nothing from ckptconv but ``errors``, so every reader and writer under ``io/`` may use it;
``ckptconv.engine.outdir`` (what in OUT is ours, one writer at a time) re-exports it.

Example:
    >>> with atomic_target(Path("out/config.json")) as partial:     # doctest: +SKIP
    ...     partial.write_text("{}")
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

from ckptconv.errors import ConversionError

_FULL_DISK = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


class DiskFullError(ConversionError):
    """Writing a file failed for lack of space (or a file-size limit): names the file and the bytes."""


def disk_full(exc: OSError, path: Path | str, needed: int | None) -> ConversionError | None:
    """The one-line error for ``exc`` while writing ``path`` when it means a full disk, else None."""
    if exc.errno not in _FULL_DISK:
        return None
    why = "file size limit reached" if exc.errno == errno.EFBIG else "no space left on device"
    need = f"; needs {needed} more bytes" if needed else ""
    return DiskFullError(f"{path}: {why} while writing{need}; free space (or raise the limit) and rerun to resume")


def ensure_dir(out: Path, rel: str = "") -> Path:
    """``out/rel`` as a directory, created as needed; no component under ``out`` may be a symlink."""
    if out.is_symlink() and not out.exists():
        raise ConversionError(f"{out}: is a dangling symbolic link (to {os.readlink(out)}); "
                              "remove it or create its target first")
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    path = out
    for part in Path(rel).parts:
        path = path / part
        if path.is_symlink():
            raise ConversionError(f"{path}: is a symbolic link; ckptconv does not write through links inside OUT")
        if path.exists() and not path.is_dir():
            raise ConversionError(f"{path}: exists and is not a directory")
        path.mkdir(exist_ok=True)
    return path


def remove_path(path: Path) -> None:
    """Delete a file or a directory tree; a symbolic link is removed, never followed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def _partial(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


@contextlib.contextmanager
def atomic_target(path: Path, *, needed: int | None = None) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``path``; rename it to ``path`` when the block succeeds.

    The temporary name (``.NAME.partial``) is cleared first without following a link planted
    there, so a write can never land outside OUT. A full disk becomes :class:`DiskFullError`
    naming ``path`` and ``needed`` bytes.
    """
    partial = _partial(path)
    if os.path.lexists(partial):
        remove_path(partial)
    try:
        yield partial
        place(partial, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            remove_path(partial)
        error = disk_full(exc, path, needed)
        if error is None:
            raise
        raise error from exc
    except BaseException:
        with contextlib.suppress(OSError):
            remove_path(partial)
        raise


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (new file, no links followed)."""
    return write_bytes(path, text.encode())


def write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (new file, no links followed)."""
    with atomic_target(path, needed=len(data)) as partial:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return path


def copy_file(source: Path, path: Path) -> Path:
    """Copy a regular file atomically, keeping its permission bits (a 0600 file stays 0600)."""
    mode = os.stat(source).st_mode & 0o777
    with atomic_target(path, needed=os.stat(source).st_size) as partial:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        os.fchmod(fd, mode)  # not widened by the umask either way
        with os.fdopen(fd, "wb") as f, open(source, "rb") as src:
            shutil.copyfileobj(src, f)
    return path


def place(temp_path: Path, final: Path) -> None:
    """Rename a finished temporary file (or directory) to its final name, replacing an older one.

    A symbolic link at ``final`` is replaced, never followed."""
    if final.is_dir() and not final.is_symlink() and temp_path.is_dir():
        shutil.rmtree(final)
    os.replace(temp_path, final)


class Finishing(Protocol):
    """A writer whose :meth:`finish` completes its file(s) in a temp dir and returns their temp paths."""

    def finish(self) -> Iterable[Path]: ...


def move_into_place(sink: Finishing, tmp: Path, out_dir: Path) -> list[Path]:
    """Complete a sink's files and rename them from the temp dir to their final place."""
    moved = []
    for temp_path in sink.finish():
        rel = temp_path.relative_to(tmp)
        final = ensure_dir(out_dir, str(rel.parent)) / rel.name
        place(temp_path, final)
        moved.append(final)
    return moved
