"""Human-readable output of CLI results on stdout: rich tables on a terminal, plain lines elsewhere.

Not a terminal (a Slurm log, a pipe, a file) means no width to fit: every value is printed whole,
as ``key: value`` lines, never cut or padded to 80 columns. On a terminal long values wrap (long
words fold) inside the table; nothing is replaced by an ellipsis. ``--json`` does not come here.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from ckptconv.cli.errors import warnings_as_notes
from ckptconv.core.human import human_bytes


def reported(prog: str, call: Callable[[], Any], *, as_json: bool, quiet: bool) -> Any:
    """``call()``'s result printed on stdout (:func:`render`, or JSON), the warnings raised meanwhile said as
    ``PROG: note:`` lines (none with ``quiet`` or ``as_json``), each once and never again where the result's own notes
    say it; the result returned. Both CLIs print a conversion's result this way."""
    with warnings_as_notes(prog, quiet=quiet or as_json) as said:
        result = call()
        said.update(" ".join(str(note).split()) for note in _data(result).get("notes") or [])
    if as_json:
        print(json.dumps(_data(result), indent=1))
    else:
        render(_data(result))
    return result


def _data(result: Any) -> dict[str, Any]:
    return result if isinstance(result, dict) else result.to_json()


def _text(key: str, value: Any) -> str:
    if key in ("bytes", "bytes_written") and isinstance(value, int):
        return f"{human_bytes(value)} ({value:,} bytes)"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list):
        return "\n".join(str(v) for v in value) if value else "-"
    return str(value)


def render(data: dict[str, Any], file: TextIO | None = None) -> None:
    """A result dict (what ``--json`` prints) for people."""
    out = file or sys.stdout
    if "layers" in data and "problems" in data:
        _render_verify(data, out)
        return
    key_values([(key, _text(key, value)) for key, value in data.items()], file=out)


def key_values(rows: list[tuple[str, str]], *, title: str | None = None, right: bool = False,
               file: TextIO | None = None) -> None:
    """Label/value rows: a rich table on a terminal, ``label: value`` lines otherwise (multi-line
    values continue indented). ``right`` aligns the values right in the table (numbers)."""
    out = file or sys.stdout
    if not out.isatty():
        if title:
            print(title, file=out)
        for label, value in rows:
            first, *more = value.split("\n")
            print(f"{label}: {first}", file=out)
            for line in more:
                print(f"  {line}", file=out)
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(file=out)
    if title:
        console.print(title, highlight=False, soft_wrap=True)
    table = Table(show_header=False, box=None, pad_edge=False) if not right else Table(show_header=False)
    table.add_column(style="bold", overflow="fold")
    table.add_column(justify="right" if right else "left", overflow="fold")
    for label, value in rows:
        table.add_row(label, value)
    console.print(table)


def _verify_rows(data: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    rows = [(str(layer), name, c) for layer, checks in data["layers"].items() for name, c in checks.items()]
    return rows + [("", name, data[name]) for name in ("embedding", "lm_head")]  # not a layer's


def _verdict(data: dict[str, Any]) -> tuple[str, str]:
    """(label, what) of a verify result's last line."""
    if data["ok"]:
        return "OK", "the shards compute what the HF model computes"
    if "trained" in data:
        return "DIFFERS", "by the training, not the conversion (see the first line)"
    return "FAILED", f"{len(data['problems'])} problem(s)"


def _rank_blame(ranks: list[int]) -> str:
    """The ranks whose own piece differs, for a table cell ("none" when no rank was found at fault)."""
    return ", ".join(map(str, ranks)) if ranks else "none"


def _render_verify(data: dict[str, Any], out: TextIO) -> None:
    title = f"verify (tolerance {data['tol']:g}, relative to the largest reference value)"
    label, what = _verdict(data)
    if "trained" in data:  # said before any number, so that no difference reads as the converter's fault
        print(f"note: {data['trained']['message']}", file=out)
    if not out.isatty():
        print(title, file=out)
        for layer, name, c in _verify_rows(data):
            where = f"layer {layer} {name}" if layer else name
            ranks = f", differs on rank(s) {_rank_blame(c['ranks'])}" if c["ranks"] else ""
            print(f"{where}: max abs error {c['max_abs']:.3g}, relative {c['rel']:.3g}{ranks}", file=out)
        print(f"{label}: {what}", file=out)
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(file=out)
    table = Table(title=title)
    for column in ("layer", "component", "max abs error", "relative", "ranks that differ"):
        table.add_column(column, overflow="fold")
    for layer, name, c in _verify_rows(data):
        bad = c["rel"] > data["tol"] or c["ranks"]
        table.add_row(layer, name, f"{c['max_abs']:.3g}", f"{c['rel']:.3g}", _rank_blame(c["ranks"]),
                      style="red" if bad else None)
    console.print(table)
    console.print(f"[{'green' if data['ok'] else 'red'}]{label}[/]: {what}")
