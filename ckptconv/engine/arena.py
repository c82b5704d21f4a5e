"""The executor's scratch memory: one arena per worker thread that every buffer of a band is carved from, sized
to what the band was budgeted (ckptconv.engine.execute); buffers beyond that are counted as overflows."""

from __future__ import annotations

import threading

import torch

from ckptconv.io import direct_io


class Scratch(threading.local):
    """One arena per thread, reused from band to band, that a band's buffers are carved from.

    Fresh allocations of hundreds of MB would be page-faulted (zeroed) by the kernel every band,
    which costs more than the copy itself. One arena sized to the largest band, rather than a
    buffer per purpose each at its own largest size, keeps a thread's memory at one band: so
    peak RSS is about workers x band size whatever the model, not growing as more kinds of
    band happen to land on each thread."""

    ALIGN = 64
    PAGE = direct_io.ALIGN
    # room for aligning the band's buffers: 64 at 64 bytes, and 96 placed at a page phase (each can skip up to a page;
    # a tp 32 unit of column-major tensors has up to 3 per tensor, band, cast and transpose)
    SLACK = 64 * ALIGN + 96 * PAGE

    def __init__(self) -> None:
        self.arena = torch.empty(0, dtype=torch.uint8)
        self.used = 0
        self.overflows = 0  # buffers the band's budget did not cover (tests check it stays 0)

    def start_band(self, nbytes: int) -> None:
        """Free the previous band's buffers; make room for ``nbytes`` (what the band was budgeted)."""
        nbytes += self.SLACK
        if self.arena.numel() < nbytes:
            self.arena = torch.empty(0, dtype=torch.uint8)  # drop the old arena before the new one
            self.arena = torch.empty(nbytes, dtype=torch.uint8)
        self.used = 0

    def end_band(self, keep: int) -> None:
        """Keep the arena for the next band unless it outgrew ``keep`` (an unsplittable tensor's
        band): one large band must not raise every later band's footprint."""
        if self.arena.numel() > keep + self.SLACK:
            self.arena = torch.empty(0, dtype=torch.uint8)

    def get(self, dtype: torch.dtype, shape: tuple[int, ...], phase: int | None = None) -> torch.Tensor:
        """A buffer from the arena; with ``phase``, one whose address is ``phase`` modulo a page: the file offset
        it will be written at, so that an O_DIRECT write sends it without copying it first (io.direct_io)."""
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        start = -(-self.used // self.ALIGN) * self.ALIGN
        if phase is not None and phase % dtype.itemsize == 0:  # (an element can not straddle: else unplaced)
            start += (phase - self.arena.data_ptr() - start) % self.PAGE
        if start + nbytes > self.arena.numel():
            self.overflows += 1
            return torch.empty(shape, dtype=dtype)  # beyond what the band was budgeted: transient
        self.used = start + nbytes
        return self.arena[start:start + nbytes].view(dtype).view(shape)


SCRATCH = Scratch()
