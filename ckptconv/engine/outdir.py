"""Output directories: what in OUT is ours, one writer at a time, temporary names then rename.

Every command that writes a directory (``ckptconv to-nxd``/``to-hf``/``reshard``/``nxd-compat``/
``finalize``, nxdtrain's tags and exports) goes through this module:

* **Ownership.** A path in OUT is ours when ``OUT/ckptconv.json`` lists it or when a writer declared
  it (:func:`declare`) in ``OUT/.ckptconv-tmp/`` before creating it. Only those are ever removed;
  anything else in OUT (``.git/``, a user's notes) is *foreign* and makes ``--overwrite`` refuse.
* **One writer.** :func:`acquire` takes an advisory ``flock`` on ``OUT/.ckptconv-tmp/lock`` for the
  whole run. The kernel drops it when the holder exits, even by ``kill -9``, so no lock outlives
  its owner. Processes of one ``--part K/N`` conversion share it; anything else is refused with the
  holder's pid, host and command line (recorded in the lock file).
* **Temporary names.** :func:`atomic_target` writes beside the target and renames at the end,
  never through a planted symbolic link.

Example:
    >>> with acquire(Path("out"), fingerprint="f00d") as lock:   # doctest: +SKIP
    ...     write_text(Path("out/config.json"), "{}")
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptconv.errors import ConversionError

# Temporary names then rename, re-exported here: every writer of OUT reaches them through this module.
from ckptconv.io.atomic import (  # noqa: F401
    DiskFullError,
    atomic_target,
    copy_file,
    disk_full,
    ensure_dir,
    place,
    write_bytes,
    write_text,
)
from ckptconv.io.atomic import remove_path as _remove
from ckptconv.io.metadata import METADATA_FILE

TMP_DIR = ".ckptconv-tmp"
LOCK_FILE = "lock"
DECLARED_PREFIX = "owned-"
PART_WAIT_SECONDS = 30.0  # how long a --part process waits for a sibling still setting OUT up


# --------------------------------------------------------------------------------------------
# Where OUT may be


def _inside(child: str, parent: str) -> bool:
    return child != parent and child.startswith(parent.rstrip(os.sep) + os.sep)


def check_separate(sources: Sequence[Path | str], out: Path) -> None:
    """Refuse OUT equal to a source, inside one, or holding one (real paths, symlinks resolved)."""
    o = os.path.realpath(out)
    for source in sources:
        s = os.path.realpath(source)
        if s == o:
            raise ConversionError(f"{out}: is the source {source} itself; choose another OUT")
        if _inside(o, s):
            raise ConversionError(f"{out}: lies inside the source {source}; choose an OUT outside it")
        if _inside(s, o):
            raise ConversionError(f"{out}: holds the source {source}; choose an OUT that does not contain it")


# --------------------------------------------------------------------------------------------
# Ownership


def _plain_rel(rel: Any) -> str | None:
    """``rel`` if it is a relative path that stays inside its directory, else None."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel:
        return None
    parts = rel.split("/")
    return None if any(p in ("", ".", "..") for p in parts) else rel


def declare(out: Path, name: str, paths: list[str]) -> None:
    """Record, before creating them, the paths (files or directories) a writer will put in OUT."""
    text = json.dumps(sorted(set(paths)), indent=0)
    write_text(ensure_dir(out, TMP_DIR) / f"{DECLARED_PREFIX}{name}.json", text)


def owned(out: Path, also: tuple[str, ...] = ()) -> set[str]:
    """Relative paths in OUT that a ckptconv writer provably wrote or declared (plus ``also``:
    names the caller's own format reserves, such as a tag's markers)."""
    found: set[str] = {METADATA_FILE, TMP_DIR, *also}
    sources: list[Any] = []
    meta = out / METADATA_FILE
    if meta.is_file() and not meta.is_symlink():
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(meta.read_text())
            if isinstance(data, dict) and isinstance(data.get("files"), dict):
                sources.append(list(data["files"]))
    tmp = out / TMP_DIR
    if tmp.is_dir() and not tmp.is_symlink():
        for path in tmp.glob(f"{DECLARED_PREFIX}*.json"):
            with contextlib.suppress(OSError, ValueError):
                sources.append(json.loads(path.read_text()))
    for listed in sources:
        if isinstance(listed, list):
            found.update(rel for rel in map(_plain_rel, listed) if rel)
    return found


