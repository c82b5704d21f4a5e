"""CRC-32 (the zip polynomial) of what we write: ISA-L's when installed, about 4x zlib's speed."""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency, but zlib gives the same values
    from zlib import crc32

__all__ = ["crc32"]
