"""The one exception the CLI turns into a one-line message and exit code 1, and the one line a failed process of
``--nproc`` leaves for its launcher (:func:`nxdtrain.parallel.dist.spawn`)."""

from __future__ import annotations

from ckptconv.errors import ConversionError


class TrainError(ConversionError):
    """Bad flags, data or checkpoints: the message names the flag, file or key, expected vs actual, and the fix.

    A subclass of ckptconv's ``ConversionError`` so that errors raised by the shared layout and
    I/O code (an impossible tp for the model, a damaged shard) are reported the same way.
    """


def failure_line(exc: BaseException) -> tuple[str, bool]:
    """(the one-line message of a failed process, whether ``--debug`` asks for its traceback too): worded by the
    error handler both CLIs share (ckptconv.cli), whitespace folded so that the launcher prints one line."""
    from ckptconv.cli import debug_requested, describe

    return " ".join(describe(exc)[0].split()), debug_requested()