def foreign(out: Path, also: tuple[str, ...] = ()) -> list[str]:
    """Entries of OUT that are not ours (sorted, top-down; symlinks never followed)."""
    mine = owned(out, also)
    ancestors = {"/".join(rel.split("/")[:i]) for rel in mine for i in range(1, rel.count("/") + 1)}
    strangers: list[str] = []

    def walk(directory: Path, prefix: str) -> None:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            rel = prefix + entry.name
            if rel in mine:
                continue
            if rel in ancestors and entry.is_dir(follow_symlinks=False):
                walk(Path(entry.path), rel + "/")
            else:
                strangers.append(rel + ("/" if entry.is_dir(follow_symlinks=False) else ""))

    if out.is_dir():
        walk(out, "")
    return strangers


def present(out: Path) -> list[str]:
    """Our entries that exist in OUT (besides the temporary directory)."""
    return sorted(rel for rel in owned(out) - {TMP_DIR} if os.path.lexists(out / rel))


def remove_owned(out: Path, *, also: tuple[str, ...] = (), keep: tuple[str, ...] = (LOCK_FILE,)) -> None:
    """Delete what is ours in OUT: ``also`` and ``ckptconv.json`` first (so nothing looks complete
    meanwhile), then the listed files and directories, the directories they leave empty, and the
    temporary directory except ``keep``. Foreign entries are left alone."""
    mine = owned(out, also)
    first = [*also, METADATA_FILE]
    for rel in [*first, *sorted(mine - {*first, TMP_DIR}, key=lambda r: -r.count("/"))]:
        _remove(out / rel)
    for rel in sorted({str(Path(r).parent) for r in mine if "/" in r}, key=lambda r: -r.count("/")):
        with contextlib.suppress(OSError):
            (out / rel).rmdir()  # only when empty
    clear_tmp(out, keep=keep)


def clear_tmp(out: Path, *, keep: tuple[str, ...] = (LOCK_FILE,)) -> None:
    tmp = out / TMP_DIR
    if tmp.is_dir() and not tmp.is_symlink():
        for entry in tmp.iterdir():
            if entry.name not in keep:
                _remove(entry)


# --------------------------------------------------------------------------------------------
# One writer


class OutLock:
    """An advisory lock on OUT held by this process; see :func:`acquire`."""

    def __init__(self, out: Path, fd: int, shared: bool) -> None:
        self.out, self.fd, self.shared = out, fd, shared

    @property
    def path(self) -> Path:
        return self.out / TMP_DIR / LOCK_FILE

    def share(self) -> None:
        """Let sibling ``--part`` processes in (after this one set OUT up)."""
        fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        self.shared = True

    def try_exclusive(self) -> bool:
        """Become the only holder (to finalize); False while siblings still hold it. On False the
        lock may be lost (flock converts by unlock-then-lock): this process's part is done anyway."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.shared = False
        return True

    def release(self) -> None:
        if self.fd < 0:
            return
        if not self.shared:
            tmp = self.out / TMP_DIR
            # Done and alone: drop the temporary directory if nothing but the lock is left in it.
            with contextlib.suppress(OSError):
                if [p.name for p in tmp.iterdir()] == [LOCK_FILE]:
                    self.path.unlink()
                    tmp.rmdir()
        os.close(self.fd)  # closing drops the flock
        self.fd = -1

    def __enter__(self) -> OutLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text() or "{}")
        if isinstance(data, dict):
            return data
    return {}


class BusyError(ConversionError):
    """OUT is held by another live writer; ``holder`` is its record (pid, host, started, command), or {}."""

    def __init__(self, message: str, holder: dict[str, Any]) -> None:
        super().__init__(message)
        self.holder = holder


def describe_holder(holder: dict[str, Any]) -> str:
    """``pid 123 on host: command`` of a lock record (what a refusal names)."""
    if not holder:
        return "a process that has not yet said who it is"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}: {holder.get('command', '?')}"


def _busy(out: Path, holder: dict[str, Any]) -> BusyError:
    return BusyError(f"{out}: in use by another writer ({describe_holder(holder)}); wait for it to finish or "
                     "choose another OUT", holder)


def last_holder(out: Path) -> dict[str, Any]:
    """The record of the last process that held OUT's lock (pid, host, started, command), or {}: what an
    interrupted run left to name the command to rerun."""
    return _holder(out / TMP_DIR / LOCK_FILE)


def check_free(out: Path) -> None:
    """Raise :class:`BusyError` when a live process holds OUT's lock (creates nothing; a lock left by a
    dead process is free: the kernel dropped its flock)."""
    path = out / TMP_DIR / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return  # no lock file (or not one we would follow): nobody holds OUT
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(out, _holder(path)) from None
    finally:
        os.close(fd)


def _open_lock(out: Path) -> tuple[int, Path]:
    tmp = ensure_dir(out, TMP_DIR)
    path = tmp / LOCK_FILE
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, 0o644), path
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConversionError(f"{path}: is a symbolic link; remove it (ckptconv never writes through one)") from None
        raise


def _still_linked(fd: int, path: Path) -> bool:
    """The lock file we hold is still the one at ``path`` (a finishing holder may have removed it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)


