"""The one exception the CLI turns into a one-line message and exit code 1."""

from __future__ import annotations

from ckptconv.errors import ConversionError


class TrainError(ConversionError):
    """Bad flags, data or checkpoints: the message names the flag, file or key, expected vs actual, and the fix.

    A subclass of ckptconv's ``ConversionError`` so that errors raised by the shared layout and
    I/O code (an impossible tp for the model, a damaged shard) are reported the same way.
    """
