"""The one top-level error handler of both CLIs (``ckptconv`` and ``nxdtrain``).

Every anticipated failure (bad input, I/O, permissions, a full disk, an interrupt) becomes one
line on stderr, ``PROG: error: <file/key/flag>: <expected, found>``, and exit status 1 (130 for an
interrupt). ``--debug`` or ``CKPTCONV_DEBUG=1`` shows the traceback instead; with ``--json`` a JSON
object ``{"error": ..., "kind": ..., "exit": ...}`` is printed on stdout as well. Warnings raised on the way
become notes (:func:`warnings_as_notes`): ``PROG: note: <text>``, once each, never Python's ``file:line:
UserWarning:`` with a source line.

Example:
    >>> run_guarded("ckptconv", lambda: 0)
    0
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator

from ckptconv.errors import UnsafeCheckpointError
from ckptconv.io.atomic import disk_full

DEBUG_ENV = "CKPTCONV_DEBUG"
DEBUG_HELP = f"show the traceback of an error (also: {DEBUG_ENV}=1)"
INTERRUPTED = 130
_OS_WHY = {
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "no such file or directory",
    errno.EEXIST: "already exists",
    errno.ENOTDIR: "not a directory",
    errno.EISDIR: "is a directory",
    errno.ELOOP: "is a symbolic link (not followed)",
}


def debug_requested(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def describe(exc: BaseException) -> tuple[str, str]:
    """(one-line message, kind) for an anticipated failure; kind 'internal' for anything else."""
    if isinstance(exc, OSError):
        where = exc.filename if exc.filename is not None else "?"
        full = disk_full(exc, where, None)
        if full is not None:
            return str(full), "disk-full"
        why = _OS_WHY.get(exc.errno or 0, exc.strerror or type(exc).__name__)
        target = f" -> {exc.filename2}" if exc.filename2 else ""
        return f"{where}{target}: {why}", "os"
    if isinstance(exc, UnsafeCheckpointError):
        return str(exc), "unsafe"
    if isinstance(exc, ValueError):  # ConversionError and the format readers' errors
        return str(exc), "input"
    if isinstance(exc, KeyError):
        return f"missing key {exc.args[0]!r}" if exc.args else "missing key", "input"
    return f"{type(exc).__name__}: {exc} (unexpected; rerun with --debug for the traceback and report it)", "internal"


def _one_line(text: str) -> str:
    return " ".join(text.split())


RESUME_HINT = "rerun the same command to resume"


def report(prog: str, exc: BaseException, *, as_json: bool = False, debug: bool = False,
           resume_hint: str = RESUME_HINT) -> int:
    """Print the failure as ``prog: error: ...`` (and JSON if asked); return the exit status."""
    if isinstance(exc, KeyboardInterrupt):
        message, kind, status = f"interrupted; {resume_hint}", "interrupted", INTERRUPTED
    else:
        message, kind = describe(exc)
        status = 1
    if debug_requested(debug):
        traceback.print_exception(exc)
    print(f"{prog}: error: {_one_line(message)}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": _one_line(message), "kind": kind, "exit": status}))
    return status


def run_guarded(prog: str, call: Callable[[], int], *, as_json: bool = False, debug: bool = False,
                resume_hint: str = RESUME_HINT) -> int:
    """``call()``, with every failure turned into :func:`report`'s one line and exit status."""
    try:
        return call()
    except (Exception, KeyboardInterrupt) as exc:
        return report(prog, exc, as_json=as_json, debug=debug, resume_hint=resume_hint)


@contextlib.contextmanager
def warnings_as_notes(prog: str, *, quiet: bool) -> Iterator[set[str]]:
    """Collect the warnings raised inside; at the end (a failure included) print each as ``PROG: note: TEXT`` on
    stderr, once, unless ``quiet``. The caller adds to the yielded set the notes its result prints itself, which are
    then not said twice."""
    said: set[str] = set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every one reaches the list; the same text is printed once below
        try:
            yield said
        finally:
            for warning in [] if quiet else caught:
                text = _one_line(str(warning.message))
                if text not in said:
                    said.add(text)
                    print(f"{prog}: note: {text}", file=sys.stderr)