def acquire(out: Path, *, fingerprint: str, parts: int = 1, command: str | None = None) -> OutLock:
    """Lock OUT for this process: exclusively, or shared with the ``--part`` siblings of one conversion.

    The first process of a conversion gets the lock exclusively (to check and clean OUT); with
    ``parts`` > 1 it then calls :meth:`OutLock.share` so its siblings (same fingerprint, same N)
    can join. Anything else is refused with a one-line error naming the holder.
    """
    deadline = time.monotonic() + PART_WAIT_SECONDS
    record = {"pid": os.getpid(), "host": socket.gethostname(), "fingerprint": fingerprint, "parts": parts,
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300]}
    while True:
        fd, path = _open_lock(out)
        mode = _try_lock(fd, path, record, parts, out)
        if mode == "retry":
            os.close(fd)
            if time.monotonic() > deadline:
                raise _busy(out, _holder(path))
            time.sleep(0.05)
            continue
        lock = OutLock(out, fd, shared=mode == "shared")
        if mode == "exclusive":
            _unlink_symlinks(out / TMP_DIR)
        return lock


def _try_lock(fd: int, path: Path, record: dict[str, Any], parts: int, out: Path) -> str:
    """'exclusive', 'shared' or 'retry'; raises when another conversion holds OUT."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pass
    else:
        if not _still_linked(fd, path):
            return "retry"
        data = json.dumps(record).encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        return "exclusive"
    holder = _holder(path)
    if not holder:
        return "retry"  # the holder has not written its record yet
    sibling = parts > 1 and holder.get("fingerprint") == record["fingerprint"] and holder.get("parts") == parts
    if not sibling:
        os.close(fd)
        raise _busy(out, holder)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return "retry"  # the first sibling is still setting OUT up
    return "shared" if _still_linked(fd, path) else "retry"


def _unlink_symlinks(tmp: Path) -> None:
    """Remove symbolic links planted in our temporary directory (never followed, never written through)."""
    for root, dirs, files in os.walk(tmp):
        for name in dirs + files:
            path = Path(root) / name
            if path.is_symlink():
                path.unlink()


# --------------------------------------------------------------------------------------------
# Files copied from a source


def confined_files(root: Path, sub: str, names: list[str], notes: list[str]) -> list[tuple[str, str]]:
    """(name, real path) of the files ``root/sub/NAME`` that may be copied: regular files whose real
    path stays inside ``root``. A link leading out of ``root`` is skipped with a note, never followed.

    A Hugging Face hub cache snapshot (``snapshots/REV/f -> ../../blobs/H``) counts as inside: its
    files are links into the same model's ``blobs/``."""
    base = os.path.realpath(root)
    allowed = [base]
    if Path(base).parent.name == "snapshots":
        allowed.append(os.path.join(os.path.dirname(os.path.dirname(base)), "blobs"))
    found = []
    for name in names:
        path = root / sub / name if sub else root / name
        real = os.path.realpath(path)
        if not any(_inside(real, a) for a in allowed):
            notes.append(f"skipped {path}: a symbolic link to {real}, outside {root}")
        elif not os.path.isfile(real):
            notes.append(f"skipped {path}: not a regular file")
        else:
            found.append((name, real))
    return found
