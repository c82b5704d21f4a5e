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
    if "layers" in data and "problems" in data:
        _render_verify(console, data)
        return
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


def _render_verify(console: Console, data: dict[str, Any]) -> None:
    table = Table(title=f"verify (tolerance {data['tol']:g}, relative to the largest reference value)")
    for column in ("layer", "component", "max abs error", "relative", "ranks"):
        table.add_column(column)
    rows = [(str(layer), name, c) for layer, checks in data["layers"].items() for name, c in checks.items()]
    rows += [("-", name, data[name]) for name in ("embedding", "lm_head")]
    for layer, name, c in rows:
        bad = c["rel"] > data["tol"] or c["ranks"]
        style = "red" if bad else None
        table.add_row(layer, name, f"{c['max_abs']:.3g}", f"{c['rel']:.3g}", ", ".join(map(str, c["ranks"])) or "-", style=style)
    console.print(table)
    console.print("[green]OK[/green]: the shards compute what the HF model computes" if data["ok"]
                  else f"[red]FAILED[/red]: {len(data['problems'])} problem(s)")
