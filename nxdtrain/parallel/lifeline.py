"""Workers die with their launcher: no headless training processes after ``kill -9`` of ``nxdtrain run --nproc``.

A launcher killed by SIGKILL (what the OOM killer sends) cannot forward anything to its workers. Two
mechanisms, so that either suffices:

* the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG)``, Linux): a worker's parent is the
  forkserver, which exits as soon as the launcher's end of its pipe closes;
* a watchdog thread that polls the launcher's pid and start time (a reused pid is not the launcher).

    >>> start_time(0) is None    # no such process
    True
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
POLL_S = 0.5  # watchdog period: a worker outlives its launcher by at most about this much


def start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); None if it is gone."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after its closing one.
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[19]) if len(fields) > 19 else None


def alive(pid: int, started: int | None) -> bool:
    """``pid`` still runs and is the process that started at ``started`` (not a later one given the same pid)."""
    now = start_time(pid)
    if now is None:
        try:
            os.kill(pid, 0)  # no /proc (not Linux): existence only
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return started is None
    return started is None or now == started


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_with(launcher_pid: int, launcher_started: int | None) -> None:
    """Make this process end when the launcher ``launcher_pid`` does (parent-death signal, then a watchdog)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still holds
        if os.getppid() != parent:  # the parent died before prctl took effect
            _die()

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(POLL_S):
            if not alive(launcher_pid, launcher_started):
                _die()

    threading.Thread(target=watch, name="nxdtrain-launcher-watchdog", daemon=True).start()
