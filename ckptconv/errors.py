"""Exceptions that the CLI turns into one-line messages and exit code 1."""

from enum import Enum
from typing import Any, TypeVar

E = TypeVar("E", bound=Enum)


class ConversionError(ValueError):
    """Bad input or an impossible request: the message names the file, key or flag and the fix."""


class AmbiguousLayout(ConversionError):
    """Shards without a record that fit more than one layout (trn1 and the official trn2): flags must decide."""


class UnfinishedOutput(ConversionError):
    """A directory a ckptconv conversion was writing when it stopped (no ckptconv.json yet): rerun it to finish."""


class VerificationError(ConversionError):
    """A check on data failed (replicas differ, hashes mismatch, numerics out of tolerance)."""


def choice(kind: type[E], value: Any, flag: str) -> E:
    """``kind(value)``, or an error naming the flag, the allowed values and the given one."""
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(member.value) for member in kind)
        raise ConversionError(f"{flag} must be one of {allowed}; got {value!r}") from None


class UnsafeCheckpointError(ValueError):
    """A pickle asked for a global outside the allowlist (raised by :mod:`ckptconv.io.safe_load`)."""


class IntegrityError(VerificationError):
    """A file read does not match its record: size or digest in ckptconv.json, or a zip record's CRC-32.

    ``problem`` is the message without the hint about ``--no-check`` (for tools that have no such flag).
    """

    HINT = "pass --no-check to read it anyway"

    def __init__(self, problem: str) -> None:
        super().__init__(f"{problem} ({self.HINT})")
        self.problem = problem
