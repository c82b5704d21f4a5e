"""Numbers as people read them in messages and reports: one function per kind of number.

    >>> human_number(3e-3 * 0.1), human_number(1e-5), human_number(2.0), human_number(7)
    ('0.0003', '1e-05', '2', '7')
    >>> human_bytes(1536), human_bytes(5 * 2**30)
    ('1.5 KiB', '5.0 GiB')
"""

from __future__ import annotations


def human_number(value: float) -> str:
    """A float without its binary noise (``0.00030000000000000003`` -> ``0.0003``): six significant digits."""
    return format(value, ".6g")


def human_bytes(n: int) -> str:
    """A size in binary units, one decimal (bytes whole)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return str(n)
