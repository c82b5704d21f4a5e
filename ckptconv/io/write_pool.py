"""The records of the files written in a block spread over a pool of threads (nxdtrain's synchronous saves).

A training save stalls training until its bytes are written; on one thread per file its time is the largest file's
copy into the page cache, CRC-32 and BLAKE3, while the other cores wait. Inside :func:`spreading`, the writers that
fill a file record by record (:func:`ckptconv.io.torch_save.save_object`, ``ckptconv.io.nxd_write.save_shard``)
hand each record to the block's pool (:func:`each`), so two files of 124 and 247 MB take about the time of their
mean on two threads, not of the larger. Records of one file written at once by several threads are hashed in file
order by its :class:`ckptconv.io.write_digest.WriteDigest`, which must then ``hold`` (the caller keeps every
record's memory unchanged until the file is finished; a training save does: training waits). Outside
:func:`spreading` every record is written in the calling thread, as before.

    >>> with spreading(4):                                        # doctest: +SKIP
    ...     each(lambda item: writer.write_tensor(*item), tensors.items())
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_POOL: contextvars.ContextVar[Executor | None] = contextvars.ContextVar("ckptconv_write_pool", default=None)


@contextlib.contextmanager
def spreading(threads: int) -> Iterator[None]:
    """Records written by :func:`each` in this block (and in threads started with a copy of its context) run on
    ``threads`` threads (1: in the calling thread)."""
    if threads <= 1:
        yield
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="save-records") as pool:
        token = _POOL.set(pool)
        try:
            yield
        finally:
            _POOL.reset(token)


def each(write: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``write(item)`` for every item, in order: on the active pool, or here; their results in order. Returns once
    every call ended (a file is never finished or closed under a running write); the first error, if any, is raised
    then."""
    pool = _POOL.get()
    if pool is None:
        return [write(item) for item in items]
    context = contextvars.copy_context()  # recording's digests and direct_writes, as in the caller

    def run(item: T) -> R:
        _POOL.set(None)  # a write that writes a file of its own does so in its thread: none waits on a busy pool
        return write(item)

    futures = [pool.submit(context.copy().run, run, item) for item in items]
    wait(futures)
    return [future.result() for future in futures]
