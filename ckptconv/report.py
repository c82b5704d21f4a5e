"""Human-readable output of CLI results (rich tables on stdout)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return str(n)


def render(data: dict[str, Any]) -> None:
    console = Console()
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in data.items():
        if key in ("bytes", "bytes_written") and isinstance(value, int):
            value = f"{_size(value)} ({value:,} bytes)"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, list):
            value = "\n".join(str(v) for v in value) if value else "-"
        table.add_row(key, str(value))
    console.print(table)
