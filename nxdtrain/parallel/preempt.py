"""Preemption: SIGTERM or SIGINT stops every rank at the same step boundary, never inside a save.

While a run trains, the two signals only set a flag (:class:`Preemption`); the loop asks
:meth:`Preemption.requested` at each step boundary and before each save, an all-reduce (MAX) of the
flags, so that one rank's signal stops the world at the same step even when the others' signal comes
later or never (torchrun forwards it to its local workers, Slurm sends it to every task, a user may
``kill`` one process). A save that has started when a signal comes is finished by every rank (the tag
gets its markers) before the loop looks again; no save starts once a stop is agreed. A save whose files a
background thread still writes (``--async-save``) is completed before the run stops: the main thread waits for
every rank's writes, then the tag gets its markers. Repeated signals change nothing (a launcher and Slurm both send one); what ends a run that cannot finish its
save within the grace time is SIGKILL, and a tag it cuts short has no ``done`` marker.

    >>> stop = Preemption(group=None, device="cpu")
    >>> stop.signum, stop.agreed
    (0, 0)
"""

from __future__ import annotations

import signal
import threading
from typing import Any

STOPS = (signal.SIGTERM, signal.SIGINT)


def handle(signums: tuple[int, ...], handler: Any) -> dict[int, Any]:
    """``handler`` for ``signums`` in this process; the handlers it replaced (for :func:`restore`). Off the main
    thread nothing changes (Python runs handlers there only; its caller handles them there)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, handler) for signum in signums}


def restore(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


class Preemption:
    """While active (``with``), SIGTERM and SIGINT to this process are recorded, not acted on."""

    def __init__(self, group: Any, device: Any) -> None:
        self.group = group    # the run's gloo host group on xla (a host tensor then), else None: the default group
        self.device = "cpu" if group is not None else device
        self.signum = 0       # the first signal this process got
        self.agreed = 0       # the signal the world stopped for (0: none yet)
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum

    def __enter__(self) -> Preemption:
        self._previous = handle(STOPS, self._record)
        return self

    def __exit__(self, *exc: Any) -> None:
        restore(self._previous)

    def requested(self) -> bool:
        """Collective over the world: whether any rank got a signal (then ``agreed`` is the highest one)."""
        import torch
        import torch.distributed as dist

        if not self.agreed and dist.get_world_size(self.group) == 1:  # no one else to agree with
            self.agreed = self.signum
        elif not self.agreed:
            flag = torch.tensor([self.signum], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            self.agreed = int(flag.item())
        return bool(self.agreed)
