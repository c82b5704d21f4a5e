"""Exceptions that the CLI turns into one-line messages and exit code 1."""


class ConversionError(ValueError):
    """Bad input or an impossible request: the message names the file, key or flag and the fix."""


class VerificationError(ConversionError):
    """A check on data failed (replicas differ, hashes mismatch, numerics out of tolerance)."""
