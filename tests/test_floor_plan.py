"""docs/architecture.md's floor plan names every module of ckptconv, room by room (a module the plan leaves out is
a room a newcomer cannot find)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _plan_block(package: str) -> str:
    """The lines of the floor plan's code block from ``package/`` to the next top-level entry."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Folders by role", 1)[1].split("```", 2)[1]
    start = block.index(f"\n{package}/")
    end = re.search(r"\n\S", block[start + 1:])
    return block[start:start + 1 + end.start()] if end else block[start:]


def _rooms(text: str) -> dict[str, str]:
    """Room (its folder, relative to the package) -> the plan's text from its line to the next room's."""
    out: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        depth = (len(line) - len(line.lstrip())) // 2
        m = re.match(r"^\s+([a-z_]+)/\s", line + " ")
        if m:
            current = m.group(1) if depth <= 1 else f"{current.split('/')[0]}/{m.group(1)}"
        elif depth in (1, 2) and re.match(r"^\s+[a-z_]+\.py\s", line):  # a module after a (sub-)room's lines
            current = current.split("/")[0] if depth == 2 else ""
        out[current] = out.get(current, "") + line + "\n"
    return out


def test_every_ckptconv_module_is_named_in_its_room():
    rooms = _rooms(_plan_block("ckptconv"))
    missing = []
    for path in sorted((REPO / "ckptconv").rglob("*.py")):
        rel = path.relative_to(REPO / "ckptconv")
        if path.name == "__init__.py":
            continue
        room = "/".join(rel.parts[:-1])
        named = rooms.get(room, "") + (rooms.get(room.split("/")[0], "") if room else "")
        if not re.search(rf"(?<![\w/]){re.escape(path.name)}", named):
            missing.append(str(rel))
    assert missing == []


def test_a_module_left_out_is_named():
    rooms = _rooms("ckptconv/\n  io/           hf.py, nxd.py\n  training/     ep.py\n    nxd_format/ read.py\n"
                   "    state.py    the room's own\n")
    assert "hf.py" in rooms["io"] and "read.py" in rooms["training/nxd_format"] and "read.py" not in rooms["training"]
    assert "state.py" in rooms["training"] and "state.py" not in rooms["training/nxd_format"]
