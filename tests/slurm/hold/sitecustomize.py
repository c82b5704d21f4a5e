"""A test shim the Slurm lane's cancel test puts on a job's PYTHONPATH, so that cancelling mid-write is not a race
against a conversion that takes a tenth of a second.

With ``CKPTCONV_TEST_HOLD=PATH`` in the environment, a process that has written its first bytes into a file under a
``model/`` directory waits before each later ``os.pwrite`` for as long as PATH exists. Nothing else changes: the bytes
and offsets written are the caller's. Without the variable this file does nothing."""

from __future__ import annotations

import os
import time

_HOLD = os.environ.get("CKPTCONV_TEST_HOLD")

if _HOLD:
    _pwrite = os.pwrite
    _shard_bytes_written = False

    def _held_pwrite(fd: int, data, offset: int) -> int:  # type: ignore[no-untyped-def]
        global _shard_bytes_written
        while _shard_bytes_written and os.path.exists(_HOLD):
            time.sleep(0.05)
        n = _pwrite(fd, data, offset)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc: never holds, and the test then fails on its own check, not in the job
            target = ""
        if n and f"{os.sep}model{os.sep}" in target:
            _shard_bytes_written = True
        return n

    os.pwrite = _held_pwrite
