"""How every ``make bench`` script times a command and sizes a tree (``run.py``, ``training_rows.py``,
``reshard_optim.py``): one definition of what a timed run includes.

A timed command runs in a fresh process, its output discarded. ``sync`` runs before it (``cold``: the page cache is
dropped too, where the kernel allows it) and after it, inside its wall time: a conversion and the ``cp -r`` it is
compared with both pay for writing their bytes. CPU seconds (user + system) and the peak RSS are the child's own
``rusage`` (``os.wait4``). A command that fails stops the benchmark.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Run:
    wall: float
    cpu: float  # user + system seconds of the child
    rss: int    # peak RSS, bytes


def drop_caches() -> bool:
    """``sync``, then drop the page cache (needs root); whether it was dropped."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def measure(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None, *,
            cold: bool = False) -> Run:
    """Wall (``sync`` or, ``cold``, :func:`drop_caches` before; command + ``sync`` timed), the child's CPU and peak
    RSS."""
    if cold:
        drop_caches()
    else:
        subprocess.run(["sync"], check=True)
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    subprocess.run(["sync"], check=True)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"benchmark command failed: {' '.join(argv)}")
    return Run(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024)


def du(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
